"""The cost model the memory planner uses: device profiles (:mod:`.profiles`) and static byte,
FLOP and time estimates of FX graph nodes (:mod:`.graph_costs`). It predicts and measures no
step: measurement of real steps is :mod:`mxcompile.measure`, which sits above the backend."""

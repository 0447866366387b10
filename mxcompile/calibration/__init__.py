"""Calibration: this machine's device profile, measured by micro-benchmarks and cached.

The cost model (:mod:`mxcompile.cost`) prices a graph with a
:class:`~mxcompile.cost.profiles.DeviceProfile` and measures nothing. A GPU's profile is its
datasheet's; a CPU has no datasheet, so :func:`mxcompile.calibration.cpu.measure_cpu_profile`
times one (matmuls, a DRAM copy, the compiled MX quantize, the MX attention op), once per
CPU model and instruction set, and caches it on disk. The memory-plan pass asks for it when
it plans a CPU graph. It sits above the ops it times and below the passes; measuring whole
training steps is :mod:`mxcompile.measure`'s, above the backend.

Nothing is imported here: importing the package measures nothing.
"""

"""Measurement of real steps: peak memory and step time. It sits above the backend (its step
factories compile models) and below its users: :mod:`mxcompile.profiling`, the CLI, the
benchmarks and the tests. The cost model (:mod:`mxcompile.cost`) predicts; this package measures.

- :mod:`.memory`: in this process: the peak resident set of one step (VmHWM), malloc settings
  that make it meaningful, and the peak of live tensor storage from torch.profiler's events.
- :mod:`.timing`: step times in this process, and the machine's load.
- :mod:`.fresh_process`: the memory peak of one step from a named factory, in a fresh process.
- :mod:`.steps`: the step factories (GPT and Llama models under torch's and mxfp8's memory
  budgets) and timed peak measurement in one child process.

Nothing is imported here: the measuring child starts from :mod:`.fresh_process` alone.
"""

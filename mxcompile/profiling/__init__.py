"""Measurements behind `mxcompile profile`, one concept per module:

- :mod:`.layer_error`: the numerical error (SQNR) of each GEMM of every MX-converted linear
  layer against float64, and block statistics of its operands (saturation, flush to zero,
  scale range); eager, in this process.
- :mod:`.step_profile`: a compiled training step's times, peak memory, memory timeline and
  operator table (run it in a fresh process; the measuring itself is :mod:`mxcompile.measure`).
- :mod:`.document`: the JSON document of a profile run (report.json).
- :mod:`.cotangents`: the seeded output gradient both backward passes start from.

The names below are the public API; the CLI renders these records.
"""

from ..measure.memory import US_PER_MS
from .cotangents import DEFAULT_COTANGENT_SEED, differentiable_outputs, make_cotangents
from .document import PROFILE_SCHEMA_VERSION, compare_steps, json_safe, profile_document
from .layer_error import (
    GEMM_KINDS,
    GEMM_STATUSES,
    BlockStats,
    GemmError,
    LayerError,
    block_stats,
    linear_errors,
    mx_roundtrip,
    sqnr_db,
)
from .step_profile import (
    OPERATOR_CLASSES,
    OTHER_OPERATOR_CLASS,
    OperatorTime,
    StepProfile,
    classify_operator,
    compile_for_backend,
    profile_training_step,
)

__all__ = [
    "BlockStats",
    "DEFAULT_COTANGENT_SEED",
    "GEMM_KINDS",
    "GEMM_STATUSES",
    "GemmError",
    "LayerError",
    "OPERATOR_CLASSES",
    "OTHER_OPERATOR_CLASS",
    "OperatorTime",
    "PROFILE_SCHEMA_VERSION",
    "StepProfile",
    "US_PER_MS",
    "block_stats",
    "classify_operator",
    "compare_steps",
    "compile_for_backend",
    "differentiable_outputs",
    "json_safe",
    "linear_errors",
    "make_cotangents",
    "mx_roundtrip",
    "profile_document",
    "profile_training_step",
    "sqnr_db",
]

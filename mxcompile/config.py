"""`MXConfig`: the one frozen object that carries every mxcompile setting, from
`torch.compile(..., options={...})` to the passes, the planner and the lowering.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping

from .numerics import DEFAULT_BLOCK_SIZE, ElemFormatName, ScaleMode, check_block_size
from .numerics.formats import NamedEnum
from .planner.budget import MemoryBudget


# How many of the closest module names a pattern that matches none is shown with.
CLOSEST_NAMES_SHOWN = 3


class AttentionMode(NamedEnum):
    """Which attention GEMMs go to MXFP8: all six, only S = Q·Kᵀ and its backward, or none."""

    BOTH = "both"
    QK_ONLY = "qk_only"
    OFF = "off"


class GemmKernel(NamedEnum):
    """What runs an MX GEMM in a compiled CUDA graph. `TRITON`: the Triton MX GEMM kernel
    (`tl.dot_scaled`: MX tensor cores on sm100+, emulated through bf16 by Triton below).
    `DEQUANTIZED`: Inductor's GEMM (cuBLAS) of the operands dequantized to bf16 (fp32 for fp32
    outputs), which is exact, so the products are the MX products. `AUTO`: `TRITON` where the GPU
    has MX tensor cores, `DEQUANTIZED` elsewhere. CPU graphs always take the dequantized form."""

    AUTO = "auto"
    TRITON = "triton"
    DEQUANTIZED = "dequantized"


class FsdpAllGather(NamedEnum):
    """The dtype FSDP2 weight shards travel in: high precision, or MXFP8 quantized before the all-gather."""

    BF16 = "bf16"
    MXFP8 = "mxfp8"


_ENUM_FIELDS: dict[str, type[enum.Enum]] = {
    "forward_elem": ElemFormatName,
    "grad_elem": ElemFormatName,
    "scale_mode": ScaleMode,
    "attention": AttentionMode,
    "gemm_kernel": GemmKernel,
    "fsdp_all_gather": FsdpAllGather,
}


def _enum_choice(name: str, value: Any, kind: type[enum.Enum]) -> enum.Enum:
    """`value` (a member of `kind` or its string) as the member; an error naming the field otherwise."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not accepted; accepted: {[m.value for m in kind]}") from None


@dataclass(frozen=True)
class MXConfig:
    """Every setting of the mxfp8 backend. Defaults follow NVIDIA's MXFP8 pre-training recipe:
    e4m3 elements for every GEMM operand, rceil scales, blocks of 32 along each operand's own
    contraction axis."""

    # Numerics: element format per role.
    forward_elem: ElemFormatName = ElemFormatName.E4M3  # activations and weights in the output GEMM Y = X Wt
    grad_elem: ElemFormatName = ElemFormatName.E4M3  # gradients dY in the dX and dW GEMMs
    scale_mode: ScaleMode = ScaleMode.RCEIL
    block_size: int = DEFAULT_BLOCK_SIZE
    hp_weight_grad: bool = False  # keep dW = dYt X in high precision

    # Which GEMMs are converted.
    include: tuple[str, ...] = ()  # regexes on module names; empty means all modules
    exclude: tuple[str, ...] = ()  # regexes on module names; wins over include
    min_gemm_flops: int = 0  # GEMMs with fewer FLOPs (2*M*N*K) stay in high precision
    attention: AttentionMode = AttentionMode.BOTH
    # Smooth-SwiGLU: scale the down projection's input per hidden channel by a power of two
    # (and its weight by the inverse) before MX quantization (passes/smooth_swiglu.py).
    smooth_swiglu: bool = False

    # Lowering.
    gemm_kernel: GemmKernel = GemmKernel.AUTO

    # Memory planner.
    # Bytes or a fraction of the activation headroom; options also take '6GiB', '50%' or a float
    # fraction (a bare int is rejected: see `MemoryBudget.parse`). None: no plan.
    memory_budget: MemoryBudget | None = None
    offload: bool = False

    # Distributed.
    fsdp_all_gather: FsdpAllGather = FsdpAllGather.BF16  # MXFP8 quantizes FSDP2 weight shards before all-gather

    # Robustness.
    fallback: bool = True  # a failure inside a pass warns and runs the unrewritten graph

    def __post_init__(self) -> None:
        # Strings (as options give them) become enum members here, once; mxcompile reads members.
        for name, kind in _ENUM_FIELDS.items():
            object.__setattr__(self, name, _enum_choice(name, getattr(self, name), kind))
        check_block_size(self.block_size)
        for name in ("hp_weight_grad", "offload", "fallback", "smooth_swiglu"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is not accepted; accepted: True or False")
        if isinstance(self.min_gemm_flops, bool) or not isinstance(self.min_gemm_flops, int) or self.min_gemm_flops < 0:
            raise ValueError(f"min_gemm_flops={self.min_gemm_flops!r}: give a non-negative int")
        for name in ("include", "exclude"):
            patterns = getattr(self, name)
            if isinstance(patterns, str):
                patterns = (patterns,)
            patterns = tuple(patterns)
            for pattern in patterns:
                try:
                    re.compile(pattern)
                except (re.error, TypeError) as err:
                    raise ValueError(f"{name} pattern {pattern!r} is not a valid regular expression: {err}") from None
            object.__setattr__(self, name, patterns)
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", MemoryBudget.parse(self.memory_budget))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> "MXConfig":
        """Build from `torch.compile(..., options=...)`; unknown keys are an error listing the known."""
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown mxfp8 option(s) {unknown}; accepted options: {sorted(known)}"
            )
        return cls(**options)

    def replace(self, **changes: Any) -> "MXConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable fields: enum members as their string values, the memory budget as
        `MemoryBudget.to_json` writes it (each reads back through `MXConfig(**d)`)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.memory_budget is not None:
            values["memory_budget"] = self.memory_budget.to_json()
        return {name: value.value if isinstance(value, enum.Enum) else value for name, value in values.items()}

    def unmatched_module_patterns(self, module_names: Iterable[str]) -> list[str]:
        """A message for each include/exclude pattern that matches none of `module_names`,
        naming the closest names (such a pattern selects nothing, which is never intended)."""
        names = sorted(set(module_names))
        messages = []
        for field_name in ("include", "exclude"):
            for pattern in getattr(self, field_name):
                if any(re.search(pattern, name) for name in names):
                    continue
                close = difflib.get_close_matches(pattern, names, n=CLOSEST_NAMES_SHOWN, cutoff=0.0)
                messages.append(f"mxcompile {field_name} pattern {pattern!r} matches no module of this graph "
                                f"(module names are named_modules() names); closest: {close}")
        return messages

    def module_selected(self, module_name: str) -> tuple[bool, str]:
        """Whether include/exclude rules admit a module, and why not when they don't."""
        for pattern in self.exclude:
            if re.search(pattern, module_name):
                return False, f"module '{module_name}' matches exclude pattern {pattern!r}"
        if self.include and not any(re.search(p, module_name) for p in self.include):
            return False, f"module '{module_name}' matches no include pattern {list(self.include)}"
        return True, ""

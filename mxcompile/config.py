"""`MXConfig`: the one frozen object that carries every mxcompile setting, from
`torch.compile(..., options={...})` to the passes, the planner and the lowering.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

from .numerics import DEFAULT_BLOCK_SIZE, ELEM_FORMATS, ScaleMode, check_block_size

_BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_BYTES_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")
_FSDP_ALL_GATHER_MODES = ("bf16", "mxfp8")
_ATTENTION_MODES = ("off", "qk_only", "both")


def parse_memory_budget(value: Any) -> int | float | None:
    """A budget in bytes (int, or a string such as "6GiB") or a fraction in (0, 1] of the
    activation memory with everything kept (float). None means no budget."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"memory_budget={value!r}: give bytes (int or '6GiB') or a fraction in (0, 1]")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"memory_budget={value!r}: a byte budget must be positive")
        return value
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(
                f"memory_budget={value!r}: a fractional budget must lie in (0, 1]; "
                "give bytes as an int or a string such as '6GiB'"
            )
        return value
    if isinstance(value, str):
        match = _BYTES_PATTERN.match(value)
        unit = match.group(2).upper() if match else ""
        if match and (unit or "B") in _BYTE_UNITS:
            return int(float(match.group(1)) * _BYTE_UNITS[unit or "B"])
    raise ValueError(
        f"memory_budget={value!r} is not understood; accepted: bytes as an int, a string with a "
        f"unit in {sorted(_BYTE_UNITS)} (e.g. '6GiB'), or a fraction in (0, 1]"
    )


def _check_choice(name: str, value: Any, accepted: tuple[str, ...] | list[str]) -> None:
    if value not in accepted:
        raise ValueError(f"{name}={value!r} is not accepted; accepted: {list(accepted)}")


@dataclass(frozen=True)
class MXConfig:
    """Every setting of the mxfp8 backend. Defaults follow NVIDIA's MXFP8 pre-training recipe:
    e4m3 elements for every GEMM operand, rceil scales, blocks of 32 along each operand's own
    contraction axis."""

    # Numerics: element format per role.
    forward_elem: str = "e4m3"  # activations and weights in the output GEMM Y = X Wt
    grad_elem: str = "e4m3"  # gradients dY in the dX and dW GEMMs
    scale_mode: str = "rceil"
    block_size: int = DEFAULT_BLOCK_SIZE
    hp_weight_grad: bool = False  # keep dW = dYt X in high precision

    # Which GEMMs are converted.
    include: tuple[str, ...] = ()  # regexes on module names; empty means all modules
    exclude: tuple[str, ...] = ()  # regexes on module names; wins over include
    min_gemm_flops: int = 0  # GEMMs with fewer FLOPs (2*M*N*K) stay in high precision
    attention: str = "both"  # "both", "qk_only" or "off"

    # Memory planner.
    memory_budget: int | float | None = None  # bytes, or a fraction of keep-everything memory
    offload: bool = False

    # Distributed.
    fsdp_all_gather: str = "bf16"  # "mxfp8" quantizes FSDP2 weight shards before all-gather

    # Robustness.
    fallback: bool = True  # a failure inside a pass warns and runs the unrewritten graph

    def __post_init__(self) -> None:
        _check_choice("forward_elem", self.forward_elem, sorted(ELEM_FORMATS))
        _check_choice("grad_elem", self.grad_elem, sorted(ELEM_FORMATS))
        _check_choice("scale_mode", self.scale_mode, [m.value for m in ScaleMode])
        check_block_size(self.block_size)
        _check_choice("attention", self.attention, _ATTENTION_MODES)
        _check_choice("fsdp_all_gather", self.fsdp_all_gather, _FSDP_ALL_GATHER_MODES)
        for name in ("hp_weight_grad", "offload", "fallback"):
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
        object.__setattr__(self, "memory_budget", parse_memory_budget(self.memory_budget))

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
        return dataclasses.asdict(self)

    def module_selected(self, module_name: str) -> tuple[bool, str]:
        """Whether include/exclude rules admit a module, and why not when they don't."""
        for pattern in self.exclude:
            if re.search(pattern, module_name):
                return False, f"module '{module_name}' matches exclude pattern {pattern!r}"
        if self.include and not any(re.search(p, module_name) for p in self.include):
            return False, f"module '{module_name}' matches no include pattern {list(self.include)}"
        return True, ""

"""`MXConfig`: the one frozen object that carries every mxcompile setting, from
`torch.compile(..., options={...})` to the passes, the planner and the lowering.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import re
from dataclasses import dataclass, fields
from typing import Any, Collection, Iterable, Mapping, Sequence, Union

from .numerics import DEFAULT_BLOCK_SIZE, ElemFormatName, ScaleMode, check_block_size
from .numerics.formats import BITS_PER_BYTE, MXFP4, MXFP8_E4M3, MXFP8_E5M2, NVFP4, BlockFormat, NamedEnum
from .planner.budget import MemoryBudget


# Every reason an FP4 recipe's high_precision_layers rule gives for a layer it keeps begins so
# (`MXConfig.high_precision_modules`), and so does the reason of attention GEMMs kept by the
# recipe's default attention="off" (passes/attention_rewrite.py): the report and the backend's
# warning tell these choices of the recipe from GEMMs kept for any other reason.
RECIPE_KEEPS_REASON_PREFIX = "high_precision_layers"
RECIPE_ATTENTION_REASON_PREFIX = "the recipe's attention='off'"
RECIPE_KEEPS_REASON_PREFIXES = (RECIPE_KEEPS_REASON_PREFIX, RECIPE_ATTENTION_REASON_PREFIX)
# How many of the closest module names a pattern that matches none is shown with.
CLOSEST_NAMES_SHOWN = 3


class AttentionMode(NamedEnum):
    """Which attention GEMMs go to MXFP8: all six, only S = Q·Kᵀ and its backward, or none."""

    BOTH = "both"
    QK_ONLY = "qk_only"
    OFF = "off"


class GemmKernel(NamedEnum):
    """What runs an MX GEMM in a compiled CUDA graph. `TRITON`: the Triton MX GEMM kernel, whose
    main loop `triton_templates.resolve_gemm_path` picks per GPU: `tl.dot_scaled` on sm100+ (MX
    tensor cores), on sm90 the FP8 tiles expanded exactly to bf16 for bf16 wgmma
    ("expand_bf16", which beats Triton's own emulation of tl.dot_scaled there in the static
    comparison). `DEQUANTIZED`: Inductor's GEMM (cuBLAS) of the operands dequantized to bf16
    (fp32 for fp32 outputs), which is exact, so the products are the MX products. `AUTO`:
    `TRITON` where the GPU has MX tensor cores, `DEQUANTIZED` elsewhere, sm90 included: compiled
    for sm90 without a GPU, even the expand_bf16 loop issues 4.9x the instructions per product
    of a plain bf16 `tl.dot` GEMM with the same tiles (`benchmarks/kernel_static.py`,
    `gemm_comparison` in benchmarks/results/kernel_static.json, 2026-12-07), and cuBLAS on
    exactly dequantized operands is a bf16 GEMM; on an H200 the Triton MX GEMM step ran 5.37x
    bf16 against 1.27x dequantized (2026-12-04, docs/benchmarks.md). `benchmarks/gpu_session.sh`
    times both paths against `torch.mm` to revisit this on a GPU. FP4 GEMMs: `AUTO` is `TRITON`
    (the Triton FP4 GEMM) on every GPU, their dequantized form being an fp32 GEMM of the block
    values (`lowering.runs_triton_mx_gemm`). CPU graphs always take the dequantized form."""

    AUTO = "auto"
    TRITON = "triton"
    DEQUANTIZED = "dequantized"


class AttentionChunking(NamedEnum):
    """How many batch elements the MX attention ops' CPU implementation runs per call when no
    memory budget chooses it. `FASTEST`: as many as `ops.attention.batch_chunk_for` allows
    (its scratch grows with the chunk). `LEAST_MEMORY`: one, the least scratch; HF's
    gradient-checkpointed layers are compiled with it (checkpointed_layers.py), since
    checkpointing asks for memory over time: with the whole batch, the attention backward of
    the layer being recomputed was the step's peak (issue 46)."""

    FASTEST = "fastest"
    LEAST_MEMORY = "least_memory"


class FsdpAllGather(NamedEnum):
    """The dtype FSDP2 weight shards travel in: high precision, or MXFP8 quantized before the all-gather."""

    BF16 = "bf16"
    MXFP8 = "mxfp8"


class Recipe(NamedEnum):
    """The training recipe: which block format the linear layers' GEMMs use, and its switches.

    mxfp8: every GEMM operand MXFP8 (`forward_elem` / `grad_elem`), the default.
    nvfp4: NVIDIA's NVFP4 pre-training recipe ("Pretraining Large Language Models with NVFP4",
           2025): linear layers' three GEMMs in NVFP4, 16x16 weight blocks, the random Hadamard
           transform on the weight-gradient GEMM's inputs, stochastic rounding of gradients,
           the last ~15% of linear layers and the lm_head in high precision; each part a switch.
    mxfp4: linear layers' GEMMs in MXFP4 (OCP MX v1.0); stochastic rounding and RHT switches,
           off by default.
    """

    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"


class OperandKind(NamedEnum):
    """What a GEMM operand is, which decides its format within a recipe."""

    ACTIVATION = "activation"  # X: a forward value that is not a parameter
    WEIGHT = "weight"  # W: a parameter (through views)
    GRADIENT = "gradient"  # dY: a value of the backward that depends on the tangents


class GemmRole(NamedEnum):
    """A linear layer's three GEMMs (the `kind` of a report's decision)."""

    OUTPUT = "output"  # Y = X Wt: activation x weight
    INPUT_GRAD = "input_grad"  # dX = dY W: gradient x weight
    WEIGHT_GRAD = "weight_grad"  # dW = dYt X: gradient x activation, contracted over tokens


# The switches of the FP4 recipes (MXConfig fields, None: the recipe's default).
FP4_SWITCHES = ("rht", "stochastic_rounding", "weight_2d", "high_precision_layers")
# Module names that are a model's output projection (HF, torchtitan: `lm_head`): the NVFP4 recipe
# keeps it in high precision with the last layers; an output projection named otherwise
# (torchtitan before 0.3: `output`) is found by structure (model_layers.output_projection).
LM_HEAD_PATTERN = r"(^|\.)lm_head$"
# NVIDIA's NVFP4 recipe keeps about this share of the linear layers (the last ones) in BF16.
NVFP4_HIGH_PRECISION_FRACTION = 0.15

HighPrecisionLayers = Union[int, float, tuple[str, ...]]


@dataclass(frozen=True)
class RecipeRow:
    """One row of the recipe table: the block format of the linear layers' GEMM operands and
    the defaults of the switches (None: the switch does not apply to this recipe; setting it
    to anything but off raises)."""

    recipe: Recipe
    block_format: BlockFormat | None  # None: MXFP8, from forward_elem / grad_elem
    rht: bool | None
    stochastic_rounding: bool | None
    weight_2d: bool | None
    high_precision_layers: HighPrecisionLayers | None
    attention: "AttentionMode"  # the attention default of `MXConfig.for_recipe`


RECIPES: dict[Recipe, RecipeRow] = {
    Recipe.MXFP8: RecipeRow(Recipe.MXFP8, None, rht=None, stochastic_rounding=None, weight_2d=None,
                            high_precision_layers=None, attention=AttentionMode.BOTH),
    Recipe.NVFP4: RecipeRow(Recipe.NVFP4, NVFP4, rht=True, stochastic_rounding=True, weight_2d=True,
                            high_precision_layers=NVFP4_HIGH_PRECISION_FRACTION, attention=AttentionMode.OFF),
    Recipe.MXFP4: RecipeRow(Recipe.MXFP4, MXFP4, rht=False, stochastic_rounding=False, weight_2d=None,
                            high_precision_layers=0, attention=AttentionMode.OFF),
}


@dataclass(frozen=True)
class OperandFormat:
    """How one GEMM operand is quantized: the block format row (`numerics.BLOCK_FORMATS`),
    stochastic rounding, 16x16 (2-D) blocks, and the random Hadamard transform along its
    contraction axis before quantization."""

    block_format: BlockFormat
    stochastic: bool = False
    block_2d: bool = False
    rht: bool = False

    @property
    def is_fp4(self) -> bool:
        return self.block_format.elem.bits < BITS_PER_BYTE

    def describe(self) -> str:
        """The format as the report's operand rows show it, e.g. 'nvfp4 2d', 'nvfp4 sr rht'."""
        parts = [self.block_format.name]
        parts += [name for name, on in (("2d", self.block_2d), ("sr", self.stochastic), ("rht", self.rht)) if on]
        return " ".join(parts)


def _check_switch(recipe: Recipe, name: str, value: Any) -> None:
    if value is None:
        return
    row = RECIPES[recipe]
    if name == "high_precision_layers":
        _check_high_precision_layers(value)
        off = value in (0, 0.0, ())
    else:
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} is not accepted; accepted: True, False or None (the recipe's default)")
        off = value is False
    if getattr(row, name) is None and not off:
        applies = [r.value for r, other in RECIPES.items() if getattr(other, name) is not None]
        raise ValueError(f"{name}={value!r} does not apply to recipe={recipe.value!r}; it applies to {applies}")


def _check_high_precision_layers(value: Any) -> None:
    accepted = ("accepted: a count (int >= 0), a fraction (float in [0, 1]) of the linear layers, "
                "or module-name regexes (a str or a tuple of str)")
    if isinstance(value, bool):
        raise ValueError(f"high_precision_layers={value!r} is not accepted; {accepted}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"high_precision_layers={value!r} is negative; {accepted}")
    elif isinstance(value, float):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"high_precision_layers={value!r} is not a fraction in [0, 1]; {accepted}")
    elif isinstance(value, tuple) and all(isinstance(p, str) for p in value):
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"high_precision_layers pattern {pattern!r} is not a valid regular expression: "
                                 f"{err}") from None
    else:
        raise ValueError(f"high_precision_layers={value!r} is not accepted; {accepted}")


@dataclass(frozen=True)
class FP4Settings:
    """The resolved FP4 recipe of an `MXConfig` (`MXConfig.fp4`): every switch with the
    recipe's default applied."""

    recipe: Recipe
    block_format: BlockFormat
    rht: bool
    stochastic_rounding: bool
    weight_2d: bool
    high_precision_layers: HighPrecisionLayers
    seed: int

    def operand_format(self, role: GemmRole, operand: OperandKind) -> OperandFormat:
        """The format of one operand of a linear layer's GEMM: the recipe's table
        (NVFP4: weights in 2-D blocks; gradients stochastically rounded; both inputs of the
        weight-gradient GEMM Hadamard-transformed along the token axis)."""
        return OperandFormat(
            self.block_format,
            stochastic=self.stochastic_rounding and operand is OperandKind.GRADIENT,
            block_2d=self.weight_2d and operand is OperandKind.WEIGHT,
            rht=self.rht and role is GemmRole.WEIGHT_GRAD,
        )

    def high_precision_modules(self, linear_modules: Sequence[str], heads: Collection[str] = ()) -> dict[str, str]:
        """Which of a model's linear layers (module names in forward order) stay in high
        precision, each with its reason. A count or fraction keeps the last layers (a fraction
        f of n layers: round(f * n), halves up) and, when it is not 0, the output projection
        besides: the modules named like an lm_head (`LM_HEAD_PATTERN`) and `heads` (found by
        their structure, `model_layers.output_projection`); patterns keep the modules they match.
        `model_layers.recipe_high_precision` gives it the whole model's layers."""
        setting = self.high_precision_layers
        if isinstance(setting, tuple):
            reasons = {}
            for name in linear_modules:
                pattern = next((p for p in setting if re.search(p, name)), None)
                if pattern is not None:
                    reasons[name] = (f"{RECIPE_KEEPS_REASON_PREFIX} pattern {pattern!r} keeps module '{name}' in "
                                     "high precision")
            return reasons
        outputs = [name for name in linear_modules if name in heads or re.search(LM_HEAD_PATTERN, name)]
        layers = [name for name in linear_modules if name not in outputs]
        count = setting if isinstance(setting, int) else math.floor(setting * len(layers) + 0.5)
        if count == 0:
            return {}
        kept = layers[len(layers) - min(count, len(layers)):]
        why = (f"{RECIPE_KEEPS_REASON_PREFIX}={setting!r}: the last {len(kept)} of {len(layers)} linear layers "
               f"stay in high precision ({self.recipe.value} recipe: the final layers are the most sensitive "
               "to FP4 rounding)")
        reasons = {name: why for name in kept}
        reasons.update({name: f"{RECIPE_KEEPS_REASON_PREFIX}={setting!r}: the lm_head stays in high precision "
                              f"({self.recipe.value} recipe: the model's output projection)" for name in outputs})
        return reasons


_ENUM_FIELDS: dict[str, type[enum.Enum]] = {
    "forward_elem": ElemFormatName,
    "grad_elem": ElemFormatName,
    "scale_mode": ScaleMode,
    "attention": AttentionMode,
    "gemm_kernel": GemmKernel,
    "attention_chunking": AttentionChunking,
    "fsdp_all_gather": FsdpAllGather,
    "recipe": Recipe,
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
    # The CPU attention ops' batch chunk without a budget (a budget below 1.0 sets it itself).
    attention_chunking: AttentionChunking = AttentionChunking.FASTEST

    # Distributed.
    fsdp_all_gather: FsdpAllGather = FsdpAllGather.BF16  # MXFP8 quantizes FSDP2 weight shards before all-gather

    # Robustness.
    fallback: bool = True  # a failure inside a pass warns and runs the unrewritten graph
    # Measure the first training step after compiling at run time (step_coverage.py: torch.profiler
    # in that step, the share of all its GEMM FLOPs in MX, a warning under 90%). It closes where
    # that step's backward returns, and the profiler stops only outside compiled code: stopping it
    # inside corrupted the heap (torch 2.13 CPU, HF Llama with checkpointing, 4 processes of 5).
    measure_first_step: bool = True

    # Recipe (RECIPES): mxfp8, or an FP4 recipe for the linear layers' GEMMs, with its
    # switches; None takes the recipe's default (an FP4 switch set on mxfp8 raises).
    recipe: Recipe = Recipe.MXFP8
    rht: bool | None = None  # random Hadamard transform of the weight-gradient GEMM's inputs
    stochastic_rounding: bool | None = None  # gradients (dY) rounded stochastically
    weight_2d: bool | None = None  # NVFP4 weights in 16x16 blocks
    # a count, a fraction of the linear layers (the last ones, and the lm_head), or module regexes
    high_precision_layers: HighPrecisionLayers | None = None
    seed: int = 0  # of the stochastic rounding draws and of the Hadamard sign vector

    def __post_init__(self) -> None:
        # Strings (as options give them) become enum members here, once; mxcompile reads members.
        for name, kind in _ENUM_FIELDS.items():
            object.__setattr__(self, name, _enum_choice(name, getattr(self, name), kind))
        check_block_size(self.block_size)
        for name in ("hp_weight_grad", "offload", "fallback", "smooth_swiglu", "measure_first_step"):
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
        if isinstance(self.high_precision_layers, str):
            object.__setattr__(self, "high_precision_layers", (self.high_precision_layers,))
        elif isinstance(self.high_precision_layers, list):
            object.__setattr__(self, "high_precision_layers", tuple(self.high_precision_layers))
        for name in FP4_SWITCHES:
            _check_switch(self.recipe, name, getattr(self, name))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r}: give a non-negative int")

    @classmethod
    def for_recipe(cls, recipe: Recipe | str, options: Mapping[str, Any] | None = None) -> "MXConfig":
        """The config of `backend=recipe`: `options` on top of the recipe's defaults (FP4
        recipes keep attention in high precision unless options set `attention`)."""
        recipe = _enum_choice("recipe", recipe, Recipe)
        options = dict(options or {})
        if options.get("recipe", recipe) != recipe:
            raise ValueError(f"recipe={options['recipe']!r} contradicts the backend's recipe {recipe.value!r}")
        return cls.from_options({"attention": RECIPES[recipe].attention, **options, "recipe": recipe})

    @property
    def fp4(self) -> FP4Settings | None:
        """The resolved FP4 recipe (switch defaults applied), or None for mxfp8."""
        row = RECIPES[self.recipe]
        if row.block_format is None:
            return None

        def resolved(name: str) -> Any:
            value = getattr(self, name)
            return value if value is not None else getattr(row, name)

        return FP4Settings(self.recipe, row.block_format, rht=resolved("rht"),
                           stochastic_rounding=resolved("stochastic_rounding"),
                           weight_2d=bool(resolved("weight_2d")),
                           high_precision_layers=resolved("high_precision_layers"), seed=self.seed)

    def operand_format(self, role: GemmRole, operand: OperandKind) -> OperandFormat:
        """The format of one operand of a linear layer's GEMM under this config's recipe: one
        table for every recipe (MXFP8: `forward_elem` for activations and weights, `grad_elem`
        for gradients, nearest rounding, 1-D blocks of `block_size`)."""
        fp4 = self.fp4
        if fp4 is not None:
            return fp4.operand_format(role, operand)
        return self.mx_operand_format(self.grad_elem if operand is OperandKind.GRADIENT else self.forward_elem)

    def mx_operand_format(self, elem: ElemFormatName) -> OperandFormat:
        """An MXFP8 operand of element format `elem` in blocks of `block_size`."""
        row = MXFP8_E4M3 if ElemFormatName(elem) is ElemFormatName.E4M3 else MXFP8_E5M2
        return OperandFormat(row if self.block_size == row.block_size else dataclasses.replace(
            row, name=f"{row.name}_block{self.block_size}", block_size=self.block_size))

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

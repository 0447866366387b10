"""An eager emulation of a training step under the FP4 recipes (`backend="nvfp4"` / `"mxfp4"`,
issue 48), independent of mxcompile's passes and of its FP4 ops: the oracle that compiled FP4
gradients are compared with, bit for bit.

`FP4Oracle` extends `mx_oracle.MXOracle` (a `TorchDispatchMode`). Each `mm` / `addmm` that
eager autograd dispatches is classified without any FX graph:

- forward (no autograd node runs): a linear layer's output GEMM when one operand shares a
  parameter's storage (the weight, through `t()`); the other operand is the activation;
- backward: the autograd node that runs it (`torch._C._current_autograd_node()`) belongs to a
  linear layer when a parameter is one of its inputs (through view nodes to its
  `AccumulateGrad`); the GEMM is then the input-gradient GEMM when one operand is that
  parameter, else the weight-gradient GEMM, whose operand that the node saved is the activation
  and the other the gradient.

Linear layers' GEMMs take the recipe's formats (written out from docs/fp4.md, not imported from
mxcompile.config): weights nearest, in 16x16 blocks with `weight_2d` (a side that is not a
multiple of 16 zero-padded); activations nearest; gradients stochastically rounded with
`stochastic_rounding`; both operands of the weight-gradient GEMM Hadamard-transformed along the
token axis with `rht`. The draws come from a hash of the operand (`draw_seed`, written here from
`mxcompile/numerics/fp4_operand.py`'s docstring) and the elements from the numerics core's
quantizers (`quantize_nvfp4` / `quantize_mxfp4`, decoded code by code). The FP4 GEMM: the fp32
product of the block values times fp32(S_dec(a) * S_dec(b)). Linear layers in the
high-precision set (the last ~15% in forward order and the lm_head, found by running the model
once; a layer is its module's name, a weight tied to an embedding the name of the module that is
not the embedding) stay in high precision, as does a GEMM whose contraction padded to the block
would be at least twice as long; batched GEMMs (attention) stay in high precision too
(attention="off", the FP4 recipes' default); any other GEMM is MXFP8 as in `MXOracle`.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mx_oracle import MXOracle, relative_distance
from mxcompile.numerics import (
    ScaleMode,
    decode_e2m1,
    quantize_mxfp4,
    quantize_nvfp4,
    random_hadamard_transform,
    random_signs,
    uniform_noise,
)

aten = torch.ops.aten

NVFP4_BLOCK, MXFP4_BLOCK, TILE = 16, 32, 16
KEEP_PADDING_FACTOR = 2  # padding K that at least doubles the work keeps the GEMM (K <= block / 2)
LM_HEAD = r"(^|\.)lm_head$"
# The hash of docs/fp4.md / numerics/fp4_operand.py: 63-bit values, sizes folded with this prime,
# the seed mixed with 2**64 / golden ratio.
HASH_MASK = (1 << 63) - 1
FOLD_PRIME = 1_000_003
GOLDEN = 0x9E3779B97F4A7C15 & HASH_MASK
# Autograd nodes a parameter reaches a GEMM through (views, transposes, casts).
VIEW_NODES = ("TBackward0", "ViewBackward0", "UnsafeViewBackward0", "PermuteBackward0", "TransposeBackward0",
              "ToCopyBackward0", "ReshapeAliasBackward0")


@dataclass(frozen=True)
class FP4OracleRecipe:
    """The recipe the oracle runs (docs/fp4.md): the format and the switches, resolved."""

    format: str  # "nvfp4" or "mxfp4"
    rht: bool
    stochastic_rounding: bool
    weight_2d: bool
    high_precision_layers: float | int  # a fraction or a count of the linear layers (and the lm_head)
    seed: int = 0

    @property
    def block(self) -> int:
        return NVFP4_BLOCK if self.format == "nvfp4" else MXFP4_BLOCK


NVFP4_RECIPE = FP4OracleRecipe("nvfp4", rht=True, stochastic_rounding=True, weight_2d=True,
                               high_precision_layers=0.15)


def draw_seed(x: torch.Tensor, axis: int, seed: int) -> int:
    """Hash of x's fp32 bits in canonical layout (axis last): sum of bits_i * (2i + 1) mod 2**64,
    to 63 bits, then each canonical size and the seed folded in (h * prime + v), xor seed * golden."""
    canonical = x.float().movedim(axis, -1).contiguous()
    bits = canonical.view(torch.int32).flatten().to(torch.int64)
    h = int((bits * (torch.arange(bits.numel(), dtype=torch.int64) * 2 + 1)).sum()) & HASH_MASK
    for value in (*canonical.shape, seed):
        h = (h * FOLD_PRIME + value) & HASH_MASK
    return (h ^ (seed * GOLDEN)) & HASH_MASK


def draws(x: torch.Tensor, axis: int, seed: int) -> torch.Tensor:
    canonical_shape = x.movedim(axis, -1).shape
    return uniform_noise(canonical_shape, seed=draw_seed(x, axis, seed)).movedim(-1, axis)


def _pad(x: torch.Tensor, axis: int, multiple: int) -> torch.Tensor:
    widths = [0, 0] * x.ndim
    widths[2 * (x.ndim - 1 - axis) + 1] = -x.shape[axis] % multiple
    return F.pad(x, widths)


def fp4_operand(x: torch.Tensor, axis: int, recipe: FP4OracleRecipe, *, stochastic: bool, tiles: bool,
                rht: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(block values q * s in fp32, S_dec) of x (already padded along axis) by the recipe."""
    axis %= x.ndim
    x = x.float()
    uniform = draws(x, axis, recipe.seed) if stochastic else None
    if rht:
        x = random_hadamard_transform(x, axis, random_signs(seed=recipe.seed))
    rounding = "stochastic" if stochastic else "nearest"
    if recipe.format == "mxfp4":
        t = quantize_mxfp4(x, axis, scale_mode=ScaleMode.RCEIL, rounding=rounding, uniform=uniform)
        values = decode_e2m1(t.codes) * t.scale.float().repeat_interleave(recipe.block, axis)
        return values, torch.tensor(1.0)
    shape = x.shape
    if tiles:
        other = 1 - axis
        x = _pad(x, other, TILE)
        uniform = None if uniform is None else _pad(uniform, other, TILE)
    t = quantize_nvfp4(x, axis, block_2d=tiles, rounding=rounding, uniform=uniform)
    values = decode_e2m1(t.codes) * t.scale.float().repeat_interleave(recipe.block, axis)
    return values[tuple(slice(0, n) for n in shape)], t.tensor_scale


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _LinearOrder(TorchDispatchMode):
    """Records the parameters that forward mm / addmm operands share storage with, in order."""

    def __init__(self, parameters: dict[int, str]):
        super().__init__()
        self.parameters, self.order = parameters, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (aten.mm.default, aten.addmm.default):
            for operand in args[-2:]:
                name = self.parameters.get(_storage(operand))
                if name is not None and name not in self.order:
                    self.order.append(name)
        return func(*args, **(kwargs or {}))


def parameter_modules(model: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter's module name. A parameter that several modules share (tied weights: the
    lm_head and the token embedding) is named after a module that is not an embedding, the one
    that runs its GEMMs, as a graph's module stack names it; named_parameters() gives the first
    name (GPT-2's lm_head as transformer.wte, which the recipe's lm_head rule would not match)."""
    names: dict[nn.Parameter, str] = {}
    modules = sorted(model.named_modules(remove_duplicate=False), key=lambda item: isinstance(item[1], nn.Embedding))
    for module_name, module in modules:  # embeddings last (a stable sort): they name what is left
        for p in module.parameters(recurse=False):
            names.setdefault(p, module_name)
    return names


def _is_output_projection(model: nn.Module, name: str) -> bool:
    """The model's output projection, whatever its name: a weight tied to an embedding, or an
    nn.Linear whose out_features are the rows of the model's largest embedding (the vocabulary)."""
    module = model.get_submodule(name)
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if any(getattr(module, "weight", None) is e.weight for e in embeddings):
        return True
    return bool(embeddings) and isinstance(module, nn.Linear) and \
        module.out_features == max(e.num_embeddings for e in embeddings)


def high_precision_modules(model: nn.Module, run: Callable[[nn.Module], Any], setting: float | int) -> set[str]:
    """The linear layers the recipe keeps: the lm_head (by name, or the last layer when it is
    the output projection) and the last round(f * n) (halves up) of the other n, in forward
    order (a run of the model under no_grad finds the order)."""
    parameters = {_storage(p): name for p, name in parameter_modules(model).items()}
    recorder = _LinearOrder(parameters)
    with torch.no_grad(), recorder:
        run(model)
    heads = [m for i, m in enumerate(recorder.order) if re.search(LM_HEAD, m)
             or (i == len(recorder.order) - 1 and _is_output_projection(model, m))]
    layers = [m for m in recorder.order if m not in heads]
    count = setting if isinstance(setting, int) else math.floor(setting * len(layers) + 0.5)
    return set() if count == 0 else {*heads, *layers[len(layers) - min(count, len(layers)):]}


class FP4Oracle(MXOracle):
    """The module docstring's rules; counts the GEMMs of each role in `roles`, and the linear
    layers' GEMMs kept in high precision: by the recipe (`high_precision`) or because padding K
    to the block would at least double the work (`short_contraction`)."""

    def __init__(self, model: nn.Module, recipe: FP4OracleRecipe, high_precision: set[str],
                 decompositions: dict | None = None):
        super().__init__(decompositions=decompositions)
        self.recipe, self.high_precision = recipe, high_precision
        self.parameters = parameter_modules(model)
        self.by_storage = {_storage(p): p for p in self.parameters}
        self.roles: dict[str, int] = {"output": 0, "input_grad": 0, "weight_grad": 0, "high_precision": 0,
                                      "short_contraction": 0}

    def _node_parameter(self, node: Any) -> nn.Parameter | None:
        """The parameter an autograd node takes as an input (through view nodes), if any."""
        inputs = list(node.next_functions)
        if node.name() == "AddmmBackward0":
            inputs = inputs[1:]  # the bias
        stack = [fn for fn, _ in inputs if fn is not None]
        while stack:
            fn = stack.pop()
            if fn.name() == "torch::autograd::AccumulateGrad" and fn.variable in self.parameters:
                return fn.variable
            if fn.name() in VIEW_NODES:
                stack.extend(f for f, _ in fn.next_functions if f is not None)
        return None

    def _classify(self, lhs: torch.Tensor, rhs: torch.Tensor) -> tuple[str, str, tuple[str, str]] | None:
        """(role, module, operand kinds) of a linear layer's GEMM, or None."""
        node = torch._C._current_autograd_node()
        if node is None:
            weights = [self.by_storage.get(_storage(t)) for t in (lhs, rhs)]
            if not any(w is not None for w in weights):
                return None
            weight = next(w for w in weights if w is not None)
            kinds = tuple("weight" if w is not None else "activation" for w in weights)
            return "output", self.parameters[weight], kinds
        weight = self._node_parameter(node)
        if weight is None:
            return None
        if _storage(weight) in (_storage(lhs), _storage(rhs)):
            kinds = tuple("weight" if _storage(t) == _storage(weight) else "gradient" for t in (lhs, rhs))
            return "input_grad", self.parameters[weight], kinds
        saved = {_storage(getattr(node, a)) for a in dir(node)
                 if a.startswith("_saved_") and isinstance(getattr(node, a, None), torch.Tensor)}
        kinds = tuple("activation" if _storage(t) in saved else "gradient" for t in (lhs, rhs))
        if sorted(kinds) != ["activation", "gradient"]:
            raise AssertionError(f"weight-gradient GEMM of {self.parameters[weight]}: operands {kinds}")
        return "weight_grad", self.parameters[weight], kinds

    def _operand(self, x: torch.Tensor, axis: int, role: str, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.recipe
        return fp4_operand(_pad(x, axis % x.ndim, r.block), axis, r,
                           stochastic=r.stochastic_rounding and kind == "gradient",
                           tiles=r.weight_2d and kind == "weight" and x.ndim == 2,
                           rht=r.rht and role == "weight_grad")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.is_paused:
            return self._high_precision(func, args, kwargs)
        if func in (aten.bmm.default, aten.baddbmm.default):  # attention="off"
            self.kept += 1
            return self._high_precision(func, args, kwargs)
        if func not in (aten.mm.default, aten.addmm.default):
            return super().__torch_dispatch__(func, types, args, kwargs)
        lhs, rhs = args[-2:]
        found = self._classify(lhs, rhs)
        if found is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        role, module, kinds = found
        length = lhs.shape[-1]
        short = -(-length // self.recipe.block) * self.recipe.block >= KEEP_PADDING_FACTOR * length
        if short or module in self.high_precision:
            # Kept either way; a GEMM both rules keep counts as short, the reason a report gives.
            self.roles["short_contraction" if short else "high_precision"] += 1
            self.kept += 1
            return self._high_precision(func, args, kwargs)
        self.roles[role] += 1
        self.converted += 1
        out_dtype = torch.result_type(lhs, rhs)
        a, a_decode = self._operand(lhs, -1, role, kinds[0])
        b, b_decode = self._operand(rhs, -2, role, kinds[1])
        result = (torch.matmul(a, b) * (a_decode * b_decode)).to(out_dtype)
        if func is aten.addmm.default:
            alpha, beta = kwargs.get("alpha", 1), kwargs.get("beta", 1)
            result = result.float()
            if alpha != 1:
                result = result * alpha
            result = (result + (args[0] * beta if beta != 1 else args[0])).to(out_dtype)
        return result


def fp4_oracle_gradients(model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor],
                         recipe: FP4OracleRecipe) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Each parameter's gradient of loss_of(copy of model) under the FP4 oracle, and the
    oracle's count of GEMMs per role."""
    from torch._inductor.decomposition import select_decomp_table

    reference = copy.deepcopy(model)
    kept = high_precision_modules(reference, loss_of, recipe.high_precision_layers)
    with FP4Oracle(reference, recipe, kept, decompositions=select_decomp_table()) as oracle:
        loss_of(reference).backward()
    if not any(oracle.roles[r] for r in ("output", "input_grad", "weight_grad")):
        raise AssertionError("the oracle ran no FP4 GEMM: nothing would be compared")
    grads = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    return grads, oracle.roles


def fp4_compiled_distances(model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor], backend: Callable,
                           recipe: FP4OracleRecipe) -> tuple[dict[str, float], dict[str, int]]:
    """Per parameter, the relative distance of the gradient of loss_of(compiled model) from the
    FP4 oracle's; and the oracle's GEMM count per role."""
    expected, roles = fp4_oracle_gradients(model, loss_of, recipe)
    torch._dynamo.reset()
    loss_of(torch.compile(model, backend=backend)).backward()
    actual = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    missing = sorted(set(expected) - set(actual))
    if missing:
        raise AssertionError(f"no compiled gradient for {missing}")
    return {name: relative_distance(actual[name], expected[name]) for name in expected}, roles

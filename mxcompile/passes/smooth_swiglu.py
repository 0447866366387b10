"""Pass: Smooth-SwiGLU (Fishman et al., "Scaling FP8 training to trillion-token LLMs", 2024).

A SwiGLU MLP computes Y = H W2ᵀ with H = silu(X W1ᵀ) * (X W3ᵀ). At scale the two input
projections align and H grows outlier channels. This pass finds that pattern in the joint (or
inference) graph, before gemm_rewrite converts the GEMMs, and rewrites the operands of the down
projection's forward GEMM (H (T, K) times W2ᵀ (K, N), contracting over the K hidden channels):

    Y = (H diag(s)) (diag(1/s) W2ᵀ),   s_c = 2^clamp(round(½ log2(amax_c(W2ᵀ) / amax_c(H))), ±32)

with the channel amaxes taken in the graph, at run time (amax_c(H) over the tokens of this step,
amax_c(W2ᵀ) over the output features). This is SmoothQuant's balanced migration (α = ½) rounded to
a power of two: after it, channel c of H and row c of W2ᵀ have about the same amax, so an outlier
channel's range is split between the two operands instead of sitting whole in H. Powers of two
make the scaling exact in floating point (no overflow: |e| <= 32; zero, infinite or NaN amaxes
give e = 0 or the clamp), and each product h_c s_c * w_c / s_c is bit for bit h_c w_c: the GEMM
is the same function, and only the MX rounding of its operands changes (gemm_rewrite quantizes
H diag(s) and diag(1/s) W2ᵀ along K, as any forward GEMM).

Only the forward GEMM's operands change. The backward GEMMs of the joint graph (dH = dY W2,
dW2 = dYᵀ H) read the original H and W2, so W2's gradient is still the gradient of the original
W2 (and dH would not gain anything: it contracts over N, dW2 over the tokens, and a per-channel
power of two is constant within each of their blocks).

Each forward GEMM whose left operand is a product with a Linear's output (a gated linear unit:
act(x W1) * (x W3) for some act) is a candidate and gets one decision row (kind
"smooth_swiglu", 0 FLOPs: the GEMM itself is recorded by gemm_rewrite under the same node name):
"smoothed", or "not_smoothed" with the reason. Off by default (config.smooth_swiglu); when off
the pass records nothing and changes nothing. Measurements: docs/smooth_swiglu.md.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..config import MXConfig
from ..report import GemmDecision, PassResult
from .graph_facts import NodeBuilder, fake_value, is_backward, module_name, shape_hint
from .mx_gemm import selection_reason

NAME = "smooth_swiglu"
KIND = "smooth_swiglu"
SMOOTHED = "smoothed"
NOT_SMOOTHED = "not_smoothed"
# The largest |log2 s_c|: the scaling stays exact for any fp32 / bf16 value up to 2^95.
MAX_EXPONENT = 32
# SmoothQuant's migration strength: the share of an outlier's range moved from H to W2.
MIGRATION = 0.5
SMOOTH_DTYPES = (torch.float32, torch.bfloat16)

aten = torch.ops.aten
prims = torch.ops.prims

# Ops that do not change which values a tensor holds (shape, copies, dtype conversion).
_TRANSPARENT = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
    aten.alias.default, aten.contiguous.default, prims.convert_element_type.default,
    aten._to_copy.default,
}
# (lhs argument, rhs argument) of the 2-D GEMMs a Linear becomes.
_GEMMS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2)}


def _call(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _strip(node):
    while _call(node, *_TRANSPARENT):
        node = node.args[0]
    return node


def _is_one(value) -> bool:
    return not isinstance(value, fx.Node) and value == 1


def _silu_input(node):
    """The tensor `node` is silu of, through any of the forms AOTAutograd leaves (aten.silu,
    x * sigmoid(x), x / (1 + exp(-x))), or None."""
    node = _strip(node)
    if _call(node, aten.silu.default):
        return node.args[0]
    if _call(node, aten.mul.Tensor) and len(node.args) == 2:
        a, b = node.args
        for x, sig in ((a, b), (b, a)):
            if _call(sig, aten.sigmoid.default) and sig.args[0] is x:
                return x
    if _call(node, aten.div.Tensor) and len(node.args) == 2:
        x, denominator = node.args
        if _call(denominator, aten.add.Tensor) and len(denominator.args) == 2:
            for exp, one in (denominator.args, denominator.args[::-1]):
                if (_is_one(one) and _call(exp, aten.exp.default) and _call(exp.args[0], aten.neg.default)
                        and exp.args[0].args[0] is x):
                    return x
    return None


def _forward_gemm(node):
    """`node` (through transparent ops) as a forward 2-D GEMM node, or None."""
    node = _strip(node)
    return node if _call(node, *_GEMMS) and not is_backward(node) else None


def _gemm_input(gemm: fx.Node):
    return _strip(gemm.args[_GEMMS[gemm.target][0]])


def _match(product: fx.Node) -> tuple[fx.Node, fx.Node] | str:
    """(gate GEMM, up GEMM) when product = silu(x W1ᵀ) * (x W3ᵀ), else why not."""
    if len(product.args) != 2 or not all(isinstance(a, fx.Node) for a in product.args):
        return "the left operand is a product with a scalar, not silu(x W1) * (x W3)"
    reasons = []
    for gate_side, up_side in (product.args, product.args[::-1]):
        silu_of = _silu_input(gate_side)
        if silu_of is None:
            reasons.append(f"{_strip(gate_side).name} is not silu of a tensor")
            continue
        gate, up = _forward_gemm(silu_of), _forward_gemm(up_side)
        if gate is None or up is None:
            reasons.append(f"silu's input {_strip(silu_of).name} and the other factor "
                           f"{_strip(up_side).name} are not both outputs of forward GEMMs (Linear)")
            continue
        if _gemm_input(gate) is not _gemm_input(up):
            reasons.append(f"the gate GEMM {gate.name} and the up GEMM {up.name} read different inputs "
                           f"({_gemm_input(gate).name}, {_gemm_input(up).name})")
            continue
        return gate, up
    return "the product is not silu(x W1) * (x W3): " + "; ".join(reasons)


def _decision(node: fx.Node, graph_name: str, decision: str, reason: str) -> GemmDecision:
    lhs_arg, rhs_arg = _GEMMS[node.target]
    shapes = tuple(shape_hint(fake_value(node.args[i])) for i in (lhs_arg, rhs_arg))
    return GemmDecision(graph="inference" if graph_name == "inference" else "forward", node=node.name,
                        op=str(node.target), kind=KIND, shapes=shapes, flops=0, module=module_name(node),
                        decision=decision, reason=reason)


def _smooth(gm: fx.GraphModule, node: fx.Node) -> int:
    """Rewrite the down GEMM `node` to multiply H diag(s) by diag(1/s) W2ᵀ; returns nodes added."""
    lhs_arg, rhs_arg = _GEMMS[node.target]
    lhs, rhs = node.args[lhs_arg], node.args[rhs_arg]  # H (T, K), W2ᵀ (K, N)
    build = NodeBuilder(gm, node)
    f32 = torch.float32

    def log2_amax(operand: fx.Node, dim: int) -> fx.Node:
        amax = build.call(aten.amax.default, build.call(aten.abs.default, operand), [dim])
        return build.call(aten.log2.default, build.call(prims.convert_element_type.default, amax, f32))

    log2_ratio = build.call(aten.sub.Tensor, log2_amax(rhs, 1), log2_amax(lhs, 0))
    exponent = build.call(aten.round.default, build.call(aten.mul.Tensor, log2_ratio, MIGRATION))
    exponent = build.call(aten.nan_to_num.default, exponent, 0.0, float(MAX_EXPONENT), float(-MAX_EXPONENT))
    exponent = build.call(aten.clamp.default, exponent, -MAX_EXPONENT, MAX_EXPONENT)
    scale = build.call(aten.exp2.default, exponent)
    inverse = build.call(aten.exp2.default, build.call(aten.neg.default, exponent))
    scale = build.call(prims.convert_element_type.default, scale, fake_value(lhs).dtype)
    inverse = build.call(prims.convert_element_type.default, inverse, fake_value(rhs).dtype)
    scaled_lhs = build.call(aten.mul.Tensor, lhs, scale)  # per column (channel) of H
    scaled_rhs = build.call(aten.mul.Tensor, rhs, build.call(aten.unsqueeze.default, inverse, 1))  # per row of W2ᵀ
    node.update_arg(lhs_arg, scaled_lhs)
    node.update_arg(rhs_arg, scaled_rhs)
    return len(build.added)


def _why_not(node: fx.Node, config: MXConfig) -> str | None:
    """Why a matched down GEMM is left as it is (it would not run in MX, or its dtype), or None."""
    lhs_arg, rhs_arg = _GEMMS[node.target]
    for role, arg in (("H", lhs_arg), ("W2", rhs_arg)):
        value = fake_value(node.args[arg])
        if not isinstance(value, torch.Tensor) or value.dtype not in SMOOTH_DTYPES:
            return (f"{role} dtype {getattr(value, 'dtype', None)} is not one of "
                    f"{[str(d) for d in SMOOTH_DTYPES]} (powers of two up to 2^±{MAX_EXPONENT} must stay exact)")
    lhs, rhs = fake_value(node.args[lhs_arg]), fake_value(node.args[rhs_arg])
    flops = 2 * shape_hint(lhs)[0] * shape_hint(lhs)[1] * shape_hint(rhs)[1]
    reason = selection_reason(node, flops, config)
    if reason is not None:
        return f"the down projection stays in high precision, so there is no MX rounding to improve ({reason})"
    return None


def smooth_swiglu(gm: fx.GraphModule, config: MXConfig, graph_name: str) -> PassResult:
    """Scale the down projection's operands of every SwiGLU MLP of one graph in place (when
    config.smooth_swiglu); return one decision per candidate GEMM."""
    if not config.smooth_swiglu:
        return PassResult(NAME, graph_name, 0, 0, ())
    decisions: list[GemmDecision] = []
    added = 0
    for node in list(gm.graph.nodes):
        if not _call(node, *_GEMMS) or is_backward(node):
            continue
        product = _strip(node.args[_GEMMS[node.target][0]])
        if not _call(product, aten.mul.Tensor) or not any(_forward_gemm(a) is not None for a in product.args):
            continue  # not fed by a product with a Linear's output (a gated unit): not a candidate, no row
        match = _match(product)
        if isinstance(match, str):
            decisions.append(_decision(node, graph_name, NOT_SMOOTHED, match))
            continue
        gate, up = match
        why_not = _why_not(node, config)
        if why_not is not None:
            decisions.append(_decision(node, graph_name, NOT_SMOOTHED, why_not))
            continue
        k = shape_hint(fake_value(node.args[_GEMMS[node.target][0]]))[1]
        decisions.append(_decision(node, graph_name, SMOOTHED, (
            f"H = silu({gate.name}) * {up.name} ({module_name(gate) or '?'}, {module_name(up) or '?'}): "
            f"H and W2ᵀ scaled per hidden channel (K={k}) by s_c and 1/s_c, "
            f"s_c = 2^round(log2(amax_c(W2ᵀ) / amax_c(H)) / 2) from this step's amaxes, |log2 s_c| <= {MAX_EXPONENT}")))
        added += _smooth(gm, node)
    if added:
        gm.graph.lint()
        gm.recompile()
    return PassResult(NAME, graph_name, added, 0, tuple(decisions))

"""A memory budget does not change what training computes: gradients of a planned step are
bit-identical to the unplanned step's, under Inductor (issue 18), with each backend (the FP4
recipes: issue 48).

The bug showed on a 12-layer Linear + GELU MLP with 4096 x 1024 activations: the plan
recomputes GEMM outputs; a forward that no longer saved ``x @ w`` let Inductor fuse the bias
add into the GEMM (addmm), which rounds differently, and the gradients moved by up to 3.4e-3
(relative); four layers reproduced it (2.98e-3 at 0.5 without the fix). The test uses two
layers for CI time: the property holds at any depth where the plan recomputes something, which
the test asserts (smaller batches, e.g. 512, leave nothing to recompute), and the structural
test below checks the guard itself.

Three Inductor compiles (no budget, 0.5, 0.3): 284 s in all on 2 cores under a load of 3. The
FP4 backends run the README quickstart's widths on 256 rows (about 30 s each with 0.5): there
the plan recomputes the packed FP4 operand of the first layer's weight gradient (the outputs of
a quantize_fp4, which the backward then quantizes again from the input), so a recomputed FP4
quantization is checked too.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import mxcompile
from mxcompile.config import MemoryBudget
from mxcompile.examples.mlp import MLP, MLPConfig

SEED = 0


@dataclass(frozen=True)
class Case:
    """One backend's step: an MLP of these widths on `batch` rows, planned at each fraction."""

    widths: tuple[int, ...]
    batch: int
    fractions: tuple[float, ...]
    fp4: bool = False


WIDTH = 1024
CASES = {
    "mxfp8": Case(widths=(WIDTH,) * 3, batch=4096, fractions=(0.5, 0.3)),
    "nvfp4": Case(widths=(256, 1024, 256), batch=256, fractions=(0.5,), fp4=True),
    "mxfp4": Case(widths=(256, 1024, 256), batch=256, fractions=(0.5,), fp4=True),
}
PLANNED = [(backend, fraction) for backend, case in CASES.items() for fraction in case.fractions]


def _step(backend: str, budget: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor], mxcompile.Report]:
    case = CASES[backend]
    torch._dynamo.reset()
    torch.manual_seed(SEED)
    model = MLP(MLPConfig(widths=case.widths))
    x = torch.randn(case.batch, case.widths[0], generator=torch.Generator().manual_seed(SEED + 1))
    options = {} if budget is None else {"memory_budget": MemoryBudget.of_fraction(budget)}
    compiled = torch.compile(model, backend=backend, options=options)
    loss = compiled(x).square().mean()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, mxcompile.report_of(model)[-1]


@pytest.fixture(scope="module")
def unplanned():
    """backend -> its unplanned step (each run once, when first asked for)."""
    steps: dict[str, tuple] = {}

    def step(backend: str) -> tuple:
        if backend not in steps:
            steps[backend] = _step(backend, None)
        return steps[backend]

    return step


@pytest.mark.parametrize("backend, fraction", PLANNED)
def test_planned_gradients_are_bit_identical(unplanned, backend, fraction):
    loss, grads, report = unplanned(backend)
    planned_loss, planned_grads, planned = _step(backend, fraction)
    plan = planned.memory_plan or {}
    assert plan.get("recomputed"), f"the plan at {fraction} recomputes nothing: this test would prove nothing"
    if CASES[backend].fp4:
        # a packed operand recomputed whole: its data, scales and tensor scale (one decision)
        operands = [row["outputs"] for row in report.saved_quantized if row["format"] == backend]
        assert any(set(outputs) <= set(plan["recomputed"]) for outputs in operands), (plan["recomputed"], operands)
    assert torch.equal(planned_loss, loss)
    differing = [name for name in grads if not torch.equal(planned_grads[name], grads[name])]
    assert not differing, f"gradients differ at budget {fraction}: {differing}"


def _linear(x, w, bias, also_return_product: bool):
    from mxcompile.ops.mx_mm import MX_MM
    from mxcompile.ops.quantize import QUANTIZE

    qa, qb = QUANTIZE(x, 1, "e4m3", "rceil", 32), QUANTIZE(w, 0, "e4m3", "rceil", 32)
    product = MX_MM(qa[0], qa[1], qb[0], qb[1], 32, torch.float32)
    out = torch.ops.aten.add.Tensor(product, bias)  # as in the aten graphs the lowering sees
    return (out, product) if also_return_product else out


@pytest.mark.parametrize("saved", [False, True])
def test_lowered_gemm_output_is_never_fused_with_its_bias_add(saved):
    """Fast, structural: the lowered MX GEMM whose output only feeds the bias add goes through
    the barrier Inductor's addmm pattern does not match; a stored one (saved) needs none (the
    pattern fires only on a GEMM output with one user). Values are unchanged."""
    import torch.fx as fx

    from mxcompile.lowering import _product_not_fused_with_bias, lower_mx_gemms

    gm = fx.symbolic_trace(lambda x, w, bias: _linear(x, w, bias, saved))
    assert lower_mx_gemms(gm) == 1
    barriers = [n for n in gm.graph.nodes if n.target is _product_not_fused_with_bias]
    assert len(barriers) == (0 if saved else 1)
    x, w, bias = torch.randn(64, 96), torch.randn(96, 32), torch.randn(32)
    want = _linear(x, w, bias, saved)
    got = gm(x, w, bias)
    for a, b in zip(want if saved else (want,), got if saved else (got,)):
        assert torch.equal(a, b)

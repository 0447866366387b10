"""MoE expert GEMMs (passes/grouped_gemm through gemm_rewrite): aten._grouped_mm in its two
training forms against a reference that pads each expert's tokens explicitly, bit for bit; a
tiny transformers Mixtral with its experts converted. Compiles use the eager lowering."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mxcompile
from padding_testing import octaves, train_at_lengths
from mx_testing import eager_mxfp8_backend, fake_quantize
from mxcompile.report import CONVERTED, KEPT, Report

BLOCK = 32
OFFSETS = (10, 40, 40, 100)  # 4 experts with 10, 30, 0 and 60 tokens: none a multiple of 32
TOKENS, K, N = 100, 64, 96


def _grouped(x, w, offs):
    return torch._grouped_mm(x, w, offs=offs)


def _mx(x, axis):
    """MX-rounded values in x's dtype (exact in bf16 for these magnitudes)."""
    return fake_quantize(x, axis, BLOCK).to(x.dtype)


def _reference(x, w, offs, grad_y):
    """(y, dx, dw) with every GEMM in MX; dW pads each expert's rows to 32 explicitly."""
    y = torch._grouped_mm(_mx(x, 1), _mx(w, 1), offs=offs)
    dx = torch._grouped_mm(_mx(grad_y, 1), _mx(w.transpose(1, 2), 1), offs=offs)
    starts = (0, *OFFSETS[:-1])
    padded_x, padded_dy, padded_offsets, end = [], [], [], 0
    for start, stop in zip(starts, OFFSETS):
        rows = -(-(stop - start) // BLOCK) * BLOCK
        padded_x.append(F.pad(x[start:stop], [0, 0, 0, rows - (stop - start)]))
        padded_dy.append(F.pad(grad_y[start:stop], [0, 0, 0, rows - (stop - start)]))
        end += rows
        padded_offsets.append(end)
    px, pdy = torch.cat(padded_x), torch.cat(padded_dy)
    dw = torch._grouped_mm(_mx(px.t(), 1), _mx(pdy, 0), offs=torch.tensor(padded_offsets, dtype=torch.int32))
    return y, dx, dw


def test_grouped_gemms_match_explicit_per_expert_padding_bit_for_bit():
    """bf16, as aten._grouped_mm requires under torch.compile."""
    x, w = octaves(TOKENS, K, seed=1).bfloat16(), octaves(4, K, N, seed=2).bfloat16()
    grad_y = octaves(TOKENS, N, seed=3).bfloat16()
    offs = torch.tensor(OFFSETS, dtype=torch.int32)
    report = Report({})
    compiled = torch.compile(_grouped, backend=eager_mxfp8_backend(report=report))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = compiled(xr, wr, offs)
    y.backward(grad_y)
    want = _reference(x, w, offs, grad_y)
    for name, got, ref in zip(("y", "dx", "dw"), (y.detach(), xr.grad, wr.grad), want):
        assert torch.equal(got, ref), name
    kinds = {d.kind: d for d in report.decisions}
    assert set(kinds) == {"output", "input_grad", "weight_grad"}
    assert all(d.decision == CONVERTED and "[4 groups]" in d.op for d in report.decisions)
    assert "each group's token count zero-padded to a multiple of block_size=32" in kinds["weight_grad"].reason
    assert all(d.flops == 2 * TOKENS * K * N for d in report.decisions)


def _tiny_mixtral(dtype):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=128)
    return MixtralForCausalLM(config).train().to(dtype)


def test_tiny_mixtral_trained_at_three_lengths_converts_its_experts():
    """transformers emits aten._grouped_mm for bf16 experts. Trained at 64, 96 and 128 tokens,
    dynamo recompiles once with symbolic token counts; in both graphs all three GEMMs of both
    expert projections are MX (one row per grouped GEMM naming its groups), and >= 95% of the
    GEMM FLOPs are converted."""
    model = _tiny_mixtral(torch.bfloat16)
    report = Report({})
    compiles = train_at_lengths(model, report, (64, 96, 128))
    assert compiles == 2 and report.fallbacks == []
    grouped = [d for d in report.decisions if "_grouped_mm" in d.op]
    assert len(grouped) == 12  # 2 graphs x (gate_up, down) x (forward, input grad, weight grad)
    assert all(d.decision == CONVERTED and "[4 groups]" in d.op for d in grouped), grouped
    assert {d.kind for d in grouped} == {"output", "input_grad", "weight_grad"}
    assert report.converted_flop_fraction >= 0.95, [
        (d.op, d.reason) for d in report.decisions if d.decision == KEPT]


def test_fp32_mixtral_fallback_experts_are_converted():
    """For fp32 weights transformers calls its own fallback op (a loop of torch.mm per expert):
    gemm_rewrite turns it into the aten._grouped_mm nodes it computes, so all three GEMMs of
    both expert projections are MX, each row naming the op it came from."""
    model = _tiny_mixtral(torch.float32)
    report = mxcompile.explain(model, torch.randint(0, 128, (2, 64)))
    grouped = [d for d in report.decisions if "grouped_mm_fallback" in d.op]
    assert len(grouped) == 6, grouped  # (gate_up, down) x (forward, input grad, weight grad)
    assert all(d.decision == CONVERTED and "[4 groups]" in d.op for d in grouped), grouped
    assert {d.kind for d in grouped} == {"output", "input_grad", "weight_grad"}
    assert report.converted_flop_fraction >= 0.95, [(d.op, d.reason) for d in report.decisions
                                                    if d.decision == KEPT]


def test_fp32_fallback_as_grouped_mm_computes_what_transformers_computes():
    """With every GEMM kept (exclude everything), the rewritten fallback ops run as
    aten._grouped_mm in fp32: loss and every gradient equal the eager model's."""
    from mxcompile.config import MXConfig

    model = _tiny_mixtral(torch.float32)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    reference = _tiny_mixtral(torch.float32)
    reference.load_state_dict(model.state_dict())
    model.eval(), reference.eval()  # no dropout draws to compare
    report = Report({})
    compiled = torch.compile(model, backend=eager_mxfp8_backend(MXConfig(exclude=(".*",)), report=report))
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    assert any("grouped_mm_fallback" in d.op and d.decision == KEPT for d in report.decisions)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)

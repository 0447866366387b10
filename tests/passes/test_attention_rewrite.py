"""The attention_rewrite pass: fused SDPA ops and eager softmax attention found in AOTAutograd's
joint graph, replaced or claimed, with decisions and reasons; accuracy against fp32; HF Llama in
both attention implementations; the GPT example training with MX attention.

Compiles use mx_testing.eager_mxfp8_backend (no Inductor) except the one test marked slow.

Measured SQNR against fp32 (B=2, Hq=4, T=128, d=64, N(0, 1) q, k, v), output / worst of dq,
dk, dv: SDPA causal 26.3 / 23.0 dB, non-causal 25.4 / 23.3, float mask 25.9 / 24.0, bool mask
25.5 / 23.6, GQA causal 26.3 / 23.3; eager causal 26.5 / 24.0, eager float mask 25.8 / 24.3,
eager GQA causal 26.6 / 23.9. HF Llama (2 layers, every GEMM in MX): logits 24.3 dB against
fp32 with either attention implementation, 27.3 dB between the two.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch import nn

import mxcompile
from mx_testing import eager_mxfp8_backend, sqnr_db
from mxcompile.config import MXConfig
from mxcompile.examples.gpt import gpt_factory, lm_loss
from mxcompile.ops.attention import ATTENTION_CHUNK_QUERY_NUMEL
from mxcompile.passes.attention_rewrite import (
    BACKWARD_ROLES,
    DK,
    DP,
    DQ,
    DV,
    FORWARD_ROLES,
    KIND,
    O_PV,
    S_QK,
)
from mxcompile.report import CONVERTED, KEPT, Report

B, HQ, T, D = 2, 4, 128, 64
OUT_SQNR_DB, GRAD_SQNR_DB = 25.0, 20.0
ALL_ROLES = (*FORWARD_ROLES, *BACKWARD_ROLES)


def _inputs(seed=0, kv_heads=HQ, q_len=T, k_len=T, width=D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, q_len, width, generator=g)
    k = torch.randn(B, kv_heads, k_len, width, generator=g)
    v = torch.randn(B, kv_heads, k_len, width, generator=g)
    do = torch.randn(B, HQ, q_len, width, generator=g)
    return q, k, v, do


def sdpa(q, k, v, mask=None, is_causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


def eager_attention(q, k, v, mask=None, is_causal=False):
    """softmax(Q·Kᵀ·scale + mask)·V spelled out as HF transformers' eager attention does:
    repeat_kv for GQA, softmax in fp32, dropout with p=0 in training mode."""
    batch, kv_heads, k_len, width = k.shape
    group = q.shape[1] // kv_heads
    if group > 1:
        k = k[:, :, None].expand(batch, kv_heads, group, k_len, width).reshape(batch, -1, k_len, width)
        v = v[:, :, None].expand(batch, kv_heads, group, k_len, width).reshape(batch, -1, k_len, width)
    scores = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(width))
    if is_causal:
        q_len = q.shape[2]
        scores = scores + torch.full((q_len, k_len), float("-inf")).triu(1)
    if mask is not None:
        scores = scores + mask
    probabilities = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probabilities = F.dropout(probabilities, p=0.0, training=True)
    return torch.matmul(probabilities, v)


def _float_mask(seed=1, q_len=T, k_len=T):
    return torch.randn(B, 1, q_len, k_len, generator=torch.Generator().manual_seed(seed))


def _bool_mask(seed=2, q_len=T, k_len=T):
    mask = torch.rand(q_len, k_len, generator=torch.Generator().manual_seed(seed)) > 0.3
    mask[:, 0] = True  # every query attends to something
    return mask


def _compile_and_run(fn, q, k, v, do, config=None, **kwargs):
    """(output, (dq, dk, dv), report) of fn compiled with the mxfp8 pipeline, run eagerly."""
    report = Report({})
    compiled = torch.compile(fn, backend=eager_mxfp8_backend(config or MXConfig(), report))
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = compiled(q, k, v, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), do)
    return out.detach(), grads, report


def _reference(fn, q, k, v, do, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **kwargs)
    return out.detach(), torch.autograd.grad(out, (q, k, v), do)


def _attention_decisions(report):
    return [d for d in report.decisions if d.kind == KIND]


def _by_role(report):
    rows = {}
    for d in _attention_decisions(report):
        role = d.op[d.op.index("[") + 1:-1]
        assert role not in rows, f"two decisions for {role}"
        rows[role] = d
    return rows


def _graph(report, name):
    return next(g.after for g in report.graphs if g.name == name)


def _assert_accuracy(out, grads, ref_out, ref_grads):
    out_db = sqnr_db(ref_out, out)
    grad_db = [sqnr_db(w, g) for g, w in zip(grads, ref_grads)]
    assert out_db >= OUT_SQNR_DB, out_db
    assert min(grad_db) >= GRAD_SQNR_DB, grad_db


SDPA_CASES = {
    "causal": (dict(is_causal=True), HQ),
    "plain": (dict(), HQ),
    "float_mask": (dict(mask=_float_mask()), HQ),
    "bool_mask": (dict(mask=_bool_mask()), HQ),
    "gqa_causal": (dict(is_causal=True), 2),
}


@pytest.mark.parametrize("case", sorted(SDPA_CASES))
def test_sdpa_is_replaced_by_mx_attention(case):
    kwargs, kv_heads = SDPA_CASES[case]
    q, k, v, do = _inputs(kv_heads=kv_heads)
    out, grads, report = _compile_and_run(sdpa, q, k, v, do, **kwargs)
    rows = _by_role(report)
    assert set(rows) == set(ALL_ROLES)
    assert all(d.decision == CONVERTED for d in rows.values()), rows
    assert {rows[r].graph for r in FORWARD_ROLES} == {"forward"}
    assert {rows[r].graph for r in BACKWARD_ROLES} == {"backward"}
    assert all("sdpa_flash_cpu" in d.reason for d in rows.values())
    assert sum(rows[r].flops for r in FORWARD_ROLES) == 4 * B * HQ * T * T * D
    assert [(o.axis, o.elem) for o in rows[S_QK].operands] == [(3, "e4m3"), (3, "e4m3")]
    assert [o.axis for o in rows[O_PV].operands] == [3, 2]  # P and V along the keys
    assert [o.axis for o in rows[DV].operands] == [2, 2]  # P and dO along the queries
    assert [o.axis for o in rows[DK].operands] == [2, 2]  # dS and Q along the queries
    forward, backward = _graph(report, "forward"), _graph(report, "backward")
    assert "mxcompile.attention.default" in forward and "flash_attention" not in forward
    assert "mxcompile.attention_backward.default" in backward and "flash_attention" not in backward
    _assert_accuracy(out, grads, *_reference(sdpa, q, k, v, do, **kwargs))


EAGER_CASES = {
    "causal": (dict(is_causal=True), HQ),
    "float_mask": (dict(mask=_float_mask()), HQ),
    "gqa_causal": (dict(is_causal=True), 2),
}


@pytest.mark.parametrize("case", sorted(EAGER_CASES))
def test_eager_attention_gemms_are_claimed_and_converted(case):
    kwargs, kv_heads = EAGER_CASES[case]
    q, k, v, do = _inputs(kv_heads=kv_heads)
    out, grads, report = _compile_and_run(eager_attention, q, k, v, do, **kwargs)
    rows = _by_role(report)
    assert set(rows) == set(ALL_ROLES)
    assert all(d.decision == CONVERTED and d.op.startswith("aten.bmm.default") for d in rows.values())
    # gemm_rewrite saw none of them: every GEMM decision of this graph is an attention one.
    assert all(d.kind == KIND for d in report.decisions)
    contraction = {role: d.operands[0].shape[2] for role, d in rows.items()}
    assert contraction == {S_QK: D, O_PV: T, DV: T, DP: D, DQ: T, DK: T}
    assert sum(rows[r].flops for r in FORWARD_ROLES) == 4 * B * HQ * T * T * D
    assert "aten.bmm" not in _graph(report, "forward") and "aten.bmm" not in _graph(report, "backward")
    _assert_accuracy(out, grads, *_reference(eager_attention, q, k, v, do, **kwargs))


ODD = 65  # HF ViT's 64 patches + CLS: neither keys nor queries fill blocks of 32
ODD_CASES = {
    "causal": lambda: dict(is_causal=True),
    "plain": lambda: dict(),
    "float_mask": lambda: dict(mask=_float_mask(q_len=ODD, k_len=ODD)),
    "bool_mask": lambda: dict(mask=_bool_mask(q_len=ODD, k_len=ODD)),
}


@pytest.mark.parametrize("case", sorted(ODD_CASES))
def test_sdpa_with_key_length_65_is_padded_masked_and_sliced(case):
    """Keys and values padded with zeros to 96 and the padded keys masked (no mask is needed
    under a square causal mask); queries padded and their rows sliced off."""
    kwargs = ODD_CASES[case]()
    q, k, v, do = _inputs(q_len=ODD, k_len=ODD)
    out, grads, report = _compile_and_run(sdpa, q, k, v, do, **kwargs)
    rows = _by_role(report)
    assert set(rows) == set(ALL_ROLES)
    assert all(d.decision == CONVERTED for d in rows.values()), rows
    masked = "hidden by the causal mask" if case == "causal" else "padded keys masked"
    for d in rows.values():
        assert "key length 65 zero-padded to 96" in d.reason and masked in d.reason, d.reason
        assert "query length 65 zero-padded to 96, padded queries sliced off" in d.reason
    assert sum(rows[r].flops for r in FORWARD_ROLES) == 4 * B * HQ * ODD * ODD * D
    forward = _graph(report, "forward")
    assert "mxcompile.attention.default" in forward and "flash_attention" not in forward
    assert "aten.constant_pad_nd" in forward
    assert out.shape == q.shape and all(g.shape == t.shape for g, t in zip(grads, (q, k, v)))
    _assert_accuracy(out, grads, *_reference(sdpa, q, k, v, do, **kwargs))


@pytest.mark.parametrize("case", ["causal", "float_mask"])
def test_eager_attention_with_length_65_pads_the_token_contractions(case):
    kwargs = ODD_CASES[case]()
    q, k, v, do = _inputs(q_len=ODD, k_len=ODD)
    out, grads, report = _compile_and_run(eager_attention, q, k, v, do, **kwargs)
    rows = _by_role(report)
    assert all(d.decision == CONVERTED for d in rows.values()), rows
    for role in (O_PV, DV, DQ, DK):  # contract over keys or queries
        assert "K=65 zero-padded to 96" in rows[role].reason, rows[role].reason
    for role in (S_QK, DP):  # contract over head_dim
        assert f"(K={D};" in rows[role].reason
    assert "aten.bmm" not in _graph(report, "forward") and "aten.bmm" not in _graph(report, "backward")
    assert all(d.kind == KIND for d in report.decisions)
    _assert_accuracy(out, grads, *_reference(eager_attention, q, k, v, do, **kwargs))


def test_query_length_is_padded_only_for_training():
    """dV and dK contract over the queries, so a query length of 48 is padded in training
    graphs and left as it is in inference graphs."""
    q, k, v, do = _inputs(q_len=48, k_len=64)
    out, grads, report = _compile_and_run(sdpa, q, k, v, do)
    decisions = _attention_decisions(report)
    assert all(d.decision == CONVERTED and "query length 48 zero-padded to 64" in d.reason for d in decisions)
    _assert_accuracy(out, grads, *_reference(sdpa, q, k, v, do))
    report = Report({})
    compiled = torch.compile(sdpa, backend=eager_mxfp8_backend(MXConfig(), report))
    with torch.no_grad():
        out = compiled(q, k, v)
    rows = _by_role(report)
    assert set(rows) == set(FORWARD_ROLES)
    assert all(d.decision == CONVERTED and d.graph == "inference" and "padded" not in d.reason
               for d in rows.values())
    assert sqnr_db(sdpa(q, k, v), out) >= OUT_SQNR_DB


def test_dynamic_sequence_length_is_padded_at_run_time_without_recompiling(monkeypatch):
    """After a second length dynamo recompiles with a symbolic sequence length; blocks of 32
    cannot be proven to fit, so the lengths are padded at run time and that one graph serves
    every later length (65 and 100 included) without another compile."""
    import mxcompile.ops.cpu_kernels as cpu_kernels

    # The op's compiled rounding of large CPU operands counts its own graphs in dynamo's
    # counters: keep it eager so that the count below is the model's alone.
    monkeypatch.setattr(cpu_kernels, "COMPILED_MIN_NUMEL", math.inf)
    torch._dynamo.reset()
    counters.clear()
    report = Report({})
    causal_sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    compiled = torch.compile(causal_sdpa, backend=eager_mxfp8_backend(MXConfig(), report))
    for length in (64, 96, 65, 100):
        q, k, v, do = _inputs(q_len=length, k_len=length, seed=length)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = compiled(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), do)
        _assert_accuracy(out.detach(), grads, *_reference(causal_sdpa, q, k, v, do))
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    decisions = _attention_decisions(report)
    assert len(decisions) == 12 and report.fallbacks == []
    assert all(d.decision == CONVERTED for d in decisions), decisions
    symbolic = decisions[6:]
    assert all("zero-padded at run time" in d.reason for d in symbolic), symbolic
    torch._dynamo.reset()


def test_head_dim_not_divisible_by_block_size_is_kept():
    q, k, v, do = _inputs(width=16)
    _, _, report = _compile_and_run(sdpa, q, k, v, do, is_causal=True)
    decisions = _attention_decisions(report)
    assert len(decisions) == 6
    assert all(d.decision == KEPT and "head_dim 16 is not divisible by block_size=32" in d.reason
               for d in decisions)


def test_attention_off_keeps_everything_with_the_reason():
    q, k, v, do = _inputs()
    for fn in (sdpa, eager_attention):
        torch._dynamo.reset()
        out, grads, report = _compile_and_run(fn, q, k, v, do, MXConfig(attention="off"), is_causal=True)
        rows = _by_role(report)
        assert set(rows) == set(ALL_ROLES)
        assert all(d.decision == KEPT and "attention='off'" in d.reason for d in rows.values())
        assert "mxcompile" not in _graph(report, "forward")
        ref_out, _ = _reference(fn, q, k, v, do, is_causal=True)
        torch.testing.assert_close(out, ref_out)


@pytest.mark.parametrize("fn", [sdpa, eager_attention], ids=["sdpa", "eager"])
def test_qk_only_converts_the_score_path_and_keeps_the_value_path(fn):
    q, k, v, do = _inputs()
    out, grads, report = _compile_and_run(fn, q, k, v, do, MXConfig(attention="qk_only"), is_causal=True)
    rows = _by_role(report)
    assert {r for r, d in rows.items() if d.decision == CONVERTED} == {S_QK, DQ, DK}
    for role in (O_PV, DV, DP):
        assert "attention='qk_only' keeps the value path" in rows[role].reason
    if fn is sdpa:
        assert "'qk_only'" in _graph(report, "forward")  # the MX op runs in qk_only mode
    ref_out, ref_grads = _reference(fn, q, k, v, do, is_causal=True)
    _assert_accuracy(out, grads, ref_out, ref_grads)
    both_out, _, _ = _compile_and_run(fn, q, k, v, do, is_causal=True)
    assert sqnr_db(ref_out, out) > sqnr_db(ref_out, both_out)


def test_dropout_attention_decomposes_to_eager_form_and_is_claimed():
    """With dropout_p > 0 torch traces SDPA's math decomposition (bmm, _safe_softmax, a dropout
    mask): the eager pattern claims it, and P is quantized after the dropout mask is applied."""
    q, k, v, do = _inputs()
    _, grads, report = _compile_and_run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1),
                                        q, k, v, do)
    rows = _by_role(report)
    assert set(rows) == set(ALL_ROLES)
    assert all(d.decision == CONVERTED and "eager softmax attention" in d.reason for d in rows.values())
    assert all(torch.isfinite(g).all() for g in grads)


def test_explain_reports_attention_flops_for_the_gpt_example():
    model, (idx,) = gpt_factory("tiny")
    report = mxcompile.explain(model, idx)
    config = model.config
    rows = _attention_decisions(report)
    assert len(rows) == 6 * config.n_layer and all(d.decision == CONVERTED for d in rows)
    forward_flops = sum(d.flops for d in rows if d.graph == "forward")
    batch, seq = idx.shape
    assert forward_flops == config.n_layer * 4 * batch * config.n_head * seq * seq * config.head_dim
    assert {d.module for d in rows} == {f"blocks.{i}.attn" for i in range(config.n_layer)}
    assert report.converted_flop_fraction == 1.0


transformers = pytest.importorskip("transformers")


def _tiny_llama(attn_implementation: str):
    # head_dim is set explicitly: hidden 64 / 4 heads = 16 is not a multiple of block_size 32.
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_hf_llama_eager_and_sdpa_both_rewrite_and_agree():
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    logits = {}
    for implementation in ("eager", "sdpa"):
        torch._dynamo.reset()
        model = _tiny_llama(implementation)
        reference = model(input_ids=ids).logits.detach()
        report = Report({})
        compiled = torch.compile(model, backend=eager_mxfp8_backend(MXConfig(), report))
        output = compiled(input_ids=ids, labels=ids)
        output.loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        rows = _attention_decisions(report)
        assert len(rows) == 2 * 6 and all(d.decision == CONVERTED for d in rows), rows
        pattern = "eager softmax attention" if implementation == "eager" else "sdpa_flash_cpu"
        assert all(pattern in d.reason for d in rows)
        assert {d.module for d in rows} == {f"model.layers.{i}.self_attn" for i in range(2)}
        logits[implementation] = output.logits.detach()
        assert sqnr_db(reference, logits[implementation]) >= 20.0
    assert sqnr_db(logits["eager"], logits["sdpa"]) >= 25.0


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_gpt_example_trains_with_mx_attention(attention):
    model, (idx,) = gpt_factory("tiny", attention=attention)
    targets = torch.roll(idx, -1, dims=1)
    report = Report({})
    compiled = torch.compile(model, backend=eager_mxfp8_backend(MXConfig(), report))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = lm_loss(compiled(idx), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses
    rows = _attention_decisions(report)
    assert rows and all(d.decision == CONVERTED for d in rows)


class _AttentionBlock(nn.Module):
    def __init__(self, width=64, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).split(width, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


@pytest.mark.slow
def test_inductor_runs_the_mx_attention_op_like_the_eager_pipeline():
    """The attention ops stay opaque through Inductor (fallback kernels): same numbers as the
    pipeline run op by op."""
    torch.manual_seed(0)
    block = _AttentionBlock()
    x = torch.randn(2, 64, 64)

    def run(compiled):
        block.zero_grad()
        out = compiled(x)
        out.pow(2).mean().backward()
        return out.detach(), block.qkv.weight.grad.clone()

    report = Report({})
    eager_out, eager_grad = run(torch.compile(block, backend=eager_mxfp8_backend(MXConfig(), report)))
    torch._dynamo.reset()
    inductor_out, inductor_grad = run(mxcompile.compile(block))
    assert sum(d.decision == CONVERTED for d in _attention_decisions(report)) == 6
    assert sqnr_db(eager_out, inductor_out) >= 60
    assert sqnr_db(eager_grad, inductor_grad) >= 60


@pytest.mark.parametrize("budget", [None, 1.0, 0.5, "64MiB"])
def test_batch_chunk_is_the_largest_the_budget_leaves_room_for(budget):
    """Without a memory budget the ops' torch implementation runs up to
    ATTENTION_CHUNK_QUERY_NUMEL query elements at once (here the whole batch of B). A budget
    of 1.0 (keep everything) changes nothing, the chunk included (issue 37: on the small GPT
    it measured 19% under the unbudgeted step, which 1.0 must equal). Below 1.0 the rewrite
    gives one element per call, the least scratch, and after the plan each op gets the largest
    chunk whose scratch fits its step's room (`passes.attention_chunks`), each decision recorded
    with its room and reason (issue 37: one-element chunks cost the small GPT ~17 ms per step):
    the whole batch under 64 MiB; at half the activation memory of this one-op graph the
    backward is the peak, and its op keeps one element."""
    q, k, v, do = _inputs()
    assert B * HQ * T * D <= ATTENTION_CHUNK_QUERY_NUMEL
    _, _, report = _compile_and_run(sdpa, q, k, v, do, config=MXConfig(memory_budget=budget), is_causal=True)
    calls = [line for name in ("forward", "backward") for line in _graph(report, name).splitlines()
             if "mxcompile.attention" in line]
    assert len(calls) == 2, calls
    chunks = [int(call.split(");")[0].rstrip(")").rsplit(",", 1)[1]) for call in calls]
    expected = {None: [B, B], 1.0: [B, B], 0.5: [B, 1], "64MiB": [B, B]}[budget]
    assert chunks == expected, calls
    if budget is not None and budget != 1.0:
        decisions = report.memory_plan["attention_chunks"]
        assert [c["batch_chunk"] for c in decisions] == expected
        for decision in decisions:
            assert decision["unbudgeted_chunk"] == B
            assert decision["scratch_bytes"] <= decision["room_bytes"] or decision["batch_chunk"] == 1
            assert str(decision["room_bytes"]) in decision["reason"]

"""GPT example model: shapes, config validation, eager vs SDPA attention, seeded factory."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mxcompile.examples.gpt import (
    BYTE_VOCAB_SIZE,
    GPT,
    GPT_SIZES,
    GPTConfig,
    RMSNorm,
    eager_causal_attention,
    gpt_factory,
    lm_loss,
)
from mxcompile.numerics import DEFAULT_BLOCK_SIZE

TINY = GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32)
FP32_ATOL = 1e-5


def _tokens(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, BYTE_VOCAB_SIZE, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_forward_shapes_and_loss() -> None:
    model = GPT(TINY)
    idx = _tokens(3, TINY.block_size)
    logits = model(idx)
    assert logits.shape == (3, TINY.block_size, TINY.vocab_size)
    loss = model.loss(idx, _tokens(3, TINY.block_size, seed=1))
    assert loss.shape == ()
    # At initialisation the prediction is close to uniform over the byte vocabulary.
    assert abs(loss.item() - math.log(BYTE_VOCAB_SIZE)) < 0.5
    assert model(idx[:, :5]).shape == (3, 5, TINY.vocab_size)  # shorter sequences are fine


def test_structure_and_module_names() -> None:
    model = GPT(TINY)
    names = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    expected = {"lm_head"} | {
        f"blocks.{i}.{suffix}" for i in range(TINY.n_layer) for suffix in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    }
    assert names == expected
    assert model.blocks[0].mlp.fc.out_features == TINY.mlp_ratio * TINY.d_model
    assert model.lm_head.weight.data_ptr() != model.tok_emb.weight.data_ptr()  # untied
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("size", sorted(GPT_SIZES))
def test_presets_have_mx_eligible_linears(size: str) -> None:
    with torch.device("meta"):
        model = GPT(GPT_SIZES[size])
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            assert module.in_features % DEFAULT_BLOCK_SIZE == 0, name
            assert module.out_features % DEFAULT_BLOCK_SIZE == 0, name


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"d_model": 64, "n_head": 3}, "d_model"),
        ({"n_layer": 0}, "n_layer"),
        ({"n_head": -1}, "n_head"),
        ({"block_size": 8.0}, "block_size"),
        ({"vocab_size": True}, "vocab_size"),
        ({"mlp_ratio": 0}, "mlp_ratio"),
        ({"attention": "flash"}, "attention"),
        ({"bias": 1}, "bias"),
        ({"norm_eps": 0.0}, "norm_eps"),
    ],
)
def test_config_validation_names_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GPTConfig(**changes)


def test_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        TINY.n_layer = 3  # type: ignore[misc]


def test_forward_rejects_bad_inputs() -> None:
    model = GPT(TINY)
    with pytest.raises(ValueError, match="block_size"):
        model(_tokens(1, TINY.block_size + 1))
    with pytest.raises(ValueError, match="dtype"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="shape"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        lm_loss(model(_tokens(2, 4)), _tokens(2, 5))


def test_eager_attention_matches_sdpa() -> None:
    sdpa, (idx,) = gpt_factory("tiny", seed=3)
    eager, _ = gpt_factory("tiny", seed=3, attention="eager")
    assert eager.config.attention == "eager" and sdpa.config.attention == "sdpa"
    torch.testing.assert_close(eager(idx), sdpa(idx), atol=FP32_ATOL, rtol=0)
    targets = _tokens(*idx.shape, seed=4)
    sdpa.loss(idx, targets).backward()
    eager.loss(idx, targets).backward()
    for (name, p_sdpa), p_eager in zip(sdpa.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p_eager.grad, p_sdpa.grad, atol=FP32_ATOL, rtol=0, msg=name)


def test_eager_causal_attention_is_causal() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))
    out = eager_causal_attention(q, k, v)
    v_future = v.clone()
    v_future[..., 3:, :] += 1.0  # changing later positions must not affect earlier outputs
    torch.testing.assert_close(eager_causal_attention(q, k, v_future)[..., :3, :], out[..., :3, :])
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, atol=FP32_ATOL, rtol=0)


def test_rmsnorm() -> None:
    norm = RMSNorm(8, eps=1e-6)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)) * 5
    y = norm(x)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(3), atol=1e-4, rtol=0)
    assert norm(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="eps"):
        RMSNorm(8, eps=-1.0)


def test_factory_is_seeded_and_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a, (idx_a,) = gpt_factory("tiny", seed=7, batch_size=3)
    b, (idx_b,) = gpt_factory("tiny", seed=7, batch_size=3)
    c, _ = gpt_factory("tiny", seed=8)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert idx_a.shape == (3, GPT_SIZES["tiny"].block_size) and idx_a.dtype == torch.long
    assert torch.equal(idx_a, idx_b)
    for p_a, p_b in zip(a.parameters(), b.parameters()):
        assert torch.equal(p_a, p_b)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_factory_rejects_unknown_arguments() -> None:
    with pytest.raises(ValueError, match="size"):
        gpt_factory("huge")
    with pytest.raises(ValueError, match="attention"):
        gpt_factory("tiny", attention="flash")
    with pytest.raises(ValueError, match="batch_size"):
        gpt_factory("tiny", batch_size=0)


def test_generate_appends_tokens() -> None:
    model = GPT(TINY)
    prompt = _tokens(2, 3)
    out = model.generate(prompt, max_new_tokens=TINY.block_size, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 3 + TINY.block_size)
    assert torch.equal(out[:, :3], prompt)

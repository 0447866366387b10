"""MLP example model: shapes, residual connections, config validation, seeded factory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mxcompile.examples.mlp import MLP, MLP_SIZES, MLPConfig, mlp_factory
from mxcompile.numerics import DEFAULT_BLOCK_SIZE


def test_forward_shape_and_structure() -> None:
    config = MLPConfig(widths=[32, 96, 64])
    assert config.widths == (32, 96, 64) and config.n_layers == 2
    model = MLP(config)
    assert [layer.linear.out_features for layer in model.layers] == [96, 64]
    assert model(torch.randn(5, 32)).shape == (5, 64)
    assert model(torch.randn(2, 3, 32)).shape == (2, 3, 64)  # leading dimensions pass through
    with pytest.raises(ValueError, match="widths"):
        model(torch.randn(5, 31))


def test_residual_only_where_widths_match() -> None:
    model = MLP(MLPConfig(widths=(32, 64, 64, 32), residual=True))
    assert [layer.residual for layer in model.layers] == [False, True, False]
    layer = model.layers[1]
    x = torch.randn(4, 64)
    torch.testing.assert_close(layer(x), x + layer.act(layer.linear(x)))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"widths": (32,)}, "widths"),
        ({"widths": (32, 0)}, r"widths\[1\]"),
        ({"widths": "32"}, "widths"),
        ({"residual": "yes"}, "residual"),
        ({"bias": None}, "bias"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MLPConfig(**kwargs)


@pytest.mark.parametrize("size", sorted(MLP_SIZES))
def test_presets_have_mx_eligible_linears(size: str) -> None:
    model, (x,) = mlp_factory(size)
    assert x.shape[0] % DEFAULT_BLOCK_SIZE == 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            assert module.in_features % DEFAULT_BLOCK_SIZE == 0
            assert module.out_features % DEFAULT_BLOCK_SIZE == 0


def test_factory_is_seeded() -> None:
    state = torch.random.get_rng_state()
    a, (x_a,) = mlp_factory("tiny", seed=1, batch_size=32)
    b, (x_b,) = mlp_factory("tiny", seed=1, batch_size=32)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert x_a.shape == (32, MLP_SIZES["tiny"].widths[0])
    assert torch.equal(x_a, x_b) and torch.equal(a(x_a), b(x_b))
    residual, _ = mlp_factory("tiny", residual=True)
    assert residual.config.residual
    with pytest.raises(ValueError, match="size"):
        mlp_factory("enormous")

"""A stack of Linear + GELU layers: the smallest model whose every GEMM is MX-eligible.

With the preset sizes every width and the example batch are multiples of 32, so the forward
GEMM (contraction over in_features) and both backward GEMMs (over out_features for dX, over
the batch for dW) can run in MXFP8. Layers are named `layers.{i}.linear`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch
from torch import Tensor, nn

from ._common import check_bool, check_choice, check_positive_int, seeded

MIN_WIDTHS = 2  # an input width and at least one output width
DEFAULT_EXAMPLE_BATCH_SIZE = 64

__all__ = ["MLP", "MLPConfig", "MLPLayer", "MLP_SIZES", "mlp_factory"]


@dataclass(frozen=True)
class MLPConfig:
    """Shape of an `MLP`. Frozen; invalid values raise ValueError naming the field.

    widths: feature widths (d_0, d_1, ..., d_n); layer i maps d_i -> d_{i+1}, then applies GELU.
    residual: add each layer's input to its output wherever d_i == d_{i+1}.
    bias: whether the linears carry a bias.
    """

    widths: tuple[int, ...] = (64, 256, 256, 64)
    residual: bool = False
    bias: bool = True

    def __post_init__(self) -> None:
        widths = self.widths
        if isinstance(widths, (str, bytes)) or not hasattr(widths, "__iter__"):
            raise ValueError(f"widths={widths!r} is not accepted; give a sequence of positive ints")
        widths = tuple(widths)
        if len(widths) < MIN_WIDTHS:
            raise ValueError(
                f"widths={widths!r} is not accepted; give at least {MIN_WIDTHS} widths (input and output)"
            )
        for i, width in enumerate(widths):
            check_positive_int(f"widths[{i}]", width)
        object.__setattr__(self, "widths", widths)
        check_bool("residual", self.residual)
        check_bool("bias", self.bias)

    @property
    def n_layers(self) -> int:
        """Number of Linear + GELU layers."""
        return len(self.widths) - 1


MLP_SIZES: Mapping[str, MLPConfig] = MappingProxyType(
    {
        "tiny": MLPConfig(widths=(64, 256, 256, 64)),
        "small": MLPConfig(widths=(256, 1024, 1024, 256)),
    }
)
"""Preset configurations by name (read-only)."""


class MLPLayer(nn.Module):
    """GELU(Linear(x)), plus x when `residual`."""

    def __init__(self, in_features: int, out_features: int, *, residual: bool, bias: bool) -> None:
        super().__init__()
        if residual and in_features != out_features:
            raise ValueError(
                f"residual=True needs in_features == out_features; got {in_features} and {out_features}"
            )
        self.residual = residual
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.act = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        y = self.act(self.linear(x))
        return x + y if self.residual else y


class MLP(nn.Module):
    """`config.n_layers` Linear + GELU layers; maps (..., widths[0]) to (..., widths[-1])."""

    def __init__(self, config: MLPConfig | None = None) -> None:
        super().__init__()
        config = MLPConfig() if config is None else config
        if not isinstance(config, MLPConfig):
            raise TypeError(f"config={config!r} is not accepted; give an MLPConfig")
        self.config = config
        pairs = zip(config.widths[:-1], config.widths[1:])
        self.layers = nn.ModuleList(
            MLPLayer(d_in, d_out, residual=config.residual and d_in == d_out, bias=config.bias)
            for d_in, d_out in pairs
        )

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.config.widths[0]:
            raise ValueError(
                f"x has {x.shape[-1]} features in its last dimension; expected widths[0]={self.config.widths[0]}"
            )
        for layer in self.layers:
            x = layer(x)
        return x


def mlp_factory(
    size: str = "tiny",
    *,
    batch_size: int = DEFAULT_EXAMPLE_BATCH_SIZE,
    seed: int = 0,
    residual: bool | None = None,
) -> tuple[MLP, tuple[Tensor]]:
    """A seeded MLP of a preset size (see `MLP_SIZES`) and example inputs `(x,)`, x being a
    (batch_size, widths[0]) standard-normal float32 tensor. The same arguments give the same
    weights and inputs; the caller's global random state is left untouched. `residual`
    overrides the preset."""
    check_choice("size", size, list(MLP_SIZES))
    check_positive_int("batch_size", batch_size)
    config = MLP_SIZES[size]
    if residual is not None:
        check_bool("residual", residual)
        config = MLPConfig(widths=config.widths, residual=residual, bias=config.bias)
    model = seeded(seed, lambda: MLP(config))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, config.widths[0], generator=generator)
    return model, (x,)

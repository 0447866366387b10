"""Example models, an offline text corpus and a training loop for the demo, tests and benchmarks.

`EXAMPLES` maps a name to a factory: a callable taking no arguments and returning
`(model, example_inputs)`, example_inputs being a tuple such that `model(*example_inputs)` runs.
This is the shape the CLI accepts for targets. Factories are seeded: each call builds the same
weights and inputs, and leaves the caller's global random state untouched.

    model, inputs = get_example("gpt")()
"""

from __future__ import annotations

from functools import partial
from types import MappingProxyType
from typing import Callable, Mapping

from torch import Tensor, nn

from .data import (
    CorpusNotFoundError,
    batches,
    decode,
    encode,
    list_texts,
    load_corpus,
    texts_dir,
    train_val_split,
)
from .gpt import GPT, GPT_SIZES, GPTConfig, gpt_factory, lm_loss
from .mlp import MLP, MLP_SIZES, MLPConfig, mlp_factory
from .train import evaluate, make_optimizer, maybe_compile, train

ExampleFactory = Callable[[], tuple[nn.Module, tuple[Tensor, ...]]]
"""A callable returning (model, example_inputs)."""

EXAMPLES: Mapping[str, ExampleFactory] = MappingProxyType(
    {
        "gpt": partial(gpt_factory, "tiny"),
        "gpt-eager": partial(gpt_factory, "tiny", attention="eager"),
        "gpt-small": partial(gpt_factory, "small"),
        "gpt-medium": partial(gpt_factory, "medium"),
        "mlp": partial(mlp_factory, "tiny"),
        "mlp-residual": partial(mlp_factory, "tiny", residual=True),
        "mlp-small": partial(mlp_factory, "small"),
    }
)
"""Registered example targets by name (read-only)."""


def get_example(name: str) -> ExampleFactory:
    """The factory registered as `name`; ValueError listing the known names otherwise."""
    try:
        return EXAMPLES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown example {name!r}; known examples: {sorted(EXAMPLES)}") from None


__all__ = [
    "EXAMPLES",
    "GPT",
    "GPTConfig",
    "GPT_SIZES",
    "MLP",
    "MLPConfig",
    "MLP_SIZES",
    "CorpusNotFoundError",
    "ExampleFactory",
    "batches",
    "decode",
    "encode",
    "evaluate",
    "get_example",
    "gpt_factory",
    "list_texts",
    "lm_loss",
    "load_corpus",
    "make_optimizer",
    "maybe_compile",
    "mlp_factory",
    "texts_dir",
    "train",
    "train_val_split",
]

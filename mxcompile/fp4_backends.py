"""The FP4 torch.compile backends, `backend="nvfp4"` and `backend="mxfp4"` (issue 48): the mxfp8
backend (`backend.mxfp8_backend`: the same AOTAutograd wiring, passes, partition, lowering and
report) with an `MXConfig` of the recipe (`MXConfig.for_recipe`: the recipe's defaults under
the user's options).

    torch.compile(model, backend="nvfp4", options={"rht": False, "high_precision_layers": 2})
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.fx as fx

from .backend import mxfp8_backend
from .config import MXConfig, Recipe


def recipe_backend(
    recipe: Recipe,
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
    *,
    config: MXConfig | None = None,
) -> Callable:
    """`mxfp8_backend` with the config of `recipe`: from `options`, or `config` (whose recipe
    must be `recipe`)."""
    if config is not None and options:
        raise ValueError(f"give either config or options to the {recipe.value} backend, not both")
    if config is None:
        config = MXConfig.for_recipe(recipe, options)
    elif config.recipe is not recipe:
        raise ValueError(f"config.recipe={config.recipe.value!r}; the {recipe.value} backend takes "
                         f"MXConfig.for_recipe({recipe.value!r}, ...)")
    return mxfp8_backend(gm, example_inputs, mode=mode, config=config)


def nvfp4_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
                  mode: str | None = None, *, config: MXConfig | None = None) -> Callable:
    """The dynamo backend behind `torch.compile(model, backend="nvfp4", options={...})`."""
    return recipe_backend(Recipe.NVFP4, gm, example_inputs, options, mode, config=config)


def mxfp4_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
                  mode: str | None = None, *, config: MXConfig | None = None) -> Callable:
    """The dynamo backend behind `torch.compile(model, backend="mxfp4", options={...})`."""
    return recipe_backend(Recipe.MXFP4, gm, example_inputs, options, mode, config=config)

"""The EXAMPLES registry: every target builds and runs; unknown names are listed."""

from __future__ import annotations

import pytest
import torch

from mxcompile.examples import EXAMPLES, get_example


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_runs(name: str) -> None:
    model, inputs = get_example(name)()
    assert isinstance(inputs, tuple) and all(isinstance(t, torch.Tensor) for t in inputs)
    with torch.no_grad():
        out = model(*inputs)
    assert out.shape[0] == inputs[0].shape[0] and torch.isfinite(out).all()


def test_unknown_example_lists_known_names() -> None:
    with pytest.raises(ValueError, match="known examples") as info:
        get_example("resnet")
    for name in EXAMPLES:
        assert name in str(info.value)


def test_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        EXAMPLES["other"] = EXAMPLES["gpt"]  # type: ignore[index]

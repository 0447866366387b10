"""The factory protocol's keyword inputs: a factory may return (model, args, kwargs)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from mxcompile.cli.errors import CLIError
from mxcompile.cli.targets import load_target

SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 32)

        def forward(self, x, *, mask):
            return self.proj(x) * mask


    def with_kwargs():
        return Masked(), (torch.randn(32, 32),), {"mask": torch.ones(32, 32)}


    def only_kwargs():
        return Masked(), (), {"x": torch.randn(32, 32), "mask": torch.ones(32, 32)}


    def bad_kwargs():
        return Masked(), (torch.randn(32, 32),), [torch.ones(32, 32)]
    """
)


@pytest.fixture
def kwargs_target(tmp_path: Path) -> Path:
    path = tmp_path / "kw_target.py"
    path.write_text(SOURCE)
    return path


@pytest.mark.parametrize("factory", ["with_kwargs", "only_kwargs"])
def test_factory_may_return_keyword_inputs(kwargs_target: Path, factory: str) -> None:
    target = load_target(f"{kwargs_target}:{factory}")
    assert set(target.kwargs) >= {"mask"}
    out = target.model(*target.inputs, **target.kwargs)
    assert out.shape == (32, 32)


def test_two_tuple_factories_have_no_keyword_inputs(kwargs_target: Path) -> None:
    assert load_target("mxcompile.examples:mlp_factory").kwargs == {}


def test_keyword_inputs_that_are_not_a_dict_are_rejected(kwargs_target: Path) -> None:
    with pytest.raises(CLIError, match="list as keyword inputs"):
        load_target(f"{kwargs_target}:bad_kwargs")


def test_inspect_passes_keyword_inputs_to_the_model(kwargs_target: Path, cli) -> None:
    result = cli("inspect", f"{kwargs_target}:with_kwargs", "--json", "--graph", "none")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    decisions = [d for d in doc["decisions"] if d["module"] == "proj"]
    assert decisions and all(d["decision"] == "mxfp8" for d in decisions), decisions


def test_profile_refuses_keyword_inputs_in_one_line(kwargs_target: Path, cli, tmp_path: Path) -> None:
    result = cli("profile", f"{kwargs_target}:with_kwargs", "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "keyword inputs ['mask']" in lines[0], result.stderr

"""The shared training loop, run eagerly on a tiny GPT (torch.compile is covered elsewhere)."""

from __future__ import annotations

import itertools

import pytest
import torch

from mxcompile.examples._common import seeded
from mxcompile.examples.data import batches, load_corpus
from mxcompile.examples.gpt import GPT, GPTConfig, lm_loss
from mxcompile.examples.mlp import mlp_factory
from mxcompile.examples.train import evaluate, make_optimizer, maybe_compile, train

CONFIG = GPTConfig(block_size=32, n_layer=2, n_head=2, d_model=64)
STEPS = 20
BATCH = 8


@pytest.fixture(scope="module")
def corpus() -> torch.Tensor:
    return load_corpus(num_texts=1)


def _model(seed: int = 0) -> GPT:
    return seeded(seed, lambda: GPT(CONFIG))


def test_loss_decreases(corpus: torch.Tensor) -> None:
    seen: list[tuple[int, float]] = []
    losses = train(
        _model(), STEPS, BATCH, CONFIG.block_size, lr=3e-3, seed=0, data=corpus,
        progress=lambda step, loss: seen.append((step, loss)),
    )
    assert len(losses) == STEPS
    assert seen == list(enumerate(losses, start=1))
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0


def test_training_is_deterministic(corpus: torch.Tensor) -> None:
    kwargs = dict(steps=3, batch_size=4, seq_len=16, lr=1e-3, seed=1, data=corpus, max_grad_norm=1.0)
    assert train(_model(), **kwargs) == train(_model(), **kwargs)


def test_autocast_bf16_tracks_fp32(corpus: torch.Tensor) -> None:
    losses = train(_model(), 2, 2, 16, data=corpus, autocast_bf16=True)
    fp32 = train(_model(), 2, 2, 16, data=corpus)
    # Measured 1.7e-5 relative apart: bf16 rounding, not a different computation.
    assert losses == pytest.approx(fp32, rel=1e-3), (losses, fp32)
    assert losses != fp32  # autocast was applied: bf16 rounding shows in the loss


def test_evaluate_restores_mode(corpus: torch.Tensor) -> None:
    model = _model()
    model.train()
    loss = evaluate(model, 2, 16, num_batches=2, data=corpus)
    assert model.training
    # The mean loss of the same two deterministic batches, computed here in eval mode.
    model.eval()
    with torch.no_grad():
        direct = [lm_loss(model(x), y).item() for x, y in itertools.islice(batches(corpus, 2, 16, 0), 2)]
    model.train()
    assert loss == pytest.approx(sum(direct) / len(direct), rel=1e-6)
    assert evaluate(model, 2, 16, num_batches=2, data=corpus) == loss


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"steps": 0}, "steps"),
        ({"batch_size": -1}, "batch_size"),
        ({"seq_len": 0}, "seq_len"),
        ({"lr": 0.0}, "lr"),
        ({"autocast_bf16": 1}, "autocast_bf16"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"progress": "print"}, "progress"),
        ({"compile_options": {"mode": "x"}}, "compile_options"),
    ],
)
def test_train_validation(corpus: torch.Tensor, kwargs: dict, argument: str) -> None:
    arguments = dict(steps=1, batch_size=2, seq_len=8, data=corpus)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=argument):
        train(_model(), **arguments)


def test_optimizer_decays_matrices_only() -> None:
    model, _ = mlp_factory("tiny")
    groups = make_optimizer(model, lr=1e-3, weight_decay=0.1).param_groups
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(p) for p in model.parameters() if p.dim() >= 2}
    with pytest.raises(ValueError, match="weight_decay"):
        make_optimizer(model, lr=1e-3, weight_decay=-1.0)


def test_maybe_compile_without_backend_is_identity() -> None:
    model, _ = mlp_factory("tiny")
    assert maybe_compile(model, None) is model

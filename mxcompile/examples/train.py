"""A minimal, deterministic language-model training loop shared by the demo and the benchmarks.

    model = seeded(0, lambda: GPT(config))            # or gpt_factory(...)[0]
    losses = train(model, steps=100, batch_size=8, seq_len=64, lr=3e-3, seed=0,
                   compile_backend="mxfp8", compile_options={"attention": "off"})

The model maps (B, T) token ids to (B, T, V) logits (like `GPT`); the loss is `lm_loss`,
computed outside the compiled module. Initialisation is the caller's (seed it); the data order
is fixed by `seed`, so two runs with the same arguments see the same batches.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

from ._common import (
    check_bool,
    check_non_negative_float,
    check_non_negative_int,
    check_positive_float,
    check_positive_int,
)
from .data import batches, load_corpus, train_val_split
from .gpt import lm_loss

ADAMW_BETAS = (0.9, 0.95)
DEFAULT_LR = 3e-3
DEFAULT_WEIGHT_DECAY = 0.1  # applied to matrices only (not to biases, gains or 1-D parameters)
MIN_DECAYED_PARAM_DIM = 2
DEFAULT_EVAL_BATCHES = 8

ProgressCallback = Callable[[int, float], None]
"""Called after each step as progress(step, loss), step counting from 1 to `steps`."""

CompileBackend = str | Callable[..., Any]

__all__ = [
    "ADAMW_BETAS",
    "CompileBackend",
    "ProgressCallback",
    "evaluate",
    "make_optimizer",
    "maybe_compile",
    "train",
]


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = DEFAULT_WEIGHT_DECAY) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on parameters with 2 or more
    dimensions (weight matrices, embeddings) only."""
    check_positive_float("lr", lr)
    check_non_negative_float("weight_decay", weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    decayed = [p for p in params if p.dim() >= MIN_DECAYED_PARAM_DIM]
    others = [p for p in params if p.dim() < MIN_DECAYED_PARAM_DIM]
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=ADAMW_BETAS)


def maybe_compile(
    model: nn.Module,
    compile_backend: CompileBackend | None,
    compile_options: Mapping[str, Any] | None = None,
) -> nn.Module | Callable[..., Any]:
    """`torch.compile(model, backend=compile_backend, options=compile_options)`, or `model`
    itself when compile_backend is None. `options` is passed only when not None."""
    if compile_backend is None:
        if compile_options is not None:
            raise ValueError("compile_options is given but compile_backend is None; give a backend too")
        return model
    kwargs: dict[str, Any] = {"backend": compile_backend}
    if compile_options is not None:
        kwargs["options"] = dict(compile_options)
    return torch.compile(model, **kwargs)


def _model_device(model: nn.Module) -> torch.device:
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    raise ValueError("model has no parameters or buffers; cannot tell its device")


def _autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager[Any]:
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _default_split(val: bool) -> Tensor:
    train_data, val_data = train_val_split(load_corpus())
    return val_data if val else train_data


def train(
    model: nn.Module,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    compile_backend: CompileBackend | None = None,
    compile_options: Mapping[str, Any] | None = None,
    autocast_bf16: bool = False,
    progress: ProgressCallback | None = None,
    *,
    data: Tensor | None = None,
    weight_decay: float = DEFAULT_WEIGHT_DECAY,
    max_grad_norm: float | None = None,
) -> list[float]:
    """Train `model` in place for `steps` AdamW steps on next-token prediction; return the
    training loss of every step.

    model: maps (B, T) int64 token ids to (B, T, V) logits, on the device training runs on.
    steps, batch_size, seq_len: loop length and batch shape (seq_len <= the model's block size).
    lr, weight_decay: AdamW settings (betas ADAMW_BETAS; decay on matrices only).
    seed: seeds the batch order (`data.batches`); the model's initialisation is the caller's.
    compile_backend: None trains eagerly; otherwise torch.compile(model, backend=...), e.g.
        "inductor", "eager" or "mxfp8". compile_options: passed as options= when not None.
    autocast_bf16: run forward and loss under torch.autocast(dtype=torch.bfloat16).
    progress: called as progress(step, loss) after each step, step counting from 1.
    data: 1-D token tensor to sample from; None loads the training split of the full corpus.
    max_grad_norm: clip the global gradient norm to this value when not None.
    """
    check_positive_int("steps", steps)
    check_positive_int("batch_size", batch_size)
    check_positive_int("seq_len", seq_len)
    check_non_negative_int("seed", seed)
    check_bool("autocast_bf16", autocast_bf16)
    if max_grad_norm is not None:
        check_positive_float("max_grad_norm", max_grad_norm)
    if progress is not None and not callable(progress):
        raise ValueError(f"progress={progress!r} is not accepted; give a callable or None")
    device = _model_device(model)
    optimizer = make_optimizer(model, lr, weight_decay)
    stream: Iterator[tuple[Tensor, Tensor]] = batches(
        _default_split(val=False) if data is None else data, batch_size, seq_len, seed, device=device
    )
    forward = maybe_compile(model, compile_backend, compile_options)

    model.train()
    losses: list[float] = []
    for step, (inputs, targets) in enumerate(itertools.islice(stream, steps), start=1):
        with _autocast(device, autocast_bf16):
            loss = lm_loss(forward(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        value = loss.item()
        losses.append(value)
        if progress is not None:
            progress(step, value)
    return losses


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    num_batches: int = DEFAULT_EVAL_BATCHES,
    seed: int = 0,
    *,
    data: Tensor | None = None,
    autocast_bf16: bool = False,
    forward: Callable[[Tensor], Tensor] | None = None,
) -> float:
    """Mean `lm_loss` over `num_batches` deterministic batches of `data` (None: the validation
    split of the full corpus), in eval mode without gradients. `forward` replaces `model` for
    the forward pass (e.g. a compiled module); the model's train/eval mode is restored."""
    check_positive_int("num_batches", num_batches)
    check_bool("autocast_bf16", autocast_bf16)
    device = _model_device(model)
    stream = batches(_default_split(val=True) if data is None else data, batch_size, seq_len, seed, device=device)
    call = model if forward is None else forward
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for inputs, targets in itertools.islice(stream, num_batches):
            with _autocast(device, autocast_bf16):
                total += lm_loss(call(inputs), targets).item()
    finally:
        model.train(was_training)
    return total / num_batches

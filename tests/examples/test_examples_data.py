"""Offline corpus loader and the deterministic batch sampler."""

from __future__ import annotations

import itertools

import pytest
import torch

from mxcompile.examples.data import (
    CORPUS_INSTALL_HINT,
    CorpusNotFoundError,
    batches,
    decode,
    encode,
    list_texts,
    load_corpus,
    texts_dir,
    train_val_split,
)


def test_corpus_texts_are_found() -> None:
    directory = texts_dir()
    assert directory.is_dir()
    paths = list_texts()
    assert len(paths) > 1
    assert [p.name for p in paths] == sorted(p.name for p in paths)
    assert all(p.suffix == ".txt" and p.parent == directory for p in paths)


def test_missing_corpus_names_the_install_command() -> None:
    with pytest.raises(CorpusNotFoundError, match=CORPUS_INSTALL_HINT.replace(".", r"\.")):
        texts_dir("no_such_corpus_package_for_mxcompile")
    with pytest.raises(FileNotFoundError):  # CorpusNotFoundError is a FileNotFoundError
        load_corpus(1, package="no_such_corpus_package_for_mxcompile")


def test_load_corpus_is_bytes_of_the_first_texts() -> None:
    first, second = list_texts()[:2]
    corpus = load_corpus(2)
    assert corpus.dtype == torch.uint8 and corpus.dim() == 1
    assert bytes(corpus.tolist()) == first.read_bytes() + second.read_bytes()
    with pytest.raises(ValueError, match="num_texts"):
        load_corpus(0)
    with pytest.raises(ValueError, match="num_texts"):
        load_corpus(len(list_texts()) + 1)


def test_encode_decode_round_trip() -> None:
    text = "To be, or not to be — that is the question"
    tokens = encode(text)
    assert tokens.dtype == torch.uint8
    assert decode(tokens) == text
    assert encode("").numel() == 0


def test_train_val_split() -> None:
    data = torch.arange(100, dtype=torch.uint8)
    train, val = train_val_split(data, val_fraction=0.2)
    assert len(train) == 80 and len(val) == 20
    assert torch.equal(torch.cat([train, val]), data)
    for bad in (0.0, 1.0, -0.1, True):
        with pytest.raises(ValueError, match="val_fraction"):
            train_val_split(data, val_fraction=bad)
    with pytest.raises(ValueError, match="non-empty"):
        train_val_split(torch.arange(2, dtype=torch.uint8), val_fraction=0.1)


def test_batches_are_deterministic_windows() -> None:
    data = torch.arange(200, dtype=torch.uint8)
    first = list(itertools.islice(batches(data, 4, 16, seed=5), 3))
    again = list(itertools.islice(batches(data, 4, 16, seed=5), 3))
    other = list(itertools.islice(batches(data, 4, 16, seed=6), 3))
    for (x, y), (x2, y2) in zip(first, again):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not all(torch.equal(x, x2) for (x, _), (x2, _) in zip(first, other))
    x, y = first[0]
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:])  # targets are inputs shifted by one
    assert torch.equal(x - x[:, :1], torch.arange(16).expand(4, 16))  # contiguous windows
    assert int(y.max()) < len(data)


def test_batches_do_not_touch_global_rng() -> None:
    state = torch.random.get_rng_state()
    next(batches(torch.arange(100, dtype=torch.uint8), 2, 8, seed=0))
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"seq_len": 0}, "seq_len"),
        ({"seq_len": 10}, "seq_len"),  # data too short for one window plus its target
        ({"seed": -1}, "seed"),
        ({"data": torch.zeros(2, 5, dtype=torch.uint8)}, "data"),
        ({"data": torch.zeros(50)}, "data"),
    ],
)
def test_batches_validation_is_eager(kwargs: dict, argument: str) -> None:
    arguments = {"data": torch.arange(10, dtype=torch.uint8), "batch_size": 2, "seq_len": 4, "seed": 0}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=argument):
        batches(**arguments)  # raises at the call, before any next()

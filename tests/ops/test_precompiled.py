"""ops.precompiled: compiled functions saved under the Inductor cache directory and loaded by
later instances (later processes) without Dynamo tracing."""

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from mxcompile.ops.precompiled import CACHE_SUBDIR, Precompiled


def _block_amax_scaled(x: torch.Tensor) -> torch.Tensor:
    return x * x.abs().amax(dim=1, keepdim=True).reciprocal()


def _precompiled(key: str = "test") -> Precompiled:
    return Precompiled(_block_amax_scaled, name="amax-scaled", key=key, dynamic_dims=(0,), globals_=globals())


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    return tmp_path / CACHE_SUBDIR


def test_a_saved_function_is_loaded_without_tracing_and_serves_other_sizes(cache_dir):
    first = _precompiled()
    x = torch.randn(8, 64)
    with torch.no_grad():
        assert torch.equal(first(x), _block_amax_scaled(x))
    assert first.path(torch.float32).exists()
    assert first.path(torch.float32).parent == cache_dir

    traced = counters["stats"]["unique_graphs"]
    second = _precompiled()  # what a new process builds
    for rows in (8, 3, 100):
        y = torch.randn(rows, 64)
        with torch.no_grad():
            assert torch.equal(second(y), _block_amax_scaled(y))
    assert counters["stats"]["unique_graphs"] == traced, "loaded from the file, not traced"

    # Another key or dtype is another file.
    assert _precompiled("other").path(torch.float32) != first.path(torch.float32)
    assert first.path(torch.bfloat16) != first.path(torch.float32)


def test_an_unusable_file_is_compiled_again_and_unsaved_sizes_are_traced(cache_dir, caplog):
    broken = _precompiled("broken")
    path = broken.path(torch.float32)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a pickle")
    x = torch.randn(4, 64)
    with caplog.at_level(logging.WARNING, logger="mxcompile.ops.precompiled"), torch.no_grad():
        assert torch.equal(broken(x), _block_amax_scaled(x))
    assert "cannot load the precompiled amax-scaled" in caplog.text
    assert path.read_bytes() != b"not a pickle", "replaced by the new compile"

    # A dynamic dim of size 1 would specialize the graph: such inputs run through torch.compile.
    single = torch.randn(1, 64)
    traced = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        assert torch.equal(broken(single), _block_amax_scaled(single))
    assert counters["stats"]["unique_graphs"] == traced + 1


def test_nothing_is_saved_when_the_compile_caches_are_off(cache_dir):
    from torch._inductor import config as inductor_config

    precompiled = _precompiled("uncached")
    x = torch.randn(4, 64)
    with inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        assert torch.equal(precompiled(x), _block_amax_scaled(x))
    assert not precompiled.path(torch.float32).exists()


def test_an_unwritable_cache_directory_is_reported_and_the_function_still_runs(cache_dir, caplog):
    cache_dir.write_bytes(b"")  # a file where the directory should be: mkdir and writes fail
    precompiled = _precompiled("unwritable")
    x = torch.randn(4, 64)
    with caplog.at_level(logging.WARNING, logger="mxcompile.ops.precompiled"), torch.no_grad():
        assert torch.equal(precompiled(x), _block_amax_scaled(x))
        assert torch.equal(precompiled(x[:3]), _block_amax_scaled(x[:3]))
    assert "cannot save the precompiled amax-scaled" in caplog.text

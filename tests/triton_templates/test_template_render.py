"""The renderer: deterministic, retrievable, cached source; loading from the cache directory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mxcompile.triton_templates import (
    mx_attention_kernel_source,
    mx_mm_kernel_source,
    quantize_kernel_source,
)
from mxcompile.triton_templates.mx_gemm import EPILOGUE_OPS, MXMMKey
from mxcompile.triton_templates.mx_gemm import mx_mm_kernel_source as gemm_source_for_key
from mxcompile.triton_templates.quantize import QuantizeKey, quantize_module
from mxcompile.triton_templates.render import load_source, render, source_digest

MODES = ("rceil", "floor", "ceil", "even")


def test_render_is_strict() -> None:
    assert render("a $x b ${y}", x=1, y="z") == "a 1 b z"
    with pytest.raises(ValueError, match="missing \\['y'\\]"):
        render("$x $y", x=1)
    with pytest.raises(ValueError, match="unused \\['z'\\]"):
        render("$x", x=1, z=2)


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cast", ["software", "hardware"])
def test_every_quantize_variant_renders_valid_python(elem: str, mode: str, cast: str) -> None:
    src = quantize_kernel_source(elem, mode, cast)
    compile(src, "<rendered>", "exec")
    assert src == quantize_kernel_source(elem, mode, cast)  # deterministic
    assert f"scale mode {mode}" in src and f"# {mode}:" in src
    assert ("fp_downcast_rounding" in src) == (cast == "hardware")
    # Only the selected scale rule is rendered.
    for other in set(MODES) - {mode}:
        assert f"# {other}:" not in src


def test_sources_differ_by_key_and_are_cached_by_key() -> None:
    keys = {QuantizeKey(e, m, "software") for e in ("e4m3", "e5m2") for m in MODES}
    sources = {quantize_kernel_source(k.elem, k.scale_mode) for k in keys}
    assert len(sources) == len(keys)
    key = MXMMKey(epilogue=("bias", "silu"))
    assert gemm_source_for_key(key) is gemm_source_for_key(MXMMKey(epilogue=("bias", "silu")))


def test_gemm_epilogue_renders_in_order() -> None:
    src = mx_mm_kernel_source(epilogue=("residual", "gelu_erf", "bias"))
    compile(src, "<rendered>", "exec")
    positions = [src.index(f"# Epilogue: {t}") for t in ("residual add", "GELU, exact", "bias add")]
    assert positions == sorted(positions)
    assert "# Epilogue: SiLU" not in src
    plain = mx_mm_kernel_source()
    assert "(no epilogue ops)" in plain and "# Epilogue:" not in plain
    for op in EPILOGUE_OPS:
        compile(mx_mm_kernel_source(epilogue=(op,)), "<rendered>", "exec")
    with pytest.raises(ValueError, match="not supported"):
        mx_mm_kernel_source(epilogue=("relu",))
    with pytest.raises(ValueError, match="repeats"):
        mx_mm_kernel_source(epilogue=("bias", "bias"))


def test_attention_source_renders() -> None:
    src = mx_attention_kernel_source("e4m3", "rceil")
    compile(src, "<rendered>", "exec")
    assert "tl.dot_scaled(p_data, p_scale" in src


def test_attention_backward_source_renders_both_formats() -> None:
    from mxcompile.triton_templates.attention_backward import (
        AttentionBackwardKey,
        mx_attention_backward_kernel_source,
    )

    src = mx_attention_backward_kernel_source(AttentionBackwardKey("e4m3", "e5m2"))
    compile(src, "<rendered>", "exec")
    # The helpers of each element format, under their own names.
    assert "def _mx_quantize_blocks_fwd(" in src and "def _mx_quantize_blocks_grad(" in src
    assert "def _mx_quantize_blocks(" not in src
    assert "Element format e4m3" in src and "Element format e5m2" in src
    assert '_mx_lhs_grad(ds_t, BLOCK_N, BLOCK_M, SCALE_BLOCK)' in src
    assert 'tl.dot_scaled(ds_data, ds_scale, "e5m2", q_data, q_scale, "e4m3", dk)' in src


def test_source_is_loaded_from_the_cache_dir(kernel_cache_dir: str) -> None:
    key = QuantizeKey("e4m3", "floor")
    module = quantize_module(key)
    src = quantize_kernel_source("e4m3", "floor")
    path = Path(module.__file__)
    assert path.parent == Path(kernel_cache_dir)
    assert path.name == f"mx_quantize_{source_digest(src)}.py"
    assert path.read_text() == src
    assert quantize_module(key) is module  # cached per (source, interpreter flag)
    # The same source decorated for real: JITFunctions, no GPU needed to create them.
    from triton.runtime.jit import JITFunction

    from mxcompile.triton_templates import rendered_sources

    assert rendered_sources()[f"mx_quantize: {key!r}"] == src
    jit_module = load_source(src, "mx_quantize", interpret=False)
    assert isinstance(jit_module.mx_quantize_kernel, JITFunction)
    assert not isinstance(module.mx_quantize_kernel, JITFunction)


def test_interpreter_works_when_triton_was_imported_first(tmp_path: Path) -> None:
    """The kernels avoid triton.language.standard's @jit helpers, so TRITON_INTERPRET may be set
    after triton (and torch._inductor) were imported without it."""
    script = textwrap.dedent(
        """
        import os
        os.environ.pop("TRITON_INTERPRET", None)
        import torch, triton, torch._inductor.config  # triton imported, no interpreter
        os.environ["TRITON_INTERPRET"] = "1"
        from mxcompile.numerics import E4M3, ScaleMode, quantize_along
        from mxcompile.triton_templates import mx_attention_triton, mx_mm_triton, quantize_mx_triton
        from mxcompile.triton_templates.attention import mx_attention_reference
        from mxcompile.triton_templates.mx_gemm import mx_mm_reference
        x = torch.randn(32, 64)
        d, s = quantize_mx_triton(x, -1)
        rd, rs = quantize_along(x, 1, E4M3, ScaleMode.RCEIL, 32)
        assert torch.equal(d.view(torch.uint8), rd.view(torch.uint8)) and torch.equal(s, rs)
        b, sb = quantize_along(torch.randn(64, 32), 0, E4M3, ScaleMode.RCEIL, 32)
        ops = ("gelu_tanh", "gelu_erf", "silu")
        for path in ("dot_scaled", "hopper"):
            c = mx_mm_triton(d, s, b, sb, 32, torch.float32, ops, path=path)
            ref = mx_mm_reference(d, s, b, sb, 32, torch.float32, ops)
            assert (c - ref).abs().max() <= 1e-5 * ref.abs().max()
        q, qs = quantize_along(torch.randn(1, 32, 32), 2, E4M3, ScaleMode.RCEIL, 32)
        v, vs = quantize_along(torch.randn(1, 32, 32), 1, E4M3, ScaleMode.RCEIL, 32)
        o = mx_attention_triton(q, qs, q, qs, v, vs, causal=True, out_dtype=torch.float32)
        ref = mx_attention_reference(q, qs, q, qs, v, vs, causal=True)
        assert (o - ref).abs().max() <= 1e-5
        from mxcompile.triton_templates import mx_attention_backward_triton
        from mxcompile.triton_templates.attention_backward import mx_attention_backward_reference
        x32 = [torch.randn(1, 32, 32) for _ in range(5)]
        lse = torch.logsumexp(x32[0] @ x32[1].mT, dim=-1)
        grads = mx_attention_backward_triton(*x32, lse, causal=True)
        refs = mx_attention_backward_reference(*x32, lse, causal=True)
        for g, r in zip(grads, refs):
            assert (g - r).abs().max() <= 1e-5 * r.abs().max()
        print("OK")
        """
    )
    env = {**os.environ, "MXCOMPILE_TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]

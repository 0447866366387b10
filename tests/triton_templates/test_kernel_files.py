"""The kernels are plain Triton files, imported once per mode (interpreter / compiled) by
`mxcompile.triton_templates.loader`; their specialisations are constexpr meta-parameters."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from triton.runtime.jit import JITFunction

import mxcompile.triton_templates as tt
from mxcompile.numerics import E4M3, ScaleMode, quantize_along
from mxcompile.triton_templates.attention import AttentionKey
from mxcompile.triton_templates.attention_backward import AttentionBackwardKey
from mxcompile.triton_templates.loader import KERNEL_MODULES, kernel_module
from mxcompile.triton_templates.mx_gemm import EPILOGUE_OPS, MXMMKey

KERNELS_DIR = Path(tt.__file__).with_name("kernels")
KERNELS = {
    "quantize": ["mx_quantize_kernel"],
    "mx_gemm": ["mx_mm_kernel"],
    "attention": ["mx_attention_fwd_kernel"],
    "attention_backward": [
        "mx_attention_bwd_preprocess_kernel",
        "mx_attention_bwd_dkdv_kernel",
        "mx_attention_bwd_dq_kernel",
    ],
}


@pytest.mark.parametrize("interpret", [True, False])
def test_each_mode_imports_the_package_files_once(interpret: bool) -> None:
    for module_name, kernel_names in KERNELS.items():
        module = kernel_module(module_name, interpret=interpret)
        assert Path(module.__file__) == KERNELS_DIR / f"{module_name}.py"  # no generated copy
        assert kernel_module(module_name, interpret=interpret) is module
        for name in kernel_names:
            kernel = getattr(module, name)
            # Compiled mode: JITFunctions (decorating one needs no GPU); interpreter mode not.
            assert isinstance(kernel, JITFunction) is (not interpret)
    # The two modes are separate imports: an interpreted kernel calls interpreted helpers only.
    helpers = {kernel_module("mx_tile", interpret=m).quantize_blocks for m in (True, False)}
    assert len(helpers) == 2


def test_loader_follows_triton_interpret_and_rejects_unknown_modules() -> None:
    assert kernel_module("quantize") is kernel_module("quantize", interpret=True)
    with pytest.raises(ValueError, match="no kernel module 'render'"):
        kernel_module("render")
    assert set(KERNELS) < set(KERNEL_MODULES)


def test_kernel_sources_listed_for_inspect_are_the_files() -> None:
    kernel_module("quantize", interpret=True)
    sources = tt.loaded_kernel_sources()
    assert set(sources) == set(KERNEL_MODULES)
    for name, source in sources.items():
        assert source == (KERNELS_DIR / f"{name}.py").read_text()


def test_no_kernel_source_is_rendered_or_holds_magic_literals() -> None:
    """Nothing is generated from templates, and the constants have names."""
    package = Path(tt.__file__).parent
    for path in [*package.glob("*.py"), *KERNELS_DIR.glob("*.py")]:
        text = path.read_text()
        assert "string.Template" not in text and "${" not in text, path
        assert "1.4426950408889634" not in text and "0.6931471805599453" not in text, path
    assert not (package / "render.py").exists()


def test_specialisations_are_validated() -> None:
    assert MXMMKey(epilogue=("residual", "silu")).meta()["EPILOGUE"] == "residual,silu"
    assert MXMMKey().meta()["EPILOGUE"] == ""
    for op in EPILOGUE_OPS:
        assert MXMMKey(epilogue=(op,)).meta()["EPILOGUE"] == op
    with pytest.raises(ValueError, match="not supported"):
        MXMMKey(epilogue=("relu",))
    with pytest.raises(ValueError, match="repeats"):
        MXMMKey(epilogue=("bias", "bias"))
    with pytest.raises(ValueError, match="cast='fast'"):
        MXMMKey(cast="fast")
    with pytest.raises(ValueError):
        AttentionKey(elem="e3m2")
    with pytest.raises(ValueError):
        AttentionBackwardKey(scale_mode="nearest")
    assert AttentionBackwardKey("e4m3", "e5m2").meta() == {
        "FWD_ELEM": "e4m3", "GRAD_ELEM": "e5m2", "SCALE_MODE": "rceil",
    }  # fmt: skip
    assert AttentionBackwardKey("e4m3", "e5m2").meta("dq") == {"GRAD_ELEM": "e5m2", "SCALE_MODE": "rceil"}


def test_epilogue_spec_is_read_at_specialisation() -> None:
    module = kernel_module("mx_gemm", interpret=True)
    assert module.epilogue_length("") == 0
    assert module.epilogue_length("bias,gelu_erf,residual") == 3
    assert module.epilogue_op("bias,gelu_erf,residual", 1) == "gelu_erf"


def test_format_constants_come_from_the_numerics_core() -> None:
    tile = kernel_module("mx_tile", interpret=True)
    assert tile.elem_max("e4m3") == E4M3.max_normal
    assert tile.elem_reciprocal_max("e4m3") == E4M3.reciprocal_max_fp32
    assert tile.elem_exponent_bias("e4m3") == 7 and tile.elem_exponent_bias("e5m2") == 15
    assert tile.elem_min_normal_exponent("e4m3") == -6
    assert tile.elem_dropped_bits("e5m2") == 21
    assert tile.even_rounding_increment("e4m3") == 1 << 19


def test_cast_is_checked_before_launch() -> None:
    x = torch.randn(32, 64)
    with pytest.raises(ValueError, match="cast='fast'"):
        tt.quantize_mx_triton(x, -1, cast="fast")
    d, s = tt.quantize_mx_triton(x, -1)
    rd, rs = quantize_along(x, 1, E4M3, ScaleMode.RCEIL, 32)
    assert torch.equal(d.view(torch.uint8), rd.view(torch.uint8)) and torch.equal(s, rs)


def test_interpreter_works_when_triton_was_imported_first() -> None:
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
        for path in ("dot_scaled", "expand_bf16", "fp8_per_block"):
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
        from mxcompile.triton_templates.attention_backward import quantize_backward_operands
        x32 = [torch.randn(1, 32, 32) for _ in range(5)]
        lse = torch.logsumexp(x32[0] @ x32[1].mT, dim=-1)
        def quantize(x, axis, elem):
            return quantize_along(x, axis % x.ndim, E4M3, ScaleMode.RCEIL, 32)
        operands = quantize_backward_operands(x32[0], x32[1], x32[2], x32[4], quantize, attention_mode="both",
                                              forward_elem="e4m3", grad_elem="e4m3")
        grads = mx_attention_backward_triton(operands, x32[3], x32[4], lse, causal=True)
        refs = mx_attention_backward_reference(*x32, lse, causal=True)
        for g, r in zip(grads, refs):
            assert (g - r).abs().max() <= 1e-5 * r.abs().max()
        print("OK")
        """
    )
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]

"""The Triton kernels compile for real GPU targets (to a cubin), with no GPU present.

The interpreter tests check numerics; these check that the same sources lower for Hopper
(sm90: FP8 wgmma, emulated dot_scaled) and Blackwell (sm100: native block-scaled MMA), through
the launchers' own argument lists (run on `meta` tensors, launches captured), specialised as a
real launch is (divisibility by 16, unit strides constant), which is what lets Triton pipeline
the GEMM's K loop."""

from __future__ import annotations

import pytest
import torch

from mxcompile.numerics import E4M3, ScaleMode
from mxcompile.triton_templates.aot import _Capture, _signature, compile_launch, pipeline_report, resource_usage
from mxcompile.triton_templates.attention import AttentionKey, attention_launch
from mxcompile.triton_templates.attention_backward import (
    AttentionBackwardKey,
    attention_backward_launch,
    empty_operands,
)
from mxcompile.triton_templates.mx_gemm import MXMMKey, mx_mm_launch
from mxcompile.triton_templates.quantize import quantize_launch

META = torch.device("meta")


@pytest.fixture(autouse=True)
def compiled_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning


def _empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=META)


def test_launch_specialisation_is_a_real_launchs() -> None:
    """Unit strides become constants and 16-divisible pointers and sizes get tt.divisibility,
    as `JITFunction.run` would give them; other integers stay plain."""
    x = _empty(4096, 4096, dtype=torch.bfloat16)
    x_t = _empty(4096, 4104, dtype=torch.bfloat16)[:, :4096]  # row stride 4104, not 16-divisible
    capture = _Capture()
    for t in (x, x_t):
        quantize_launch(
            t, rowwise=True, colwise=False, fmt=E4M3, scale_mode=ScaleMode.RCEIL, block_size=32,
            tiles={"BLOCK_M": 64, "BLOCK_N": 64}, interpret=False, wrap=capture,
        )  # fmt: skip
    signatures = []
    for kernel, args, kwargs in capture.launches:
        signature, constexprs, attrs = _signature(kernel, args, kwargs)
        names = list(kernel.arg_names)
        divisible = {names[i] for (i,), a in attrs.items() if a == [["tt.divisibility", 16]]}
        signatures.append((signature, constexprs, divisible))
    (sig, const, div), (sig_t, const_t, div_t) = signatures
    assert sig["x_ptr"] == "*i16" and sig["stride_xn"] == "constexpr" and const["stride_xn"] == 1
    assert {"x_ptr", "row_data_ptr", "M", "N", "stride_xm"} <= div
    assert sig_t["stride_xm"] == "i32" and "stride_xm" not in div_t and "M" in div_t
    assert const["ELEM"] == "e4m3" and const["SCALE_MODE"] == "rceil"


@pytest.mark.parametrize("cast", ["software", "hardware"])
def test_quantize_compiles_sm90(cast: str) -> None:
    x = _empty(4096, 4096, dtype=torch.bfloat16)
    (kernel,) = compile_launch(
        lambda wrap: quantize_launch(
            x,
            rowwise=True,
            colwise=True,
            fmt=E4M3,
            scale_mode=ScaleMode.RCEIL,
            block_size=32,
            cast=cast,
            tiles={"BLOCK_M": 64, "BLOCK_N": 64},
            interpret=False,
            wrap=wrap,
        ),  # fmt: skip
        90,
    )
    ptx = kernel.asm["ptx"]
    assert kernel.asm["cubin"]
    # The hardware cast is the saturating round-to-nearest-even conversion instruction.
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == (cast == "hardware")
    # A 64 x 64 tile quantized both ways fits in registers: nothing spills (130-148 registers).
    registers, stack_bytes = resource_usage(kernel)
    assert 0 < registers <= 255 and stack_bytes == 0, (registers, stack_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("capability,path", [(90, "fp8_per_block"), (90, "dot_scaled"), (100, "dot_scaled")])
def test_gemm_compiles(capability: int, path: str) -> None:
    m = n = k = 4096
    a, b = _empty(m, k, dtype=torch.float8_e4m3fn), _empty(k, n, dtype=torch.float8_e4m3fn)
    sa, sb = _empty(m, k // 32, dtype=torch.uint8), _empty(k // 32, n, dtype=torch.uint8)
    bias, mul = _empty(n, dtype=torch.float32), _empty(m, n, dtype=torch.bfloat16)
    key = MXMMKey(epilogue=("bias", "silu", "mul"))
    (kernel,) = compile_launch(
        lambda wrap: mx_mm_launch(
            a,
            sa,
            b,
            sb,
            block_size=32,
            out_dtype=torch.bfloat16,
            key=key,
            path=path,
            quantize_out=True,
            bias=bias,
            mul=mul,
            tiles={"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8},
            interpret=False,
            wrap=wrap,
        ),  # fmt: skip
        capability,
    )
    ptx = kernel.asm["ptx"]
    if capability == 90:
        assert "wgmma" in ptx  # Hopper tensor-core MMA, for both paths
    else:
        # Blackwell's block-scaled MMA: dot_scaled is native there, with its E8M0 scales (at
        # BLOCK_M 128 or more: with BLOCK_M 64 Triton upcasts to bf16, `tcgen05.mma ... kind::f16`).
        assert "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32" in ptx
    # The K loop is software-pipelined: async copies into 2 or 3 (num_stages) buffers.
    report = pipeline_report(kernel)
    assert report.pipelined and report.buffers >= 2 and report.async_copies > 0, report


@pytest.mark.slow  # ~10 s: the chosen config of the static comparison
def test_expand_bf16_gemm_sm90_is_pipelined_bf16_wgmma_without_spills() -> None:
    """The sm90 MX GEMM path, compiled with the config the static report chooses for it
    (benchmarks/results/kernel_static.json): every tensor-core instruction of its K loop is a
    bf16 wgmma with fp32 accumulation (SASS HGMMA ... F32.BF16), the loop copies the FP8 tiles
    asynchronously into multi-buffered shared memory, and no register spills."""
    from mxcompile.triton_templates.kernel_static import class_counts, main_loop, sass

    m = n = k = 4096
    a, b = _empty(m, k, dtype=torch.float8_e4m3fn), _empty(k, n, dtype=torch.float8_e4m3fn)
    sa, sb = _empty(m, k // 32, dtype=torch.uint8), _empty(k // 32, n, dtype=torch.uint8)
    (kernel,) = compile_launch(
        lambda wrap: mx_mm_launch(
            a, sa, b, sb, block_size=32, out_dtype=torch.bfloat16, key=MXMMKey(), path="expand_bf16",
            tiles={"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8}, interpret=False,
            wrap=wrap,
        ),  # fmt: skip
        90, num_warps=8, num_stages=3,
    )
    loop = main_loop(sass(kernel))
    mma = [op for op in loop if op.split(".", 1)[0].endswith("MMA")]
    assert mma and all(op.startswith("HGMMA.") and op.endswith(".F32.BF16") for op in mma), sorted(set(mma))
    assert class_counts(loop)["local"] == 0
    report = pipeline_report(kernel)
    assert report.pipelined and report.buffers >= 2 and report.async_copies > 0, report
    assert report.stack_bytes == 0, report


@pytest.mark.slow
def test_gemm_with_tma_compiles_sm100() -> None:
    """With USE_TMA the K loop copies A's and B's tiles with TMA (`cp.async.bulk.tensor`) into
    multi-buffered shared memory for sm100's block-scaled MMA; B is a linear layer's weight,
    the transpose of a row-major (N, K) tensor. Only the scales keep `cp.async`."""
    m = n = k = 4096
    a, b = _empty(m, k, dtype=torch.float8_e4m3fn), _empty(n, k, dtype=torch.float8_e4m3fn).t()
    sa, sb = _empty(m, k // 32, dtype=torch.uint8), _empty(k // 32, n, dtype=torch.uint8)
    (kernel,) = compile_launch(
        lambda wrap: mx_mm_launch(
            a, sa, b, sb, block_size=32, out_dtype=torch.bfloat16, key=MXMMKey(),
            path="dot_scaled", use_tma=True,
            tiles={"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8},
            interpret=False, wrap=wrap,
        ),  # fmt: skip
        100,
    )
    assert "tcgen05.mma" in kernel.asm["ptx"]
    report = pipeline_report(kernel)
    assert report.tma_copies > 0 and report.pipelined and report.buffers >= 2, report


@pytest.mark.slow
@pytest.mark.parametrize("capability", [90, 100])
def test_attention_compiles(capability: int) -> None:
    heads, s, d = 8, 1024, 64
    q = _empty(heads, s, d, dtype=torch.float8_e4m3fn)
    qs = _empty(heads, s, d // 32, dtype=torch.uint8)
    vs = _empty(heads, s // 32, d, dtype=torch.uint8)
    (kernel,) = compile_launch(
        lambda wrap: attention_launch(
            q,
            qs,
            q,
            qs,
            q,
            vs,
            key=AttentionKey(),
            sm_scale=0.125,
            causal=True,
            block_size=32,
            out_dtype=torch.bfloat16,
            tiles={"BLOCK_M": 64, "BLOCK_N": 64},
            interpret=False,
            wrap=wrap,
        ),  # fmt: skip
        capability,
    )
    assert kernel.asm["cubin"]


@pytest.mark.slow  # ~10 s per target: three kernels
@pytest.mark.parametrize("capability", [90, 100])
def test_attention_backward_compiles(capability: int) -> None:
    heads, s, d = 8, 1024, 32
    x = _empty(heads, s, d, dtype=torch.bfloat16)
    lse = _empty(heads, s, dtype=torch.float32)
    operands = empty_operands(heads, s, s, d, device=torch.device("meta"))
    kernels = compile_launch(
        lambda wrap: attention_backward_launch(
            operands, x, x, lse,
            key=AttentionBackwardKey(grad_elem="e5m2"), sm_scale=0.125, causal=True, mx_qk=True,
            mx_pv=True, block_size=32, tiles={"BLOCK_M": 32, "BLOCK_N": 32}, interpret=False,
            wrap=wrap,
        ),  # fmt: skip
        capability,
    )
    assert len(kernels) == 3 and all(k.asm["cubin"] for k in kernels)

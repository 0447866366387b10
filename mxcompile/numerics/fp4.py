"""Reference MXFP4 and NVFP4 quantization, dequantization and fake quantization in pure PyTorch.

MXFP4 (OCP MX v1.0): E2M1 elements in blocks of 32 along an axis, one E8M0 scale per block,
derived from the block's amax by a `ScaleMode` exactly as for MXFP8 (`scales.py`, with E2M1's
emax = 2 and max = 6). A block holding a NaN or an Inf gets the NaN scale 0xFF and elements +0.

NVFP4 (NVIDIA): E2M1 elements in blocks of 16, one E4M3 scale per block and one fp32 scale per
tensor. The order of fp32 operations is Transformer Engine's reference quantizer
(`transformer_engine/pytorch/custom_recipes/quantization_ref_nvfp4.py`,
`NVFP4QuantizerRef._quantize_blockwise_reference`, the default path without 4over6), which is
the recipe of NVIDIA's paper ("Pretraining Large Language Models with NVFP4", 2025, appendix),
with the kernel's fold of 1/6 into the tensor multiplier. Each line is one rounded fp32 op:

    A       = amax(|x|) over the whole tensor                       (exact)
    S_enc   = min(2688 / A, FLT_MAX)        2688 = 448 * 6; A = 0 gives FLT_MAX
    S_dec   = 1 / S_enc
    m       = S_enc * fp32(1/6)
    d_b     = min(a_b * m, 448)             a_b: the block's amax (16x16 tile's with block_2d)
    s_b     = E4M3(d_b)                     round to nearest even; below 2**-10 it is 0
    e_b     = min(1 / (s_b * S_dec), FLT_MAX)     s_b = 0 gives FLT_MAX
    q       = E2M1(clamp(x * e_b, -6, 6))   nearest even, or stochastic
    x_hat   = (q * s_b) * S_dec             q * s_b is exact: one rounding

Where we differ from TE: a tensor holding a NaN or an Inf gets S_enc = S_dec = NaN (TE maps an
Inf amax to S_enc = 1), so every block scale is the E4M3 NaN and every element +0: the tensor
dequantizes to NaN, as MXFP8 and MXFP4 dequantize a non-finite block to NaN. torchao's
`nvfp4_quantize` (0.18) orders the ops differently (S_dec = A / 2688 first, the block scale
(a_b / 6) / S_dec, and a floor of 2**-6 on it) and gives other bits.

Packed data: two E2M1 codes per byte along the quantization axis, the element with the even
index in the low nibble (`e2m1.pack_e2m1`), as torch.float4_e2m1fn_x2 and Triton's
`tl.dot_scaled` "e2m1" expect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .e2m1 import Rounding, decode_e2m1, encode_e2m1, pack_e2m1, round_e2m1, rounding_named, unpack_e2m1
from .formats import (
    DEFAULT_BLOCK_SIZE,
    E2M1,
    E4M3,
    MXFP4,
    NVFP4,
    NVFP4_BLOCK_SIZE,
    BlockFormat,
    ScaleFormat,
    ScaleMode,
    scale_mode_named,
)
from .quantize import blocks_and_scales, check_quantizable, fake_quantize_along, split_blocks
from .rounding import round_to_element
from .scales import (
    bytes_from_e8m0,
    e8m0_from_bytes,
    inverse_scale_fp32_from_bytes,
    scale_bytes_from_amax,
    scale_fp32_from_bytes,
)

F32_MAX = torch.finfo(torch.float32).max
# S_enc's numerator: the tensor's amax maps to the largest E4M3 block scale times the largest
# element, so block scales use E4M3's whole range (exact in fp32: 2688 = 21 * 2**7).
NVFP4_TENSOR_SCALE_NUMERATOR = E4M3.max_normal * E2M1.max_normal


@dataclass(frozen=True)
class FP4Tensor:
    """A tensor in MXFP4 or NVFP4.

    data:  uint8, two E2M1 codes per byte packed along `axis` (that axis halved).
    scale: one scale per block of `format.block_size` elements along `axis` (the logical shape
           with `axis` divided by the block size): torch.float8_e8m0fnu for MXFP4,
           torch.float8_e4m3fn for NVFP4. With `block_2d`, the 16 row blocks of a 16x16 tile
           hold the same scale.
    tensor_scale: NVFP4's fp32 decode scale S_dec (0-d); None for MXFP4.
    axis:  the (non-negative) quantization axis, the contraction axis of a GEMM.
    scale_mode: MXFP4's E8M0 rule; None for NVFP4.
    """

    data: torch.Tensor
    scale: torch.Tensor
    tensor_scale: torch.Tensor | None
    axis: int
    format: BlockFormat
    scale_mode: ScaleMode | None
    block_2d: bool
    orig_dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        shape = list(self.data.shape)
        shape[self.axis] *= E2M1.elements_per_byte
        return torch.Size(shape)

    @property
    def codes(self) -> torch.Tensor:
        """The E2M1 codes, one per uint8, in the logical shape."""
        return unpack_e2m1(self.data, self.axis)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp4(self, dtype)


def _check_rounding(rounding: str | Rounding, uniform: torch.Tensor | None, x: torch.Tensor) -> Rounding:
    rounding = rounding_named(rounding)
    if rounding is Rounding.STOCHASTIC and uniform is not None and uniform.shape != x.shape:
        raise ValueError(f"uniform has shape {tuple(uniform.shape)}; it must match x's {tuple(x.shape)}")
    return rounding


def _blocked(t: torch.Tensor | None, axis: int, block_size: int) -> torch.Tensor | None:
    return None if t is None else split_blocks(t, axis, block_size)


# ---------------------------------------------------------------------------------------------
# MXFP4


def _mxfp4_values(
    x: torch.Tensor, axis: int, scale_mode: ScaleMode, block_size: int, rounding: Rounding,
    uniform: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 grid values in fp32, split in blocks along axis; E8M0 scale bytes as int32)."""
    blocks = split_blocks(x, axis, block_size).to(torch.float32)
    amax = blocks.abs().amax(dim=axis + 1, keepdim=True)
    scale_bytes = scale_bytes_from_amax(amax, E2M1, scale_mode)
    # A NaN scale (0xFF) has a NaN inverse: the block's values become NaN, their codes +0.
    scaled = blocks * inverse_scale_fp32_from_bytes(scale_bytes)
    return round_e2m1(scaled, rounding, _blocked(uniform, axis, block_size)), scale_bytes


def quantize_mxfp4(
    x: torch.Tensor,
    axis: int = -1,
    *,
    scale_mode: str | ScaleMode = ScaleMode.RCEIL,
    block_size: int = DEFAULT_BLOCK_SIZE,
    rounding: str | Rounding = Rounding.NEAREST,
    uniform: torch.Tensor | None = None,
) -> FP4Tensor:
    """Quantize `x` to MXFP4 along `axis`: blocks of `block_size` share one E8M0 scale
    (`scale_mode`, as in MXFP8), elements are E2M1 rounded by `rounding` (stochastic rounding
    takes `uniform`, draws in [0, 1) of x's shape: `e2m1.uniform_noise`)."""
    scale_mode = scale_mode_named(scale_mode)
    axis = check_quantizable(x, axis, block_size)
    rounding = _check_rounding(rounding, uniform, x)
    values, scale_bytes = _mxfp4_values(x, axis, scale_mode, block_size, rounding, uniform)
    codes = encode_e2m1(values.reshape(x.shape))
    fmt = MXFP4 if block_size == MXFP4.block_size else BlockFormat(
        f"{MXFP4.name}_block{block_size}", E2M1, block_size, ScaleFormat.E8M0, tensor_scale=False
    )
    return FP4Tensor(
        data=pack_e2m1(codes, axis),
        scale=e8m0_from_bytes(scale_bytes.to(torch.uint8).squeeze(axis + 1)),
        tensor_scale=None,
        axis=axis,
        format=fmt,
        scale_mode=scale_mode,
        block_2d=False,
        orig_dtype=x.dtype,
    )


def fake_quantize_mxfp4_along(
    x: torch.Tensor,
    axis: int,
    scale_mode: ScaleMode,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    rounding: Rounding = Rounding.NEAREST,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """dequantize(quantize_mxfp4(x, ...)) in fp32, bit for bit, for a (non-negative) `axis`.

    Round to nearest is the MXFP8 function with the E2M1 row (`fake_quantize_along`: fp32
    arithmetic only, scales in the bitcast-free form); stochastic rounding swaps in
    `e2m1.round_e2m1_stochastic` on the same scaled blocks."""
    rounding = rounding_named(rounding)
    if rounding is Rounding.NEAREST:
        if uniform is not None:
            raise ValueError("uniform is given but rounding='nearest' uses no noise")
        return fake_quantize_along(x, axis, E2M1, scale_mode, block_size)
    blocks, _amax, scale, inverse = blocks_and_scales(x, axis, E2M1, scale_mode, block_size)
    values = round_e2m1(blocks * inverse, rounding, _blocked(uniform, axis, block_size))
    return (values * scale).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# NVFP4


def nvfp4_tensor_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_enc, S_dec) in fp32 from the tensor's amax (fp32, >= 0): S_enc = min(2688 / A,
    FLT_MAX), S_dec = 1 / S_enc; NaN for a non-finite amax. A true division (torch's
    `number / tensor` is reciprocal-then-multiply, two roundings)."""
    amax = amax.to(torch.float32)
    encode = torch.div(torch.full_like(amax, NVFP4_TENSOR_SCALE_NUMERATOR), amax).clamp(max=F32_MAX)
    encode = torch.where(torch.isfinite(amax), encode, float("nan"))
    return encode, torch.div(torch.ones_like(encode), encode)


def nvfp4_block_scales(
    block_amax: torch.Tensor, tensor_encode: torch.Tensor, tensor_decode: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s_b, e_b): each block's E4M3 scale (fp32 values on the E4M3 grid) and its fp32 encode
    multiplier, from the block amax and the tensor's (S_enc, S_dec), in the module's op order.

    TE also takes min(., FLT_MAX) of a_b * m before clamping to +-448: a_b * m >= 0, so the
    clamp alone gives the same value for every input (Inf -> 448, NaN stays NaN)."""
    multiplier = tensor_encode * E2M1.reciprocal_max_fp32
    decode = (block_amax.to(torch.float32) * multiplier).clamp(max=E4M3.max_normal)
    # The positive NaN for a NaN tensor scale (round_to_element keeps the operand's NaN sign),
    # so that the E4M3 scale byte is 0x7F.
    scale = torch.where(decode.isnan(), float("nan"), round_to_element(decode, E4M3))
    encode = torch.div(torch.ones_like(scale), scale * tensor_decode).clamp(max=F32_MAX)
    return scale, encode


def _tile_amax(x: torch.Tensor, tile: int) -> torch.Tensor:
    """Each element of 2-D fp32 x replaced by the amax of its tile x tile block."""
    rows, cols = x.shape
    tiles = x.abs().reshape(rows // tile, tile, cols // tile, tile).amax(dim=(1, 3), keepdim=True)
    return tiles.expand(rows // tile, tile, cols // tile, tile).reshape(rows, cols)


def _check_block_2d(x: torch.Tensor, block_2d: bool) -> None:
    if not isinstance(block_2d, bool):
        raise ValueError(f"block_2d={block_2d!r} must be a bool")
    if block_2d and (x.ndim != 2 or x.shape[0] % NVFP4_BLOCK_SIZE or x.shape[1] % NVFP4_BLOCK_SIZE):
        raise ValueError(
            f"block_2d=True needs a 2-D tensor whose sides are multiples of {NVFP4_BLOCK_SIZE}; "
            f"x has shape {tuple(x.shape)}"
        )


def _nvfp4_values(
    x: torch.Tensor, axis: int, block_2d: bool, rounding: Rounding, uniform: torch.Tensor | None,
    tensor_amax: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E2M1 grid values in fp32 split in blocks along axis, E4M3 block scales as fp32 values
    (keepdim), S_dec)."""
    x32 = x.to(torch.float32)
    amax = x32.abs().amax() if tensor_amax is None else tensor_amax.to(torch.float32)
    tensor_encode, tensor_decode = nvfp4_tensor_scales(amax)
    blocks = split_blocks(x32, axis, NVFP4_BLOCK_SIZE)
    source = _tile_amax(x32, NVFP4_BLOCK_SIZE) if block_2d else x32.abs()
    block_amax = split_blocks(source, axis, NVFP4_BLOCK_SIZE).amax(dim=axis + 1, keepdim=True)
    scale, encode = nvfp4_block_scales(block_amax, tensor_encode, tensor_decode)
    values = round_e2m1(blocks * encode, rounding, _blocked(uniform, axis, NVFP4_BLOCK_SIZE))
    return values, scale, tensor_decode


def quantize_nvfp4(
    x: torch.Tensor,
    axis: int = -1,
    *,
    block_2d: bool = False,
    rounding: str | Rounding = Rounding.NEAREST,
    uniform: torch.Tensor | None = None,
    tensor_amax: torch.Tensor | None = None,
) -> FP4Tensor:
    """Quantize `x` to NVFP4 along `axis` in the module's op order: blocks of 16 with E4M3
    scales, one fp32 tensor scale from `tensor_amax` (default: amax(|x|)).

    block_2d: 2-D x only; each block's amax is that of its 16x16 tile, so W and W.T quantize to
    the same values along either axis. rounding / uniform: as in `quantize_mxfp4`."""
    axis = check_quantizable(x, axis, NVFP4_BLOCK_SIZE)
    _check_block_2d(x, block_2d)
    rounding = _check_rounding(rounding, uniform, x)
    values, scale, tensor_decode = _nvfp4_values(x, axis, block_2d, rounding, uniform, tensor_amax)
    return FP4Tensor(
        data=pack_e2m1(encode_e2m1(values.reshape(x.shape)), axis),
        scale=scale.squeeze(axis + 1).to(torch.float8_e4m3fn),
        tensor_scale=tensor_decode,
        axis=axis,
        format=NVFP4,
        scale_mode=None,
        block_2d=block_2d,
        orig_dtype=x.dtype,
    )


def fake_quantize_nvfp4_along(
    x: torch.Tensor,
    axis: int,
    *,
    block_2d: bool = False,
    rounding: Rounding = Rounding.NEAREST,
    uniform: torch.Tensor | None = None,
    tensor_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """dequantize(quantize_nvfp4(x, ...)) in fp32, bit for bit, for a (non-negative) `axis`:
    (q * s_b) * S_dec, with fp32 arithmetic only."""
    values, scale, tensor_decode = _nvfp4_values(
        x, axis, block_2d, rounding_named(rounding), uniform, tensor_amax
    )
    return ((values * scale) * tensor_decode).reshape(x.shape)


def nvfp4_block_values(
    x: torch.Tensor,
    axis: int,
    *,
    block_2d: bool = False,
    rounding: Rounding = Rounding.NEAREST,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q * s_b in fp32, exact, of x's shape; S_dec, 0-d fp32): NVFP4 split at the tensor scale,
    as a block-scaled GEMM takes it (the tensor scales applied to its fp32 output). Along a
    (non-negative) `axis`, in the module's op order; `fake_quantize_nvfp4_along` is
    (q * s_b) * S_dec."""
    values, scale, tensor_decode = _nvfp4_values(x, axis, block_2d, rounding_named(rounding), uniform, None)
    return (values * scale).reshape(x.shape), tensor_decode


# ---------------------------------------------------------------------------------------------
# Both


def dequantize_fp4(t: FP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values an FP4Tensor represents, as `dtype`: MXFP4 q * 2**(b - 127) (exact in fp32),
    NVFP4 (q * s_b) * S_dec (one rounding). Blocks with a NaN scale are NaN."""
    if not isinstance(t, FP4Tensor):
        raise ValueError(f"t must be an FP4Tensor, got {type(t).__name__}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not a floating-point dtype")
    block_size = t.format.block_size
    values = split_blocks(decode_e2m1(t.codes), t.axis, block_size)
    if t.format.scale_format is ScaleFormat.E8M0:
        scale = scale_fp32_from_bytes(bytes_from_e8m0(t.scale))
        out = values * scale.unsqueeze(t.axis + 1)
    else:
        out = (values * t.scale.to(torch.float32).unsqueeze(t.axis + 1)) * t.tensor_scale
    return out.reshape(t.shape).to(dtype)


def fake_quantize_fp4_along(
    x: torch.Tensor,
    axis: int,
    fmt: BlockFormat,
    *,
    scale_mode: ScaleMode = ScaleMode.RCEIL,
    block_2d: bool = False,
    rounding: Rounding = Rounding.NEAREST,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fake quantizer of an FP4 block format row (MXFP4 or NVFP4), for an eager emulation
    that picks the format per operand: `scale_mode` applies to MXFP4, `block_2d` to NVFP4."""
    if fmt.elem is not E2M1:
        raise ValueError(f"fmt={fmt.name!r} is not an FP4 format; accepted: {[MXFP4.name, NVFP4.name]}")
    if fmt.scale_format is ScaleFormat.E8M0:
        if block_2d:
            raise ValueError("block_2d=True applies to NVFP4 only")
        return fake_quantize_mxfp4_along(
            x, axis, scale_mode, fmt.block_size, rounding=rounding, uniform=uniform
        )
    return fake_quantize_nvfp4_along(x, axis, block_2d=block_2d, rounding=rounding, uniform=uniform)


__all__ = [
    "F32_MAX",
    "FP4Tensor",
    "NVFP4_TENSOR_SCALE_NUMERATOR",
    "dequantize_fp4",
    "fake_quantize_fp4_along",
    "fake_quantize_mxfp4_along",
    "fake_quantize_nvfp4_along",
    "nvfp4_block_scales",
    "nvfp4_block_values",
    "nvfp4_tensor_scales",
    "quantize_mxfp4",
    "quantize_nvfp4",
]

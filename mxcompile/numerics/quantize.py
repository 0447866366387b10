"""Reference MX quantization, dequantization and GEMM in pure PyTorch: the one definition of
mxcompile's numerics. The custom ops, the graph passes and the Triton kernels all defer to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .formats import (
    DEFAULT_BLOCK_SIZE,
    E8M0_NAN,
    SUPPORTED_INPUT_DTYPES,
    ElemFormat,
    ScaleMode,
    check_block_size,
    elem_format,
    scale_mode_named,
)
from .rounding import fake_quantize_blocks
from .scales import (
    bytes_from_e8m0,
    e8m0_from_bytes,
    identity,
    inverse_scale_fp32_from_bytes,
    scale_bytes_from_amax,
    scale_fp32_from_amax,
    scale_fp32_from_bytes,
)


@dataclass(frozen=True)
class MXTensor:
    """A tensor in MX format.

    data:  fp8 tensor of the original shape.
    scale: torch.float8_e8m0fnu tensor of the original shape with `axis` divided by block_size;
           scale[..., i, ...] is shared by data[..., i*block_size:(i+1)*block_size, ...] along axis.
    axis:  the (non-negative) quantization axis, which is the contraction axis of a GEMM.
    """

    data: torch.Tensor
    scale: torch.Tensor
    axis: int
    elem: str
    block_size: int
    scale_mode: str
    orig_dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def scale_bytes(self) -> torch.Tensor:
        """The scales as uint8 biased exponents (the form used inside compiled graphs)."""
        return bytes_from_e8m0(self.scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mx(self, dtype)


def normalize_axis(axis: int, ndim: int, *, argument: str = "axis") -> int:
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(
            f"{argument}={axis!r} is out of range for a tensor of {ndim} dimensions; "
            f"accepted: an int in [{-ndim}, {ndim - 1}]"
        )
    return axis % ndim


def check_quantizable(x: torch.Tensor, axis: int, block_size: int) -> int:
    """Validate a quantize call's tensor, axis and block size; return the non-negative axis."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_INPUT_DTYPES:
        raise ValueError(
            f"x has dtype {x.dtype}; MX quantization accepts {list(SUPPORTED_INPUT_DTYPES)}"
        )
    if x.ndim == 0:
        raise ValueError("x is a 0-d tensor; MX quantization needs at least one dimension")
    check_block_size(block_size)
    axis = normalize_axis(axis, x.ndim)
    if x.shape[axis] % block_size:
        raise ValueError(
            f"x.shape[{axis}]={x.shape[axis]} (the quantization axis) is not divisible by "
            f"block_size={block_size}; pad that axis to a multiple of {block_size} or choose "
            f"another axis"
        )
    return axis


def scales_shape(shape: Sequence[int], axis: int, block_size: int) -> list[int]:
    """The shape of the scales of a tensor of this shape quantized along `axis` (non-negative):
    one per block, the axis divided by block_size."""
    blocked = list(shape)
    blocked[axis] //= block_size
    return blocked


def split_blocks(x: torch.Tensor, axis: int, block_size: int) -> torch.Tensor:
    """x with `axis` (non-negative) split in place into (n / block_size, block_size).

    The block dimension stays where it is rather than being moved last: nothing is transposed,
    so the memory order is kept and Inductor vectorizes along the contiguous dimension for
    every axis (for axis 0 a vertical reduction across columns).
    """
    shape = x.shape
    return x.reshape(*shape[:axis], shape[axis] // block_size, block_size, *shape[axis + 1 :])


def _quantize_blocks(
    x: torch.Tensor, axis: int, fmt: ElemFormat, scale_mode: ScaleMode, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize blocks of `block_size` consecutive elements along `axis` (non-negative).

    The block's amax is reduced over the inner dimension of `split_blocks`; the outputs come
    out contiguous in x's axis order.
    """
    shape = x.shape
    blocks = split_blocks(x, axis, block_size).to(torch.float32)
    amax = blocks.abs().amax(dim=axis + 1, keepdim=True)
    scale_bytes = scale_bytes_from_amax(amax, fmt, scale_mode)
    scaled = blocks * inverse_scale_fp32_from_bytes(scale_bytes)
    # Clamp before the cast: the cast is round-to-nearest-even, the clamp makes it saturating.
    scaled = scaled.clamp(-fmt.max_normal, fmt.max_normal)
    # Every element of a NaN block is the positive NaN (the arithmetic may have produced a NaN
    # with the sign bit set). Chosen in fp32 rather than on the fp8 bytes: a uint8 view and a
    # `where` on it cost Inductor an extra pass over the data; casting +NaN gives the NaN byte
    # 0x7F (fmt.nan_byte) for both e4m3 and e5m2, in eager and in Inductor's vectorized cast.
    scaled = torch.where(scale_bytes == E8M0_NAN, float("nan"), scaled)
    data = scaled.to(fmt.dtype).reshape(shape)
    if axis == x.ndim - 1:
        # Inductor (CPU) codegen hint, value-preserving (bytes are 0..255): Inductor does not
        # vectorize int16, so the loop that writes the scales stays a plain loop over blocks,
        # like the amax reduction and the data loop. Only then does it fuse the three into one
        # loop over blocks ("outer loop fusion"), which reads x once instead of twice; with a
        # uint8-only chain the scale loop is vectorized across blocks, the loop nests differ and
        # x is read in two passes. (Along other axes the scale loop is flattened differently and
        # cannot join the others either way.)
        scale_bytes = scale_bytes.to(torch.int16)
    return data, scale_bytes.to(torch.uint8).squeeze(axis + 1)


def quantize_along(
    x: torch.Tensor, axis: int, fmt: ElemFormat, scale_mode: ScaleMode, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along any (non-negative) axis; outputs keep x's axis order (and are contiguous
    for a contiguous x)."""
    return _quantize_blocks(x, axis, fmt, scale_mode, block_size)


def dequantize_along(
    data: torch.Tensor,
    scale_bytes: torch.Tensor,
    axis: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    materialize: Callable[[torch.Tensor], torch.Tensor] = identity,
) -> torch.Tensor:
    """data * 2**(scale - 127) broadcast over blocks of `block_size` along `axis`, cast to dtype.

    `materialize` is applied to the fp32 block scales (identity by default): the Inductor form
    stores them once per block, so that the int-to-float bitcast of `scale_fp32_from_bytes`,
    which Inductor's CPU code runs element by element, is not repeated for every element."""
    blocks = split_blocks(data, axis, block_size).to(torch.float32)
    scale = materialize(scale_fp32_from_bytes(scale_bytes)).unsqueeze(axis + 1)
    return (blocks * scale).reshape(data.shape).to(dtype)


def blocks_and_scales(
    x: torch.Tensor,
    axis: int,
    fmt: ElemFormat,
    scale_mode: ScaleMode,
    block_size: int,
    *,
    materialize: Callable[[torch.Tensor], torch.Tensor] = identity,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x split into fp32 blocks along `axis` (non-negative; `split_blocks`), the blocks' amax,
    and their fp32 scales and inverse scales in the bitcast-free form (`scale_fp32_from_amax`,
    which vectorizes). `materialize` is applied to the scale and its reused intermediates
    (see `scale_fp32_from_amax`)."""
    blocks = split_blocks(x, axis, block_size).to(torch.float32)
    amax = blocks.abs().amax(dim=axis + 1, keepdim=True)
    scale = materialize(scale_fp32_from_amax(amax, fmt, scale_mode, materialize=materialize))
    # 1 / 2**k is exact for every E8M0 scale (2**-127 .. 2**127); NaN stays NaN.
    return blocks, amax, scale, 1.0 / scale


def fake_quantize_along(
    x: torch.Tensor,
    axis: int,
    fmt: ElemFormat,
    scale_mode: ScaleMode,
    block_size: int,
    *,
    materialize: Callable[[torch.Tensor], torch.Tensor] = identity,
) -> torch.Tensor:
    """dequantize_along(*quantize_along(x, ...)) in fp32, bit for bit, computed with fp32
    arithmetic only (`rounding.fake_quantize_blocks`): no fp8 tensor, so no fp32<->fp8
    conversion, which ATen and Inductor run element by element on CPUs without AVX512."""
    blocks, _amax, scale, inverse = blocks_and_scales(x, axis, fmt, scale_mode, block_size, materialize=materialize)
    return fake_quantize_blocks(blocks, scale, inverse, fmt).reshape(x.shape)


def quantize_mx(
    x: torch.Tensor,
    axis: int = -1,
    *,
    elem: str = "e4m3",
    scale_mode: str = "rceil",
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> MXTensor:
    """Quantize `x` to MX: blocks of `block_size` consecutive elements along `axis` share one
    E8M0 scale; elements are FP8 (`elem`: "e4m3" or "e5m2").

    The input is never modified. See `ScaleMode` for the four scale rules.
    """
    fmt = elem_format(elem)
    scale_mode = scale_mode_named(scale_mode)
    axis = check_quantizable(x, axis, block_size)
    data, scale_bytes = quantize_along(x, axis, fmt, scale_mode, block_size)
    return MXTensor(
        data=data,
        scale=e8m0_from_bytes(scale_bytes),
        axis=axis,
        elem=fmt.name,
        block_size=block_size,
        scale_mode=scale_mode.value,
        orig_dtype=x.dtype,
    )



def dequantize_mx(mx: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values an MXTensor represents, as `dtype`. Exact in fp32; blocks with scale 0xFF are NaN."""
    check_dequantizable(mx, dtype)
    return dequantize_along(mx.data, mx.scale_bytes, mx.axis, mx.block_size, dtype)


def mx_matmul(a: MXTensor, b: MXTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The exact MX GEMM a @ b: products of the dequantized operands accumulated in fp32.

    a has shape (..., M, K) quantized along K (its last axis); b has shape (..., K, N) quantized
    along K (its second-to-last axis). Leading (batch) dimensions broadcast as in torch.matmul.
    """
    check_mx_matmul_operands(a, b)
    product = torch.matmul(dequantize_mx(a, torch.float32), dequantize_mx(b, torch.float32))
    return product.to(out_dtype)


def check_dequantizable(mx: MXTensor, dtype: torch.dtype) -> None:
    """Validate a dequantize call's MXTensor and output dtype."""
    if not isinstance(mx, MXTensor):
        raise ValueError(f"mx must be an MXTensor, got {type(mx).__name__}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not a floating-point dtype")


def check_mx_matmul_operands(a: MXTensor, b: MXTensor) -> None:
    """Validate the operands of the MX GEMM a @ b (see `mx_matmul`)."""
    for name, operand, wanted in (("a", a, -1), ("b", b, -2)):
        if not isinstance(operand, MXTensor):
            raise ValueError(f"{name} must be an MXTensor, got {type(operand).__name__}")
        if operand.data.ndim < 2:
            raise ValueError(f"{name} has {operand.data.ndim} dimension(s); mx_matmul needs >= 2")
        if operand.axis != operand.data.ndim + wanted:
            raise ValueError(
                f"{name} is quantized along axis {operand.axis} but its contraction axis is "
                f"{operand.data.ndim + wanted}; quantize {name} with axis={wanted}"
            )
    if a.block_size != b.block_size:
        raise ValueError(
            f"a.block_size={a.block_size} and b.block_size={b.block_size} differ; "
            "quantize both operands with the same block_size"
        )
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"contraction lengths differ: a {tuple(a.shape)} and b {tuple(b.shape)}")

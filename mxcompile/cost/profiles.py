"""Device profiles: peak compute per dtype, memory bandwidth, host-link bandwidth.

The GPU profiles carry NVIDIA's published datasheet numbers (dense, i.e. without 2:4
sparsity: the datasheets print tensor-core figures *with* sparsity and say in a footnote that
dense is half). Every number has a source string. They were checked against reproductions of
the datasheet tables found by a documentation search, not against the PDFs themselves, and
datasheet revisions change (B200 memory bandwidth was announced as 8 TB/s, the HGX B200
table lists 7.7 TB/s): verify before relying on a single figure.

``host_link_bandwidth`` is one direction of the host link (PCIe Gen5 x16: the datasheets print
128 GB/s, both directions together). Achieved pinned-memory copies are typically 80-90 % of it.

``op_rates`` holds the measured throughput of the MX ops that run far below the roofline on a
device; the datasheet GPU profiles have none (their Triton kernels are priced by the roofline).

Nothing here measures: a CPU's profile is measured by :mod:`mxcompile.calibration`, which
builds a :class:`DeviceProfile` from timings; the cost model only prices with one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

REQUIRED_DTYPES = ("fp32", "bf16", "fp8")
QUANTIZE_RATE = "quantize"  # op_rates key: elements of input per second of mxcompile::quantize
ATTENTION_RATE = "attention"  # op_rates key: FLOP/s of mxcompile::attention (graph_costs.attention_flops)
# op_rates key: passes per second of the MX attention ops' torch implementation, one pass being
# one key tile of one batch chunk (graph_costs.attention_passes): each pass runs a fixed list of
# eager ops whatever the chunk, so one-element chunks cost time beyond their FLOPs.
ATTENTION_PASS_RATE = "attention_pass"
# op_rates key: elements/s of an MX GEMM operand's dequantize in the op's torch reference
# (numerics.dequantize_along, op by op), which every mxcompile::mx_mm runs on CPU under the eager
# lowering: about 1 ms for a 1024 x 256 fp8 operand on the 2-core host, where the fp32 GEMM of two
# such operands takes 2-3 ms.
DEQUANTIZE_RATE = "dequantize"
# op_rates keys of the FP4 ops (issue 48): input elements/s of mxcompile::quantize_fp4 (NVFP4,
# round to nearest, 1-D blocks; its torch reference on every device), and operand elements/s of
# mxcompile::dequantize_fp4 to fp32, which every FP4 GEMM of a CPU graph runs on both operands
# (`lowering.lower_fp4_gemms`; CUDA graphs keep mxcompile::mx_mm_fp4, the Triton FP4 GEMM). On the 2-core AVX512 host
# (2026-12-07, one thread, CPU time) the quantize took 35-47 ns per element, about 100x the
# roofline of its bytes and 80x the MX quantize's native kernel; the dequantize 4-8 ns.
QUANTIZE_FP4_RATE = "quantize_fp4"
DEQUANTIZE_FP4_RATE = "dequantize_fp4"
OP_RATE_KEYS = (QUANTIZE_RATE, ATTENTION_RATE, ATTENTION_PASS_RATE, DEQUANTIZE_RATE, QUANTIZE_FP4_RATE,
                DEQUANTIZE_FP4_RATE)

TERA = 1e12
PETA = 1e15
GB = 1e9  # datasheets use decimal units
TB = 1e12
SPARSITY_FACTOR = 2.0  # datasheet tensor-core figures with 2:4 sparsity are twice the dense ones
PCIE_GEN5_X16_BOTH_DIRECTIONS = 128 * GB
DIRECTIONS = 2

FP32_BYTES = 4


@dataclass(frozen=True)
class DeviceProfile:
    """Peak numbers of one device.

    Attributes:
        name: e.g. "H100 SXM".
        peak_flops: dtype -> dense FLOP/s; must contain "fp32", "bf16" and "fp8".
        memory_bandwidth: device-memory bytes/s.
        host_link_bandwidth: device<->host bytes/s, one direction.
        sources: where each number comes from; keys "peak_flops.<dtype>", "memory_bandwidth",
            "host_link_bandwidth", "op_rates.<op>", one per number.
        op_rates: measured throughput of MX ops that run below the roofline on this device
            (keys :data:`OP_RATE_KEYS`: "quantize" in input elements/s, "attention" in FLOP/s,
            "attention_pass" in passes/s, "dequantize" in operand elements/s, "quantize_fp4"
            in input elements/s, "dequantize_fp4" in operand elements/s);
            empty: price them by the roofline.
        native_fp8_gemm: whether the device multiplies FP8 in hardware. Without (CPUs), an MX
            GEMM runs as a GEMM of its dequantized operands, at their dtype's rate.
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    host_link_bandwidth: float
    sources: Mapping[str, str]
    op_rates: Mapping[str, float] = field(default_factory=dict)
    native_fp8_gemm: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"DeviceProfile.name={self.name!r}: give a non-empty str")
        if not isinstance(self.peak_flops, Mapping):
            raise ValueError(f"DeviceProfile.peak_flops={self.peak_flops!r}: give a mapping dtype -> FLOP/s")
        missing = [d for d in REQUIRED_DTYPES if d not in self.peak_flops]
        if missing:
            raise ValueError(
                f"DeviceProfile {self.name!r}: peak_flops lacks {missing}; required dtypes: {list(REQUIRED_DTYPES)}"
            )
        for dtype, value in self.peak_flops.items():
            _check_rate(f"DeviceProfile {self.name!r}: peak_flops[{dtype!r}]", value)
        _check_rate(f"DeviceProfile {self.name!r}: memory_bandwidth", self.memory_bandwidth)
        _check_rate(f"DeviceProfile {self.name!r}: host_link_bandwidth", self.host_link_bandwidth)
        if not isinstance(self.op_rates, Mapping):
            raise ValueError(f"DeviceProfile.op_rates={self.op_rates!r}: give a mapping op -> rate")
        unknown = [key for key in self.op_rates if key not in OP_RATE_KEYS]
        if unknown:
            raise ValueError(f"DeviceProfile {self.name!r}: op_rates has unknown keys {unknown}; known: "
                             f"{list(OP_RATE_KEYS)}")
        for key, value in self.op_rates.items():
            _check_rate(f"DeviceProfile {self.name!r}: op_rates[{key!r}]", value)
        if not isinstance(self.native_fp8_gemm, bool):
            raise ValueError(f"DeviceProfile.native_fp8_gemm={self.native_fp8_gemm!r}: give a bool")
        if not isinstance(self.sources, Mapping):
            raise ValueError(f"DeviceProfile.sources={self.sources!r}: give a mapping number -> source")
        needed = [f"peak_flops.{d}" for d in self.peak_flops] + ["memory_bandwidth", "host_link_bandwidth"]
        needed += [f"op_rates.{key}" for key in self.op_rates]
        lacking = [key for key in needed if not str(self.sources.get(key, "")).strip()]
        if lacking:
            raise ValueError(f"DeviceProfile {self.name!r}: sources lacks an entry for {lacking}")
        object.__setattr__(self, "peak_flops", MappingProxyType({k: float(v) for k, v in self.peak_flops.items()}))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))
        object.__setattr__(self, "op_rates", MappingProxyType({k: float(v) for k, v in self.op_rates.items()}))

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``."""
        if dtype not in self.peak_flops:
            raise KeyError(
                f"DeviceProfile {self.name!r} has no peak_flops[{dtype!r}]; known: {sorted(self.peak_flops)}"
            )
        return self.peak_flops[dtype]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth": self.memory_bandwidth,
            "host_link_bandwidth": self.host_link_bandwidth,
            "sources": dict(self.sources),
            "op_rates": dict(self.op_rates),
            "native_fp8_gemm": self.native_fp8_gemm,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DeviceProfile":
        keys = ("name", "peak_flops", "memory_bandwidth", "host_link_bandwidth", "sources", "op_rates",
                "native_fp8_gemm")
        return cls(**{key: data[key] for key in keys})


def _check_rate(where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}={value!r}: give a positive, finite rate")


_H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column"
_H200_SHEET = "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column"
_B200_SHEET = "NVIDIA Blackwell (HGX B200) datasheet, per-GPU HGX B200 column"
_DENSE = "; the sheet's figure is with sparsity, dense is half (datasheet footnote)"
_PCIE = "PCIe Gen5 x16: the sheet lists 128 GB/s for both directions together; 64 GB/s per direction"
_HOPPER_FP8 = (
    "; Hopper has FP8 tensor cores but no hardware for MX block scales, so MXFP8 GEMMs there "
    "need the scales applied outside the tensor-core instruction"
)

H100_SXM = DeviceProfile(
    name="H100 SXM",
    peak_flops={
        "fp32": 67 * TERA,
        "tf32": 989 * TERA / SPARSITY_FACTOR,
        "bf16": 1979 * TERA / SPARSITY_FACTOR,
        "fp16": 1979 * TERA / SPARSITY_FACTOR,
        "fp8": 3958 * TERA / SPARSITY_FACTOR,
    },
    memory_bandwidth=3.35 * TB,
    host_link_bandwidth=PCIE_GEN5_X16_BOTH_DIRECTIONS / DIRECTIONS,
    sources={
        "peak_flops.fp32": f"{_H100_SHEET}: FP32 67 TFLOPS (CUDA cores, no sparsity)",
        "peak_flops.tf32": f"{_H100_SHEET}: TF32 Tensor Core 989 TFLOPS{_DENSE}",
        "peak_flops.bf16": f"{_H100_SHEET}: BFLOAT16 Tensor Core 1,979 TFLOPS{_DENSE}",
        "peak_flops.fp16": f"{_H100_SHEET}: FP16 Tensor Core 1,979 TFLOPS{_DENSE}",
        "peak_flops.fp8": f"{_H100_SHEET}: FP8 Tensor Core 3,958 TFLOPS{_DENSE}{_HOPPER_FP8}",
        "memory_bandwidth": f"{_H100_SHEET}: GPU memory bandwidth 3.35 TB/s (HBM3)",
        "host_link_bandwidth": f"{_H100_SHEET}: {_PCIE}",
    },
)

H200 = DeviceProfile(
    name="H200 SXM",
    peak_flops={
        "fp32": 67 * TERA,
        "tf32": 989 * TERA / SPARSITY_FACTOR,
        "bf16": 1979 * TERA / SPARSITY_FACTOR,
        "fp16": 1979 * TERA / SPARSITY_FACTOR,
        "fp8": 3958 * TERA / SPARSITY_FACTOR,
    },
    memory_bandwidth=4.8 * TB,
    host_link_bandwidth=PCIE_GEN5_X16_BOTH_DIRECTIONS / DIRECTIONS,
    sources={
        "peak_flops.fp32": f"{_H200_SHEET}: FP32 67 TFLOPS (same GH100 compute as H100 SXM)",
        "peak_flops.tf32": f"{_H200_SHEET}: TF32 Tensor Core 989 TFLOPS{_DENSE}",
        "peak_flops.bf16": f"{_H200_SHEET}: BFLOAT16 Tensor Core 1,979 TFLOPS{_DENSE}",
        "peak_flops.fp16": f"{_H200_SHEET}: FP16 Tensor Core 1,979 TFLOPS{_DENSE}",
        "peak_flops.fp8": f"{_H200_SHEET}: FP8 Tensor Core 3,958 TFLOPS{_DENSE}{_HOPPER_FP8}",
        "memory_bandwidth": f"{_H200_SHEET}: GPU memory bandwidth 4.8 TB/s (141 GB HBM3e)",
        "host_link_bandwidth": f"{_H200_SHEET}: {_PCIE}",
    },
)

B200 = DeviceProfile(
    name="B200 (HGX)",
    peak_flops={
        "fp32": 75 * TERA,
        "tf32": 2.2 * PETA / SPARSITY_FACTOR,
        "bf16": 4.5 * PETA / SPARSITY_FACTOR,
        "fp16": 4.5 * PETA / SPARSITY_FACTOR,
        "fp8": 9 * PETA / SPARSITY_FACTOR,
        "fp4": 18 * PETA / SPARSITY_FACTOR,
    },
    memory_bandwidth=7.7 * TB,
    host_link_bandwidth=PCIE_GEN5_X16_BOTH_DIRECTIONS / DIRECTIONS,
    sources={
        "peak_flops.fp32": f"{_B200_SHEET}: FP32 75 TFLOPS (GB200 parts run faster at higher power)",
        "peak_flops.tf32": f"{_B200_SHEET}: TF32 Tensor Core 2.2 PFLOPS{_DENSE}",
        "peak_flops.bf16": f"{_B200_SHEET}: FP16/BF16 Tensor Core 4.5 PFLOPS{_DENSE}",
        "peak_flops.fp16": f"{_B200_SHEET}: FP16/BF16 Tensor Core 4.5 PFLOPS{_DENSE}",
        "peak_flops.fp8": (
            f"{_B200_SHEET}: FP8/FP6 Tensor Core 9 PFLOPS{_DENSE}; Blackwell tensor cores apply MX "
            "block scales natively, so MXFP8 runs at this rate"
        ),
        "peak_flops.fp4": (
            f"{_B200_SHEET}: FP4 Tensor Core 18 PFLOPS{_DENSE}; twice FP8, the rate of E2M1 operands with "
            "their block scales (NVFP4, MXFP4) on block-scaled tcgen05.mma"
        ),
        "memory_bandwidth": (
            f"{_B200_SHEET}: 180 GB HBM3e at 7.7 TB/s (8 TB/s in the launch announcement; verify the revision)"
        ),
        "host_link_bandwidth": f"{_B200_SHEET}: {_PCIE}",
    },
)

PROFILES: Mapping[str, DeviceProfile] = MappingProxyType({p.name: p for p in (H100_SXM, H200, B200)})


def get_profile(name: str) -> DeviceProfile:
    """A datasheet profile by name ("H100 SXM", "H200 SXM", "B200 (HGX)")."""
    if name not in PROFILES:
        raise KeyError(f"no device profile {name!r}; known: {sorted(PROFILES)}")
    return PROFILES[name]

"""Device profiles: peak compute per dtype, memory bandwidth, host-link bandwidth.

The GPU profiles carry NVIDIA's published datasheet numbers (dense, i.e. without 2:4
sparsity: the datasheets print tensor-core figures *with* sparsity and say in a footnote that
dense is half). Every number has a source string. They were checked against reproductions of
the datasheet tables found by a documentation search, not against the PDFs themselves, and
datasheet revisions change (B200 memory bandwidth was announced as 8 TB/s, the HGX B200
table lists 7.7 TB/s): verify before relying on a single figure.

``host_link_bandwidth`` is one direction of the host link (PCIe Gen5 x16: the datasheets print
128 GB/s, both directions together). Achieved pinned-memory copies are typically 80-90 % of it.

:func:`measure_cpu_profile` measures the machine it runs on once and caches the result on disk.
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

REQUIRED_DTYPES = ("fp32", "bf16", "fp8")
CACHE_DIR_ENV = "MXCOMPILE_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/mxcompile")
CPU_PROFILE_FILE = "cpu_profile.json"
CPU_PROFILE_FORMAT = 1  # bump when the measurement changes, to invalidate old caches

TERA = 1e12
PETA = 1e15
GB = 1e9  # datasheets use decimal units
TB = 1e12
SPARSITY_FACTOR = 2.0  # datasheet tensor-core figures with 2:4 sparsity are twice the dense ones
PCIE_GEN5_X16_BOTH_DIRECTIONS = 128 * GB
DIRECTIONS = 2

CPU_MATMUL_SIZE = 256  # square matmul used to time the CPU
CPU_COPY_BYTES = 32 * 2**20
CPU_WARMUP_S = 0.05  # warm-up calls first (thread pools, kernel JIT): the first calls run far slower
CPU_MIN_MEASURE_S = 0.1  # then each measurement repeats until at least this long has passed...
CPU_MAX_REPEATS = 200  # ...or this many repeats
FLOPS_PER_MULTIPLY_ADD = 2
COPY_TRAFFIC_FACTOR = 2  # a copy reads and writes every byte


@dataclass(frozen=True)
class DeviceProfile:
    """Peak numbers of one device.

    Attributes:
        name: e.g. "H100 SXM".
        peak_flops: dtype -> dense FLOP/s; must contain "fp32", "bf16" and "fp8".
        memory_bandwidth: device-memory bytes/s.
        host_link_bandwidth: device<->host bytes/s, one direction.
        sources: where each number comes from; keys "peak_flops.<dtype>", "memory_bandwidth",
            "host_link_bandwidth", one per number.
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    host_link_bandwidth: float
    sources: Mapping[str, str]

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
        if not isinstance(self.sources, Mapping):
            raise ValueError(f"DeviceProfile.sources={self.sources!r}: give a mapping number -> source")
        needed = [f"peak_flops.{d}" for d in self.peak_flops] + ["memory_bandwidth", "host_link_bandwidth"]
        lacking = [key for key in needed if not str(self.sources.get(key, "")).strip()]
        if lacking:
            raise ValueError(f"DeviceProfile {self.name!r}: sources lacks an entry for {lacking}")
        object.__setattr__(self, "peak_flops", MappingProxyType({k: float(v) for k, v in self.peak_flops.items()}))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))

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
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DeviceProfile":
        keys = ("name", "peak_flops", "memory_bandwidth", "host_link_bandwidth", "sources")
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


def cache_dir() -> Path:
    """The on-disk cache directory: ``$MXCOMPILE_CACHE_DIR`` if set (read now, at call time),
    else ``~/.cache/mxcompile``."""
    override = os.environ.get(CACHE_DIR_ENV)
    return Path(override).expanduser() if override else DEFAULT_CACHE_DIR.expanduser()


def _fingerprint() -> dict[str, Any]:
    import torch

    return {
        "format": CPU_PROFILE_FORMAT,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _best_time(fn) -> float:
    """Fastest of repeated calls of ``fn`` after ``CPU_WARMUP_S`` of warm-up calls, repeating
    for at least ``CPU_MIN_MEASURE_S`` or ``CPU_MAX_REPEATS`` calls."""
    warm_until = time.perf_counter() + CPU_WARMUP_S
    fn()
    for _ in range(CPU_MAX_REPEATS):
        if time.perf_counter() >= warm_until:
            break
        fn()
    best = math.inf
    started = time.perf_counter()
    for _ in range(CPU_MAX_REPEATS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - started >= CPU_MIN_MEASURE_S:
            break
    return best


def _measure_cpu() -> DeviceProfile:
    import torch

    n = CPU_MATMUL_SIZE
    threads = torch.get_num_threads()
    thread_counts = sorted({1, threads})
    flops = {}
    src = torch.empty(CPU_COPY_BYTES, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    copy_time = math.inf
    try:
        # A busy core stalls multi-threaded kernels at their barriers (shared machines), so each
        # number is the best over one thread and the configured thread count.
        for count in thread_counts:
            torch.set_num_threads(count)
            for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                a = torch.randn(n, n).to(dtype)
                b = torch.randn(n, n).to(dtype)
                rate = FLOPS_PER_MULTIPLY_ADD * n**3 / _best_time(lambda: torch.mm(a, b))
                flops[key] = max(flops.get(key, 0.0), rate)
            copy_time = min(copy_time, _best_time(lambda: dst.copy_(src)))
    finally:
        torch.set_num_threads(threads)
    flops["fp8"] = flops["bf16"]
    where = (
        f"measured by measure_cpu_profile() on {platform.machine()} (best over {thread_counts} torch threads)"
    )
    return DeviceProfile(
        name=f"CPU ({platform.processor() or platform.machine()})",
        peak_flops=flops,
        memory_bandwidth=COPY_TRAFFIC_FACTOR * CPU_COPY_BYTES / copy_time,
        host_link_bandwidth=CPU_COPY_BYTES / copy_time,
        sources={
            "peak_flops.fp32": f"{where}: best of repeated {n}x{n} fp32 torch.mm",
            "peak_flops.bf16": f"{where}: best of repeated {n}x{n} bf16 torch.mm",
            "peak_flops.fp8": (
                "set equal to bf16: CPUs have no FP8 arithmetic; an (MX)FP8 GEMM on CPU upcasts its "
                "operands and runs as a bf16 (or wider) GEMM, so the bf16 rate is its best case"
            ),
            "memory_bandwidth": f"{where}: {CPU_COPY_BYTES} B tensor copy, read + write bytes per second",
            "host_link_bandwidth": (
                f"{where}: on CPU device and host memory are the same DRAM, so an offload is a "
                "memory copy; bytes copied per second"
            ),
        },
    )


def measure_cpu_profile(*, refresh: bool = False) -> DeviceProfile:
    """Profile of this CPU: small fp32 and bf16 matmul timings and a memory-copy bandwidth
    (fp8 = bf16, see its source string). Measured once, then read from
    ``cache_dir()/cpu_profile.json`` while the machine fingerprint (architecture, processor,
    core count, torch version and threads) matches; ``refresh=True`` measures again."""
    path = cache_dir() / CPU_PROFILE_FILE
    fingerprint = _fingerprint()
    if not refresh and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("fingerprint") == fingerprint:
                return DeviceProfile.from_dict(data["profile"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable or stale cache: measure again and overwrite it
    profile = _measure_cpu()
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = json.dumps({"fingerprint": fingerprint, "profile": profile.to_dict()}, indent=2, sort_keys=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cpu_profile.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(payload)
        os.replace(tmp, path)  # atomic: concurrent processes never see a partial file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return profile

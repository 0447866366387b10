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

:func:`measure_cpu_profile` measures the machine it runs on once and caches the result on disk,
keyed by the CPU model and instruction set (a profile measured on another host, e.g. one with
AVX512-BF16, priced bf16 GEMMs 150x too fast on an AVX2-only one).
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

REQUIRED_DTYPES = ("fp32", "bf16", "fp8")
QUANTIZE_RATE = "quantize"  # op_rates key: elements of input per second of mxcompile::quantize
ATTENTION_RATE = "attention"  # op_rates key: FLOP/s of mxcompile::attention (graph_costs.attention_flops)
OP_RATE_KEYS = (QUANTIZE_RATE, ATTENTION_RATE)
CACHE_DIR_ENV = "MXCOMPILE_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/mxcompile")
CPU_PROFILE_FILE = "cpu_profile.json"
CPU_PROFILE_FORMAT = 2  # bump when the measurement changes, to invalidate old caches

TERA = 1e12
PETA = 1e15
GB = 1e9  # datasheets use decimal units
TB = 1e12
SPARSITY_FACTOR = 2.0  # datasheet tensor-core figures with 2:4 sparsity are twice the dense ones
PCIE_GEN5_X16_BOTH_DIRECTIONS = 128 * GB
DIRECTIONS = 2

CPU_MATMUL_SIZE = 256  # square matmul used to time the CPU
CPU_COPY_BYTES = 32 * 2**20  # the smallest fp32 copy that times the memory bandwidth...
CPU_LLC_COPIES = 4  # ...which is at least this many last-level caches, so DRAM is timed, not the cache
LLC_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
CPU_QUANTIZE_SHAPE = (1024, 1024)  # fp32 input of the compiled quantize timed for op_rates["quantize"]
CPU_ATTENTION_SHAPE = (2, 4, 128, 64)  # (batch, heads, seq, head_dim) timed for op_rates["attention"]
QUANTIZE_CHILD_TIMEOUT_S = 600.0  # the child compiles one small graph with Inductor
CPU_WARMUP_S = 0.05  # warm-up calls first (thread pools, kernel JIT): the first calls run far slower
CPU_MIN_MEASURE_S = 0.1  # then each measurement repeats until at least this long has passed...
CPU_MAX_REPEATS = 200  # ...or this many repeats
FLOPS_PER_MULTIPLY_ADD = 2
COPY_TRAFFIC_FACTOR = 2  # a copy reads and writes every byte
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
            (keys :data:`OP_RATE_KEYS`: "quantize" in input elements/s, "attention" in FLOP/s);
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


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _fingerprint() -> dict[str, Any]:
    import torch

    return {
        "format": CPU_PROFILE_FORMAT,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_model": _cpu_model(),
        # The vector instruction set torch dispatches to (e.g. AVX2, AVX512): it sets every rate.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _best_time(fn) -> float:
    """Fastest of repeated calls of ``fn`` after ``CPU_WARMUP_S`` of warm-up calls, repeating
    for at least ``CPU_MIN_MEASURE_S`` or ``CPU_MAX_REPEATS`` calls. With one torch thread the
    clock is the process's CPU time, which other processes sharing the cores do not inflate
    (wall times of one op varied 3-10x on a shared 2-core host); with more, the wall clock."""
    import torch

    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    warm_until = time.perf_counter() + CPU_WARMUP_S
    fn()
    for _ in range(CPU_MAX_REPEATS):
        if time.perf_counter() >= warm_until:
            break
        fn()
    best = math.inf
    started = time.perf_counter()
    for _ in range(CPU_MAX_REPEATS):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
        if time.perf_counter() - started >= CPU_MIN_MEASURE_S:
            break
    return best


def _best_over_threads(fn) -> float:
    """:func:`_best_time` of ``fn`` at one torch thread and at the configured count, the
    faster: a busy core stalls multi-threaded kernels at their barriers (shared machines)."""
    import torch

    threads = torch.get_num_threads()
    try:
        times = []
        for count in sorted({1, threads}):
            torch.set_num_threads(count)
            times.append(_best_time(fn))
    finally:
        torch.set_num_threads(threads)
    return min(times)


def llc_bytes() -> int:
    """Size of the largest CPU cache (sysfs ``cache/index*/size`` of cpu0), 0 when unknown."""
    sizes = []
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    for entry in LLC_SYSFS.glob("index*/size") if LLC_SYSFS.is_dir() else ():
        text = entry.read_text().strip()
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=0)


def copy_bytes() -> int:
    """Bytes of the copy that times the memory bandwidth: ``CPU_COPY_BYTES``, or
    ``CPU_LLC_COPIES`` last-level caches if more (a copy that fits the cache times the cache:
    a 32 MiB copy under a 32 MiB L3 measured 600 GB/s on a 2-core host whose DRAM copies run
    at 17 GB/s)."""
    return max(CPU_COPY_BYTES, CPU_LLC_COPIES * llc_bytes())


def _attention_rate() -> float:
    """FLOP/s of ``mxcompile::attention`` on this CPU: its eager (key-tiled, quantizing) torch
    implementation is what Inductor calls on CPU (the op is opaque there), timed on
    ``CPU_ATTENTION_SHAPE``, FLOPs counted by :func:`mxcompile.cost.graph_costs.attention_flops`."""
    import torch

    from ..config import MXConfig
    from ..ops.attention import ATTENTION
    from ..ops.attention_reference import default_key_tile
    from .graph_costs import attention_flops

    config = MXConfig()
    batch, heads, seq, width = CPU_ATTENTION_SHAPE
    q, k, v = (torch.randn(CPU_ATTENTION_SHAPE) for _ in range(3))
    args = (q, k, v, None, False, width**-0.5, config.attention.value, config.forward_elem.value,
            config.scale_mode.value, config.block_size, default_key_tile(config.block_size))
    return attention_flops(batch, heads, seq, seq, width, width) / _best_over_threads(lambda: ATTENTION(*args))


def quantize_rate_child() -> None:
    """Run in a child process by :func:`_compiled_quantize_rate`: print the input elements per
    second of ``mxcompile::quantize`` as Inductor compiles it on CPU (its Inductor form, along
    each axis of a ``CPU_QUANTIZE_SHAPE`` fp32 tensor; the mean of the two times). The child
    inherits the parent's thread count through ``OMP_NUM_THREADS`` (set by the parent)."""
    import torch

    from ..config import MXConfig
    from ..ops.quantize import quantize_for_inductor

    config = MXConfig()
    x = torch.randn(CPU_QUANTIZE_SHAPE)
    times = []
    for axis in range(x.ndim):
        compiled = torch.compile(functools.partial(quantize_for_inductor, axis=axis, elem=config.forward_elem.value,
                                                   scale_mode=config.scale_mode.value, block_size=config.block_size))
        times.append(_best_over_threads(lambda: compiled(x)))
    print(json.dumps({"elements_per_s": x.numel() / statistics.fmean(times)}))


def _compiled_quantize_rate() -> float:
    """Input elements/s of the MX quantize Inductor generates on this CPU, measured in a fresh
    process (a compile inside the backend's own compile would nest Dynamo and run under the
    graph's fake mode). Its element loops are scalar (Inductor's CPU code emits int<->float
    bitcasts element by element): measured 0.16-0.24 G elements/s on a 2-core AVX2 host, 4x
    slower per element than its memory traffic at that host's copy bandwidth."""
    package_root = str(Path(__file__).resolve().parents[2])
    import torch

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH")))),
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    code = "from mxcompile.cost.profiles import quantize_rate_child; quantize_rate_child()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=QUANTIZE_CHILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"measuring the compiled MX quantize's rate failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["elements_per_s"])


def _measure_cpu() -> DeviceProfile:
    import torch

    n = CPU_MATMUL_SIZE
    thread_counts = sorted({1, torch.get_num_threads()})
    flops = {}
    for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        flops[key] = FLOPS_PER_MULTIPLY_ADD * n**3 / _best_over_threads(lambda: torch.mm(a, b))
    nbytes = copy_bytes()
    src = torch.ones(nbytes // FP32_BYTES)
    dst = torch.empty_like(src)
    copy_time = _best_over_threads(lambda: dst.copy_(src))
    flops["fp8"] = flops["bf16"]
    where = (
        f"measured by measure_cpu_profile() on {_cpu_model() or platform.machine()} "
        f"({torch.backends.cpu.get_cpu_capability()}; best over {thread_counts} torch threads, CPU time at 1)"
    )
    return DeviceProfile(
        name=f"CPU ({_cpu_model() or platform.machine()})",
        peak_flops=flops,
        memory_bandwidth=COPY_TRAFFIC_FACTOR * nbytes / copy_time,
        host_link_bandwidth=nbytes / copy_time,
        op_rates={QUANTIZE_RATE: _compiled_quantize_rate(), ATTENTION_RATE: _attention_rate()},
        native_fp8_gemm=False,
        sources={
            "peak_flops.fp32": f"{where}: best of repeated {n}x{n} fp32 torch.mm",
            "peak_flops.bf16": f"{where}: best of repeated {n}x{n} bf16 torch.mm",
            "peak_flops.fp8": (
                "set equal to bf16: CPUs have no FP8 arithmetic; an (MX)FP8 GEMM on CPU upcasts its "
                "operands and runs as a GEMM of their dtype (native_fp8_gemm=False prices it at that rate)"
            ),
            "memory_bandwidth": (
                f"{where}: {nbytes} B fp32 tensor copy (at least {CPU_LLC_COPIES}x the last-level cache), "
                "read + write bytes per second"
            ),
            "host_link_bandwidth": (
                f"{where}: on CPU device and host memory are the same DRAM, so an offload is a "
                "memory copy; bytes copied per second"
            ),
            f"op_rates.{QUANTIZE_RATE}": (
                f"{where}: input elements/s of mxcompile::quantize compiled by Inductor "
                f"(fp32 {CPU_QUANTIZE_SHAPE}, mean over both axes), timed in a fresh process with its default threads"
            ),
            f"op_rates.{ATTENTION_RATE}": (
                f"{where}: FLOP/s of the eager mxcompile::attention forward (the op Inductor calls on CPU) "
                f"at (batch, heads, seq, head_dim) = {CPU_ATTENTION_SHAPE}"
            ),
        },
    )


def measure_cpu_profile(*, refresh: bool = False) -> DeviceProfile:
    """Profile of this CPU: small fp32 and bf16 matmul timings, a memory-copy bandwidth (fp8 =
    bf16, see its source string), and the rates of the compiled MX quantize and of the MX
    attention op (``op_rates``). Measured once (the quantize's compile makes that tens of
    seconds), then read from ``cache_dir()/cpu_profile.json`` while the machine fingerprint
    (architecture, CPU model, instruction set, core count, torch version and threads) matches;
    ``refresh=True`` measures again."""
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

"""This CPU's :class:`~mxcompile.cost.profiles.DeviceProfile`, measured once and cached.

:func:`measure_cpu_profile` times small fp32 and bf16 matmuls, a DRAM copy and the MX ops that
run below the roofline on CPUs (the quantize op's compiled CPU kernel; the attention ops, per
FLOP and per pass), and caches the profile on disk keyed by the CPU model and instruction set (a profile measured on
another host, e.g. one with AVX512-BF16, priced bf16 GEMMs 150x too fast on an AVX2-only one).
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
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..config import MXConfig
from ..cost.graph_costs import FLOPS_PER_MULTIPLY_ADD, attention_flops
from ..cost.profiles import (ATTENTION_PASS_RATE, ATTENTION_RATE, DEQUANTIZE_FP4_RATE, DEQUANTIZE_RATE, FP32_BYTES,
                             QUANTIZE_FP4_RATE, QUANTIZE_RATE, DeviceProfile)
from ..numerics import E8M0_BIAS, NVFP4, ScaleMode, dequantize_along, elem_format
from ..ops.attention import ATTENTION, ATTENTION_BACKWARD
from ..ops.attention_reference import default_key_tile
from ..ops.quantize import DEQUANTIZE_FP4, QUANTIZE, QUANTIZE_FP4

CACHE_DIR_ENV = "MXCOMPILE_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/mxcompile")
CPU_PROFILE_FILE = "cpu_profile.json"
CPU_PROFILE_FORMAT = 9  # bump when the measurement (or a measured op) changes, to invalidate old caches

CPU_MATMUL_SIZE = 256  # square matmul used to time the CPU
CPU_COPY_BYTES = 32 * 2**20  # the smallest fp32 copy that times the memory bandwidth...
CPU_LLC_COPIES = 4  # ...which is at least this many last-level caches, so DRAM is timed, not the cache
LLC_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
CPU_QUANTIZE_SHAPE = (1024, 1024)  # fp32 input of the quantize op timed for op_rates["quantize"]
# (and the fp8 operand whose reference dequantize to fp32 is timed for op_rates["dequantize"])
CPU_FP4_SHAPE = (128, 512)  # fp32 input of the FP4 quantize and dequantize timed for op_rates (issue 48)
CPU_ATTENTION_SHAPE = (8, 4, 128, 64)  # (batch, heads, seq, head_dim) timed for the attention op_rates
# The whole-batch time's least share priced as FLOPs: a noisy pass time never takes it all.
ATTENTION_MIN_FLOP_SHARE = 0.5
QUANTIZE_CHILD_TIMEOUT_S = 600.0  # the child compiles the op's CPU kernel graphs with Inductor
CPU_WARMUP_S = 0.05  # warm-up calls first (thread pools, kernel JIT): the first calls run far slower
CPU_MIN_MEASURE_S = 0.1  # then each measurement repeats until at least this long has passed...
CPU_MAX_REPEATS = 200  # ...or this many repeats
COPY_TRAFFIC_FACTOR = 2  # a copy reads and writes every byte


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


def attention_calibration_chunks(batch: int) -> list[int]:
    """The batch chunks the attention calibration times: the whole batch, then halving down to
    one element (8: 8, 4, 2, 1), so that the pass time is fitted over the few-chunk range a
    memory plan's widening lands in as well as the many-chunk one."""
    chunks = [batch]
    while chunks[-1] > 1:
        chunks.append(math.ceil(chunks[-1] / 2))
    return chunks


def _slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    variance = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / variance if variance else 0.0


def _attention_rates() -> dict[str, float]:
    """``op_rates`` of the MX attention ops on this CPU: their eager (key-tiled, quantizing)
    torch implementation is what Inductor calls on CPU (the ops are opaque there). The forward
    and backward on ``CPU_ATTENTION_SHAPE`` are timed at each batch chunk of
    :func:`attention_calibration_chunks` (the whole batch down to one element); the
    least-squares slope of their time over their passes is the fixed time of a pass
    (``ATTENTION_PASS_RATE``, omitted when more passes are not slower), and the rest of the
    whole-batch time prices the FLOPs (``ATTENTION_RATE``, counted by
    :func:`mxcompile.cost.graph_costs.attention_flops`).

    Until 2026-12-07 the pass time was the difference between the whole batch and one element
    per chunk alone: a small difference of two noisy times (0.3 to 2.6 ms per pass on one
    2-core host in one morning), priced as if every pass cost what the last of eight does.
    Measured there (fwd + bwd, ms): chunk 8 11.1, 5 9.9, 4 9.5, 2 10.5, 1 14.6: halving the
    chunk costs nothing, one element per call does."""

    config = MXConfig()
    batch, heads, seq, width = CPU_ATTENTION_SHAPE
    key_tile = default_key_tile(config.block_size)
    q, k, v = (torch.randn(CPU_ATTENTION_SHAPE) for _ in range(3))
    common = (True, width**-0.5, config.attention.value, config.forward_elem.value)

    def forward_and_backward_s(chunk: int) -> float:
        forward = (q, k, v, None, *common, config.scale_mode.value, config.block_size, key_tile, chunk)
        out, lse = ATTENTION(*forward)
        backward = (torch.randn_like(out), q, k, v, None, out, lse, *common, config.grad_elem.value,
                    config.scale_mode.value, config.block_size, key_tile, chunk)
        forward_s = _best_over_threads(lambda: ATTENTION(*forward))
        return forward_s + _best_over_threads(lambda: ATTENTION_BACKWARD(*backward))

    tiles = math.ceil(seq / key_tile)
    ops = 2  # the forward and the backward
    chunks = attention_calibration_chunks(batch)
    times = [forward_and_backward_s(chunk) for chunk in chunks]
    whole = times[0]
    passes = [ops * tiles * math.ceil(batch / chunk) for chunk in chunks]
    pass_s = max(0.0, _slope(passes, times)) if len(chunks) > 1 else 0.0
    flops = attention_flops(batch, heads, seq, seq, width, width) + attention_flops(
        batch, heads, seq, seq, width, width, backward=True)
    rates = {ATTENTION_RATE: flops / max(whole - ops * tiles * pass_s, ATTENTION_MIN_FLOP_SHARE * whole)}
    if pass_s > 0:
        rates[ATTENTION_PASS_RATE] = 1.0 / pass_s
    return rates


def quantize_rate_child() -> None:
    """Run in a child process by :func:`_compiled_quantize_rate`: print the input elements per
    second of ``mxcompile::quantize`` on CPU (its CPU kernel: the native one, `ops.native`, or
    else a compiled graph per block layout, `ops.cpu_kernels`; along each axis of a ``CPU_QUANTIZE_SHAPE`` fp32 tensor, the mean of the
    two times). The child inherits the parent's thread count through ``OMP_NUM_THREADS`` (set
    by the parent)."""

    config = MXConfig()
    x = torch.randn(CPU_QUANTIZE_SHAPE)
    times = []
    for axis in range(x.ndim):
        quantize = functools.partial(QUANTIZE, x, axis, config.forward_elem.value, config.scale_mode.value,
                                     config.block_size)
        quantize()  # compiles (or loads) the kernel's graph
        times.append(_best_over_threads(quantize))
    print(json.dumps({"elements_per_s": x.numel() / statistics.fmean(times)}))


def _compiled_quantize_rate() -> float:
    """Input elements/s of the MX quantize op's CPU kernel on this CPU, measured in a fresh
    process (where the native kernels cannot run, its first call compiles a graph, and a
    compile inside the backend's own compile would nest Dynamo and run under the graph's fake
    mode). It runs below the memory bandwidth: 0.16-0.24 G elements/s on a 2-core AVX2 host
    with the compiled graphs (scalar fp8 casts), 4x slower per element than its memory traffic
    at that host's copy bandwidth; the native kernels 5.0 G elements/s on the 2-core AVX512
    host (2026-12-06; format 5 of the cached profile)."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH")))),
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    code = "from mxcompile.calibration.cpu import quantize_rate_child; quantize_rate_child()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=QUANTIZE_CHILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"measuring the compiled MX quantize's rate failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["elements_per_s"])


def _reference_dequantize_rate() -> float:
    """Operand elements/s of the MX GEMM reference's dequantize (`numerics.dequantize_along`, op
    by op, to fp32) on a ``CPU_QUANTIZE_SHAPE`` fp8 tensor with its block scales, along each axis
    (the reference dequantizes A along its last axis and B along its first), the mean of the two
    times."""
    config = MXConfig()
    data = torch.randn(CPU_QUANTIZE_SHAPE).to(elem_format(config.forward_elem).dtype)
    times = []
    for axis in range(data.ndim):
        scale_shape = list(data.shape)
        scale_shape[axis] //= config.block_size
        scales = torch.full(scale_shape, E8M0_BIAS, dtype=torch.uint8)  # scale 1
        times.append(_best_over_threads(
            functools.partial(dequantize_along, data, scales, axis, config.block_size, torch.float32)))
    return data.numel() / statistics.fmean(times)


def _fp4_rates() -> dict[str, float]:
    """Input elements/s of ``mxcompile::quantize_fp4`` (NVFP4, round to nearest, 1-D blocks) and
    operand elements/s of ``mxcompile::dequantize_fp4`` to fp32, on a ``CPU_FP4_SHAPE`` fp32
    tensor, each the mean over both axes (their torch references: no CPU FP4 kernel)."""
    x = torch.randn(CPU_FP4_SHAPE)
    quantize_times, dequantize_times = [], []
    for axis in range(x.ndim):
        quantize = functools.partial(QUANTIZE_FP4, x, axis, NVFP4.name, ScaleMode.RCEIL.value, False, False, 0, None)
        data, scale, _ = quantize()
        quantize_times.append(_best_over_threads(quantize))
        dequantize_times.append(_best_over_threads(
            functools.partial(DEQUANTIZE_FP4, data, scale, axis, NVFP4.name, torch.float32)))
    return {QUANTIZE_FP4_RATE: x.numel() / statistics.fmean(quantize_times),
            DEQUANTIZE_FP4_RATE: x.numel() / statistics.fmean(dequantize_times)}


def _measure_cpu() -> DeviceProfile:
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
    attention_rates = _attention_rates()
    where = (
        f"measured by measure_cpu_profile() on {_cpu_model() or platform.machine()} "
        f"({torch.backends.cpu.get_cpu_capability()}; best over {thread_counts} torch threads, CPU time at 1)"
    )
    return DeviceProfile(
        name=f"CPU ({_cpu_model() or platform.machine()})",
        peak_flops=flops,
        memory_bandwidth=COPY_TRAFFIC_FACTOR * nbytes / copy_time,
        host_link_bandwidth=nbytes / copy_time,
        op_rates={QUANTIZE_RATE: _compiled_quantize_rate(), DEQUANTIZE_RATE: _reference_dequantize_rate(),
                  **attention_rates, **_fp4_rates()},
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
            f"op_rates.{DEQUANTIZE_RATE}": (
                f"{where}: fp8 elements/s of the MX GEMM reference's operand dequantize to fp32 "
                f"(numerics.dequantize_along, eager; {CPU_QUANTIZE_SHAPE}, mean over both axes)"
            ),
            f"op_rates.{QUANTIZE_FP4_RATE}": (
                f"{where}: input elements/s of mxcompile::quantize_fp4 (its torch reference; NVFP4, round to "
                f"nearest, fp32 {CPU_FP4_SHAPE}, mean over both axes)"
            ),
            f"op_rates.{DEQUANTIZE_FP4_RATE}": (
                f"{where}: elements/s of mxcompile::dequantize_fp4 to fp32 (its torch reference; NVFP4, "
                f"{CPU_FP4_SHAPE}, mean over both axes)"
            ),
            f"op_rates.{ATTENTION_RATE}": (
                f"{where}: FLOP/s of the eager mxcompile::attention forward and backward (the ops Inductor "
                f"calls on CPU), causal, at (batch, heads, seq, head_dim) = {CPU_ATTENTION_SHAPE} in one batch "
                f"chunk, less the time of its passes"
            ),
            **({f"op_rates.{ATTENTION_PASS_RATE}": (
                f"{where}: passes/s of the same ops: one over the least-squares slope of their time over "
                f"their passes, at batch chunks {attention_calibration_chunks(CPU_ATTENTION_SHAPE[0])}"
            )} if ATTENTION_PASS_RATE in attention_rates else {}),
        },
    )


def measure_cpu_profile(*, refresh: bool = False) -> DeviceProfile:
    """Profile of this CPU: small fp32 and bf16 matmul timings, a memory-copy bandwidth (fp8 =
    bf16, see its source string), and the rates of the compiled MX quantize and of the MX
    attention op (``op_rates``). Measured once (the quantize's compile makes that tens of
    seconds), then read from ``cache_dir()/cpu_profile.json`` while the machine fingerprint
    (architecture, CPU model, instruction set, core count, torch version and threads) matches;
    ``refresh=True`` measures again. It measures real tensors even when called under a
    dispatch mode (the compile's FakeTensorMode)."""
    path = cache_dir() / CPU_PROFILE_FILE
    fingerprint = _fingerprint()
    if not refresh and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("fingerprint") == fingerprint:
                return DeviceProfile.from_dict(data["profile"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable or stale cache: measure again and overwrite it
    # The backend asks for the profile while it compiles, under the graph's FakeTensorMode: there
    # every tensor made and timed here would be fake, timing dispatch instead of the CPU (a
    # 1.2 GB copy "ran" at 28 TB/s and bf16 GEMMs at a third of their rate; format 5's caches).
    with _disable_current_modes():
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

"""`mxcompile doctor`: what this installation can run, one pass/fail line per check and the fix
for each failure, for bug reports.

Checks: the torch version against the supported range (`TORCH_RANGE`), the Triton and
transformers versions; that torch finds the mxfp8 backend and the FP4 ones (nvfp4, mxfp4); CUDA
and the GPU's architecture (Hopper sm90, Blackwell sm100); the path each kernel takes here
(MX quantize, MX GEMM, attention forward and backward) under the default `MXConfig`; the demo's
corpus and profile's plotting; the FP4 ops on the CPU and the GPU's FP4 tensor cores
(`doctor_fp4.py`). The kernel paths are the library's own decisions
(`mxcompile.api._use_triton`, `triton_templates.triton_available` / `resolve_gemm_path`,
`attention.triton_attention_unsupported`), asked with representative arguments: this module
only reports them. Exit code 0 when every required check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform
import re
import sys
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.text import Text

from .. import examples
from .._version import __version__
from ..config import GemmKernel, MXConfig, Recipe
from ..examples.data import CORPUS_INSTALL_HINT
from . import plots
from .errors import EXIT_FAILURE, EXIT_OK, one_line

# The minimum versions pyproject.toml declares (tests/cli/test_doctor.py keeps them in step).
MIN_TORCH = (2, 11)
MIN_TRANSFORMERS = (5,)
# The newest torch release (major, minor) checked with scripts/check_torch.sh (NEWEST_TESTED_TORCH;
# MIN_TORCH was checked with 2.11.0); CI runs CI_TORCH.
MAX_TESTED_TORCH = (2, 14)
NEWEST_TESTED_TORCH = "2.14.1"
CI_TORCH = "2.13.0"
TORCH_RANGE = f"{MIN_TORCH[0]}.{MIN_TORCH[1]} to {MAX_TESTED_TORCH[0]}.{MAX_TESTED_TORCH[1]}"
TORCH_INSTALL_HINT = f"pip install torch=={CI_TORCH} (the release CI runs; any torch {TORCH_RANGE} is supported)"
# Below the range the smoke set of scripts/check_torch.sh was not run (on 2.10.0 only the backend
# and inspect tests were: they pass), and pip refuses mxcompile beside a pinned older torch.
OLD_TORCH_DETAIL = ("below the supported range {range}: mxcompile's tests were not run on it (it relies on private "
                    "torch APIs: dynamo, the partitioner, Inductor), and pip installs mxcompile only with torch>={oldest}")
NEW_TORCH_DETAIL = ("newer than the tested range {range}: the private torch APIs mxcompile uses "
                    "(dynamo, the partitioner, Inductor) may have changed")
NEW_TORCH_HINT = (f"nothing if the backend works; if compiling fails, check it with `scripts/check_torch.sh VERSION` "
                  f"or install torch=={NEWEST_TESTED_TORCH}, and report it with this output")
TRITON_INSTALL_HINT = "pip install triton"
TRANSFORMERS_INSTALL_HINT = 'pip install "transformers>=5"'
BACKEND_ENTRY_POINT_GROUP = "torch_dynamo_backends"
BACKEND_NAME = "mxfp8"
REINSTALL_HINT = "reinstall mxcompile (`pip install .` in its repository): torch finds the backend through that entry point"
CUDA_TORCH_HINT = (f"on a machine with an NVIDIA GPU, install a CUDA build of torch {TORCH_RANGE} "
                   "(https://pytorch.org/get-started/locally/); on the CPU mxcompile emulates MX in PyTorch")
CUDA_DEVICE_HINT = "check the NVIDIA driver (`nvidia-smi`) and CUDA_VISIBLE_DEVICES"
TARGET_ARCHITECTURES = ("Hopper", "Blackwell")
GPU_HINT = ("the MX Triton kernels are tuned for Hopper (sm90: FP8 tl.dot per scale block) and Blackwell "
            "(sm100: native MX tl.dot_scaled); elsewhere the kernel paths below say what runs")
KERNEL_FALLBACK_HINT = ("none needed for correctness (the PyTorch implementation gives the same MX values, "
                        "slower); for the Triton kernel, remove the reason given")
NO_CUDA_KERNEL_HINT = "none needed for correctness; the Triton kernels need a CUDA GPU (see the CUDA line)"
NATIVE_KERNELS_HINT = ("install a C++ compiler (g++ or clang; Inductor needs one on CPU too) or set CXX; "
                       "the values are the same either way, the compiled graphs are slower")
# Architecture names by compute-capability major (8.9 is Ada, the rest of 8.x Ampere).
ARCHITECTURES = {7: "Volta/Turing", 8: "Ampere", 9: "Hopper", 10: "Blackwell", 12: "Blackwell"}
ADA_CAPABILITY = (8, 9)
# The representative attention call asked about: one causal head, bf16, 128 tokens, head_dim 64.
ATTENTION_SHAPE = (1, 1, 128, 64)
ATTENTION_DTYPE = torch.bfloat16
GEMM_SHAPE = (128, 128)  # a 2-D operand of the size the kernels tile


@dataclass(frozen=True)
class Check:
    """One line of the report. A failed check carries the fix; only a failed required check
    makes the exit code non-zero."""

    name: str
    passed: bool
    detail: str
    fix: str = ""
    required: bool = True

    def __post_init__(self) -> None:
        if not self.passed and not self.fix:
            raise ValueError(f"check {self.name!r} failed without a fix")
        if self.passed and self.fix:
            raise ValueError(f"check {self.name!r} passed but carries a fix")

    @property
    def label(self) -> str:
        if self.passed:
            return "pass"
        return "FAIL" if self.required else "fail"


def add_parser(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "doctor", parents=[parent], help="check this installation (versions, GPU, kernel paths) for bug reports",
        description="One pass/fail line per check, with the fix for each failure. Exit code 0 when every "
                    "required check passes; optional checks ('fail') do not change it.",
    )
    parser.set_defaults(run=run)


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: '2.13.0+cpu' -> (2, 13, 0)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


def package_check(
    name: str, minimum: tuple[int, ...] | None, fix: str, *, required: bool, purpose: str = ""
) -> Check:
    """Whether `name` imports, and its version against `minimum`."""
    suffix = f" ({purpose})" if purpose else ""
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        return Check(name, False, f"cannot be imported: {one_line(err)}{suffix}", fix, required)
    version = str(getattr(module, "__version__", "unknown"))
    if minimum is not None and _release(version) < minimum:
        return Check(name, False, f"{version}, mxcompile needs >= {_dotted(minimum)}{suffix}", fix, required)
    needs = f", mxcompile needs >= {_dotted(minimum)}" if minimum is not None else ""
    return Check(name, True, f"{version}{needs}{suffix}", required=required)


def torch_check(version: str) -> Check:
    """torch `version` against the supported range: below it a required failure; above it an
    optional one (it may well work, but nobody has run it); within it a pass."""
    release = _release(version)[:2]
    if release < MIN_TORCH:
        return Check("torch", False, f"{version}, {OLD_TORCH_DETAIL.format(range=TORCH_RANGE, oldest=_dotted(MIN_TORCH))}", TORCH_INSTALL_HINT)
    if release > MAX_TESTED_TORCH:
        return Check("torch", False, f"{version}, {NEW_TORCH_DETAIL.format(range=TORCH_RANGE)}", NEW_TORCH_HINT,
                     required=False)
    return Check("torch", True, f"{version} (supported: {TORCH_RANGE}; CI runs {CI_TORCH})")


def backend_check(name: str = BACKEND_NAME) -> Check:
    """torch finds `backend=name` ("mxfp8", or an FP4 recipe's "nvfp4" / "mxfp4") through the
    installed entry point, and it loads."""
    label = f"{name} backend"
    points = importlib.metadata.entry_points(group=BACKEND_ENTRY_POINT_GROUP, name=name)
    if not points:
        return Check(label, False, f"no {BACKEND_ENTRY_POINT_GROUP!r} entry point named "
                     f"{name!r}: torch.compile(backend={name!r}) cannot find it", REINSTALL_HINT)
    point = next(iter(points))
    try:
        point.load()
    except ImportError as err:
        return Check(label, False, f"entry point {point.value} does not load: {one_line(err)}",
                     REINSTALL_HINT)
    return Check(label, True, f"entry point {point.value}")


def cuda_check() -> Check:
    if torch.version.cuda is None:
        return Check("CUDA", False, f"this torch build has no CUDA (torch {torch.__version__})",
                     CUDA_TORCH_HINT, required=False)
    if not torch.cuda.is_available():
        return Check("CUDA", False, f"torch built for CUDA {torch.version.cuda}, but no CUDA device is visible",
                     CUDA_DEVICE_HINT, required=False)
    return Check("CUDA", True, f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)", required=False)


def architecture(capability: tuple[int, int]) -> str:
    """The architecture name of a compute capability, e.g. (9, 0) -> 'Hopper'."""
    if capability == ADA_CAPABILITY:
        return "Ada"
    return ARCHITECTURES.get(capability[0], "unknown")


def gpu_check(name: str | None, capability: tuple[int, int] | None) -> Check:
    """Whether the GPU (None: no CUDA GPU) is one the kernels are tuned for."""
    if name is None or capability is None:
        return Check("GPU architecture", False, "no CUDA GPU", "see the CUDA line", required=False)
    arch = architecture(capability)
    detail = f"{name}, sm{capability[0]}{capability[1]} ({arch})"
    return Check("GPU architecture", arch in TARGET_ARCHITECTURES, detail, "" if arch in TARGET_ARCHITECTURES
                 else GPU_HINT, required=False)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _kernel_check(name: str, triton_path: str, reason: str | None, fix: str = KERNEL_FALLBACK_HINT) -> Check:
    if reason is None:
        return Check(name, True, triton_path, required=False)
    return Check(name, False, f"PyTorch implementation: {reason}", fix, required=False)


def _has_triton_kernels(device: torch.device) -> bool:
    """Whether the mxcompile ops dispatch to their Triton kernels for tensors on `device`: their
    kernels are registered for CUDA only (`register_kernel("cuda")` in mxcompile/ops/)."""
    return device.type == "cuda"


def kernel_checks(device: torch.device, config: MXConfig) -> list[Check]:
    """The path of MX quantize, MX GEMM and attention forward/backward for tensors on `device`,
    as the ops' own eligibility functions decide it (never re-decided here)."""
    from ..ops.attention_checks import triton_attention_unsupported
    from ..ops.mx_mm import triton_mx_mm_unsupported
    from ..ops.quantize import triton_quantize_unsupported
    from ..lowering import runs_triton_mx_gemm
    from ..triton_templates import device_capability, has_mx_tensor_cores, resolve_gemm_path

    if not _has_triton_kernels(device):
        reason = f"tensors on {device.type}: the Triton kernels run for CUDA tensors only"
        return [_kernel_check(name, "", reason, NO_CUDA_KERNEL_HINT) for name in
                ("MX quantize", "MX GEMM", "attention forward", "attention backward")]
    x = torch.empty(GEMM_SHAPE, dtype=ATTENTION_DTYPE, device=device)
    why = triton_quantize_unsupported(x, config.forward_elem, config.block_size)
    checks = [_kernel_check("MX quantize", "Triton quantize kernel", why)]
    why = triton_mx_mm_unsupported(x, x, config.block_size)
    gemm = {
        "dot_scaled": "Triton MX GEMM with tl.dot_scaled" + ("" if has_mx_tensor_cores(device) else " (emulated through bf16 below sm100)"),
        "expand_bf16": "Triton MX GEMM, FP8 tiles expanded to bf16 for bf16 tensor-core MMA (sm90)",
        "fp8_per_block": f"Triton MX GEMM, FP8 tl.dot per scale block (tl.dot_scaled needs block_size 32, not {config.block_size})",
    }[resolve_gemm_path("auto", config.block_size, device_capability(device))]
    if device.type == "cuda" and not runs_triton_mx_gemm(config.gemm_kernel, device):
        reason = ("no MX tensor cores below sm100, gemm_kernel='auto'"
                  if config.gemm_kernel is GemmKernel.AUTO else f"gemm_kernel={config.gemm_kernel.value!r}")
        gemm += f"; compiled graphs run cuBLAS GEMMs of the exactly dequantized operands instead ({reason})"
    checks.append(_kernel_check("MX GEMM", gemm, why))
    q, k, v, grad_out, out = (torch.empty(ATTENTION_SHAPE, dtype=ATTENTION_DTYPE, device=device) for _ in range(5))
    lse = torch.empty(ATTENTION_SHAPE[:-1], dtype=torch.float32, device=device)
    common = (q, k, v, None, True, config.attention, config.forward_elem, config.block_size)
    call = f"causal {ATTENTION_DTYPE}, (batch, heads, seq, head_dim) = {ATTENTION_SHAPE}"
    checks.append(_kernel_check("attention forward", f"Triton forward kernel ({call})",
                                triton_attention_unsupported(*common)))
    checks.append(_kernel_check("attention backward", f"Triton backward kernels ({call})",
                                triton_attention_unsupported(*common, grad_elem=config.grad_elem,
                                                             backward_tensors=(grad_out, out, lse))))
    return checks


def native_kernels_check() -> Check:
    """Whether the quantize ops' native CPU kernels build on this machine (building them now
    if they are not in the cache)."""
    from ..ops.native.build import build

    outcome = build()
    if outcome.library is None:
        return Check("native CPU kernels", False, f"the quantize ops run compiled graphs instead: {outcome.failure}",
                     NATIVE_KERNELS_HINT, required=False)
    return Check("native CPU kernels", True, f"quantize, fake quantize, dequantize: {outcome.path}", required=False)


def corpus_check() -> Check:
    try:
        texts = examples.list_texts()
    except examples.CorpusNotFoundError as err:
        return Check("demo corpus", False, str(err), CORPUS_INSTALL_HINT, required=False)
    return Check("demo corpus", True, f"{len(texts)} texts in {texts[0].parent}", required=False)


def plotting_check() -> Check:
    reason = plots.plotting_unavailable()
    if reason is not None:
        return Check("profile plots", False, reason, plots.PLOTTING_INSTALL_HINT)
    return Check("profile plots", True, f"matplotlib {importlib.metadata.version('matplotlib')}")


def all_checks() -> list[Check]:
    from .doctor_fp4 import fp4_ops_check, fp4_tensor_core_check

    device = _device()
    cuda = cuda_check()
    gpu = (torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)) if cuda.passed else (None, None)
    return [
        torch_check(torch.__version__),
        *(backend_check(recipe.value) for recipe in Recipe),
        package_check("triton", None, TRITON_INSTALL_HINT, required=cuda.passed,
                      purpose="required with a CUDA GPU" if cuda.passed else "used only with a CUDA GPU"),
        package_check("transformers", MIN_TRANSFORMERS, TRANSFORMERS_INSTALL_HINT, required=False,
                      purpose="optional: Hugging Face models as targets"),
        cuda,
        gpu_check(*gpu),
        *kernel_checks(device, MXConfig()),
        native_kernels_check(),
        fp4_ops_check(),
        fp4_tensor_core_check(*gpu),
        corpus_check(),
        plotting_check(),
    ]


def render(checks: list[Check]) -> list[Text]:
    width = max(len(c.name) for c in checks)
    lines = []
    for check in checks:
        style = "green" if check.passed else ("bold red" if check.required else "yellow")
        line = Text(f"{check.label:<4}", style=style)
        line.append(f"  {check.name:<{width}}  {check.detail}")
        lines.append(line)
        if not check.passed:
            lines.append(Text(f"{'':<4}  {'':<{width}}  fix: {check.fix}"))
    return lines


def run(args: argparse.Namespace, console: Console) -> int:
    console.print(Text(f"mxcompile {__version__}, Python {platform.python_version()} ({sys.executable}), "
                       f"{platform.platform()}", style="bold"))
    checks = all_checks()
    for line in render(checks):
        console.print(line, soft_wrap=True)  # one line per check, however wide: easy to paste
    failed = [c.name for c in checks if c.required and not c.passed]
    optional = sum(not c.passed and not c.required for c in checks)
    if failed:
        console.print(Text(f"{len(failed)} required check(s) failed: {', '.join(failed)}", style="bold red"))
        return EXIT_FAILURE
    console.print(Text(f"All required checks pass ({optional} optional check(s) failed).", style="bold"))
    return EXIT_OK

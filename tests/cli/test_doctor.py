"""`mxcompile doctor`, and the one-line errors of `profile` and `demo` when plotting or the corpus
is missing (simulated by pointing the availability checks at packages that do not exist). All
in-process: nothing here compiles."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch

from mxcompile import examples
from mxcompile.cli import demo, doctor, doctor_fp4, plots
from mxcompile.cli.main import main
from mxcompile.config import MXConfig
from mxcompile.examples.data import CORPUS_INSTALL_HINT

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
MISSING_PACKAGE = "no_such_package_for_mxcompile_tests"
CHECK_NAMES = ("torch", "mxfp8 backend", "nvfp4 backend", "mxfp4 backend", "triton", "transformers", "CUDA",
               "GPU architecture", "MX quantize", "MX GEMM", "attention forward", "attention backward",
               "native CPU kernels", "FP4 ops (CPU)", "FP4 tensor cores", "demo corpus", "profile plots")
LINE = re.compile(r"^(pass|FAIL|fail)  (\S.*?)\s{2,}(\S.*)$")


def _doctor(capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = main(["doctor"])
    return code, capsys.readouterr().out.splitlines()


def _status_and_fix(lines: list[str], name: str) -> tuple[str, str | None]:
    """The status of check `name` and its fix line (None when the next line is another check)."""
    for i, line in enumerate(lines):
        match = LINE.match(line)
        if match and match.group(2).strip() == name:
            following = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return match.group(1), following[len("fix: "):] if following.startswith("fix: ") else None
    raise AssertionError(f"no line for check {name!r} in:\n" + "\n".join(lines))


def test_every_check_has_a_line_and_every_failure_a_fix(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines = _doctor(capsys)
    assert code == 0, "\n".join(lines)  # the development environment passes every required check
    for name in CHECK_NAMES:
        status, fix = _status_and_fix(lines, name)
        assert (fix is None) == (status == "pass"), (name, status, fix)
    assert _status_and_fix(lines, "torch")[0] == "pass"
    assert _status_and_fix(lines, "mxfp8 backend")[0] == "pass"
    assert _status_and_fix(lines, "native CPU kernels")[0] == "pass"  # this machine has g++
    for name in ("nvfp4 backend", "mxfp4 backend", "FP4 ops (CPU)"):
        assert _status_and_fix(lines, name)[0] == "pass", name
    assert lines[-1].startswith("All required checks pass")
    if not torch.cuda.is_available():
        for name in ("CUDA", "MX quantize", "MX GEMM", "attention forward", "attention backward", "FP4 tensor cores"):
            assert _status_and_fix(lines, name)[0] == "fail"  # optional: the exit code stays 0


def test_missing_plotting_fails_doctor_and_profile(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plots, "PLOTTING_MODULE", MISSING_PACKAGE)
    code, lines = _doctor(capsys)
    assert code == 1
    assert _status_and_fix(lines, "profile plots") == ("FAIL", "pip install matplotlib")
    assert lines[-1] == "1 required check(s) failed: profile plots"
    # profile stops before measuring anything, with one line naming the command.
    assert main(["profile", "mlp", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "`pip install matplotlib`" in err, err


def test_missing_corpus_fails_doctor_optionally_and_demo_names_the_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(examples, "list_texts", functools.partial(examples.list_texts, package=MISSING_PACKAGE))
    code, lines = _doctor(capsys)
    assert code == 0
    assert _status_and_fix(lines, "demo corpus") == ("fail", CORPUS_INSTALL_HINT)
    monkeypatch.setattr(demo, "load_corpus", functools.partial(examples.load_corpus, package=MISSING_PACKAGE))
    assert main(["demo"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"`{CORPUS_INSTALL_HINT}`" in err, err


def test_missing_transformers_is_optional_and_names_the_command() -> None:
    check = doctor.package_check(MISSING_PACKAGE, (5,), doctor.TRANSFORMERS_INSTALL_HINT, required=False)
    assert not check.passed and check.label == "fail" and check.fix == 'pip install "transformers>=5"'
    old = doctor.package_check("torch", (99,), doctor.TORCH_INSTALL_HINT, required=True)
    assert not old.passed and old.label == "FAIL" and "needs >= 99" in old.detail


@pytest.mark.parametrize(
    ("capability", "arch", "passed"),
    [((9, 0), "Hopper", True), ((10, 0), "Blackwell", True), ((12, 0), "Blackwell", True),
     ((8, 9), "Ada", False), ((8, 0), "Ampere", False)],
)
def test_gpu_architecture(capability: tuple[int, int], arch: str, passed: bool) -> None:
    check = doctor.gpu_check("some GPU", capability)
    assert check.passed == passed and f"sm{capability[0]}{capability[1]} ({arch})" in check.detail
    assert not check.required and (check.fix == doctor.GPU_HINT) != passed
    assert not doctor.gpu_check(None, None).passed


def test_kernel_paths_report_the_library_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the CUDA gate, the lines are the library's answers: under the Triton interpreter
    every kernel can run (GEMM through tl.dot_scaled); a block size the kernels do not take
    gives each kernel's own reason."""
    cpu = torch.device("cpu")
    assert [c.passed for c in doctor.kernel_checks(cpu, MXConfig())] == [False] * 4  # no CUDA: torch
    monkeypatch.setattr(doctor, "_has_triton_kernels", lambda device: True)
    # The environment variable, not a knob override: monkeypatch would restore the knob as an
    # explicit False, and Triton would then ignore TRITON_INTERPRET for the rest of the session.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    checks = doctor.kernel_checks(cpu, MXConfig())
    assert [c.passed for c in checks] == [True] * 4, checks
    assert "tl.dot_scaled" in checks[1].detail
    checks = doctor.kernel_checks(cpu, MXConfig(block_size=16))
    assert not checks[2].passed and "block_size=16" in checks[2].detail
    assert checks[0].passed  # the quantize kernel takes any power of two >= 16
    assert "FP8 tl.dot per scale block" in checks[1].detail  # resolve_gemm_path: dot_scaled needs 32


def _arrays_without_toml(text: str) -> dict[str, list[str]]:
    """Every `name = [...]` array of strings in pyproject.toml, by name, read without a TOML
    parser (Python 3.10 has no tomllib): enough for this file, whose arrays hold one quoted
    requirement per line, with comments after `#`, and no brackets inside the strings."""
    lines = [re.sub(r"\s*#.*$", "", line) for line in text.splitlines() if not line.lstrip().startswith("#")]
    arrays = re.findall(r"^([A-Za-z][\w-]*) = \[(.*?)\]", "\n".join(lines), re.DOTALL | re.MULTILINE)
    return {name: re.findall(r'"([^"]*)"', body) for name, body in arrays}


def _pyproject_requirements() -> tuple[list[str], dict[str, list[str]]]:
    """The project's dependencies and its extras: through tomllib (Python 3.11+) or tomli when
    one imports, else through `_arrays_without_toml`."""
    text = PYPROJECT.read_text()
    try:
        import tomllib
    except ModuleNotFoundError:
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            arrays = _arrays_without_toml(text)
            return arrays["dependencies"], {name: arrays[name] for name in ("dev", "timm")}
    project = tomllib.loads(text)["project"]
    return project["dependencies"], project["optional-dependencies"]


def test_minimum_versions_match_pyproject() -> None:
    dependencies, extras = _pyproject_requirements()
    requirements = dependencies + extras["dev"]
    assert f"torch>={doctor._dotted(doctor.MIN_TORCH)}" in requirements
    assert f"transformers>={doctor._dotted(doctor.MIN_TRANSFORMERS)}" in requirements
    assert "matplotlib" in dependencies  # profile's plots need it in a plain install
    assert {"accelerate>=1", "peft>=0.17"} <= set(extras["dev"])  # the Trainer and LoRA tests
    assert extras["timm"] == ["timm>=1"]


def test_the_fallback_reads_pyproject_as_tomllib_does() -> None:
    """The Python 3.10 path of `_pyproject_requirements`, checked where a TOML parser exists."""
    tomllib = pytest.importorskip("tomllib", reason="the comparison needs tomllib (Python 3.11+)")
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    arrays = _arrays_without_toml(PYPROJECT.read_text())
    assert arrays["dependencies"] == project["dependencies"]
    for name, requirements in project["optional-dependencies"].items():
        assert arrays[name] == requirements, name


@pytest.mark.parametrize(
    ("version", "label"),
    [("2.10.0", "FAIL"), ("2.11.0+cu130", "pass"), ("2.13.0+cpu", "pass"), ("2.14.1", "pass"),
     ("2.15.0", "fail"), ("3.0.0.dev20270101", "fail")],
)
def test_torch_check_names_the_supported_range(version: str, label: str) -> None:
    """Below the range a required failure, above it an optional one; each names the range."""
    check = doctor.torch_check(version)
    assert check.label == label and check.detail.startswith(version), check
    assert doctor.TORCH_RANGE == "2.11 to 2.14" and doctor.TORCH_RANGE in check.detail
    if label == "FAIL":
        assert "below the supported range" in check.detail and check.fix == doctor.TORCH_INSTALL_HINT
        assert check.fix.startswith("pip install torch==2.13.0")
    if label == "fail":
        assert "newer than the tested range" in check.detail and "scripts/check_torch.sh" in check.fix


def test_a_failed_check_needs_a_fix() -> None:
    with pytest.raises(ValueError, match="without a fix"):
        doctor.Check("x", False, "broken")
    with pytest.raises(ValueError, match="carries a fix"):
        doctor.Check("x", True, "fine", "do something")


def test_native_kernels_that_cannot_be_built_fail_doctor_optionally_with_the_cause(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mxcompile.ops.native import build

    failed = build.NativeBuild(None, failure="g++ failed (error: something)")
    monkeypatch.setattr(build, "build", lambda: failed)
    code, lines = _doctor(capsys)
    assert code == 0
    assert _status_and_fix(lines, "native CPU kernels") == ("fail", doctor.NATIVE_KERNELS_HINT)
    assert any("error: something" in line for line in lines)


def test_fp4_ops_that_disagree_fail_doctor(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The FP4 line compares the packed ops with the form compiled graphs run: a GEMM that
    drops the tensor scales (NVFP4's S_dec; MXFP4's is 1) fails it, naming the recipe."""
    def without_tensor_scales(a, a_decode, b, b_decode, out_dtype):
        return torch.matmul(a.float(), b.float()).to(out_dtype)

    monkeypatch.setattr(doctor_fp4, "fp4_gemm", without_tensor_scales)
    code, lines = _doctor(capsys)
    assert code == 1
    assert _status_and_fix(lines, "FP4 ops (CPU)") == ("FAIL", doctor_fp4.FP4_OPS_FIX)
    assert any("differ for ['nvfp4']" in line for line in lines), lines


@pytest.mark.parametrize(
    ("capability", "passed", "words", "loop"),
    [((10, 0), True, "block-scaled FP4 MMA", "dot_scaled"), ((12, 0), True, "block-scaled FP4 MMA", "dot_scaled"),
     ((9, 0), False, "no FP4 tensor cores below sm100", "expand_bf16"),
     ((8, 0), False, "no FP4 tensor cores below sm100", "expand_bf16")],
)
def test_fp4_tensor_cores(capability: tuple[int, int], passed: bool, words: str, loop: str) -> None:
    """On every GPU the line names the Triton FP4 GEMM's loop compiled graphs run there (and the
    gemm_kernel that runs the dequantized GEMM instead); without one, the CPU's dequantized GEMM."""
    check = doctor_fp4.fp4_tensor_core_check("some GPU", capability)
    assert check.passed == passed and not check.required and words in check.detail, check
    assert f"Triton FP4 GEMM ({loop}: {doctor_fp4.FP4_GEMM_LOOPS[loop]})" in check.detail, check
    assert doctor_fp4.DEQUANTIZED_OPTION in check.detail and doctor_fp4.CPU_PATH not in check.detail
    assert (check.fix == doctor_fp4.NO_FP4_TENSOR_CORES_FIX) != passed
    no_gpu = doctor_fp4.fp4_tensor_core_check(None, None)
    assert not no_gpu.passed and doctor_fp4.CPU_PATH in no_gpu.detail, no_gpu

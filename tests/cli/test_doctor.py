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
from mxcompile.cli import demo, doctor, plots
from mxcompile.cli.main import main
from mxcompile.config import MXConfig
from mxcompile.examples.data import CORPUS_INSTALL_HINT

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
MISSING_PACKAGE = "no_such_package_for_mxcompile_tests"
CHECK_NAMES = ("torch", "mxfp8 backend", "triton", "transformers", "CUDA", "GPU architecture", "MX quantize",
               "MX GEMM", "attention forward", "attention backward", "native CPU kernels", "demo corpus",
               "profile plots")
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
    assert lines[-1].startswith("All required checks pass")
    if not torch.cuda.is_available():
        for name in ("CUDA", "MX quantize", "MX GEMM", "attention forward", "attention backward"):
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


def test_minimum_versions_match_pyproject() -> None:
    # tomllib is in the standard library from Python 3.11; pyproject allows 3.10, where reading
    # TOML would need a new dependency, so this file check runs on 3.11+ only.
    tomllib = pytest.importorskip("tomllib", reason="tomllib (Python 3.11+) reads pyproject.toml")
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["dev"]
    assert f"torch>={doctor._dotted(doctor.MIN_TORCH)}" in requirements
    assert f"transformers>={doctor._dotted(doctor.MIN_TRANSFORMERS)}" in requirements
    assert "matplotlib" in project["dependencies"]  # profile's plots need it in a plain install


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

"""Wrong targets and options: one line on stderr saying what to do, exit code 2; a traceback
only with --debug."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable

import pytest

from mxcompile.cli.errors import EXIT_USAGE, CLIError
from mxcompile.cli.main import main

Cli = Callable[..., subprocess.CompletedProcess[str]]



def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("mxcompile: error: ")
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("no-such-example", "unknown example 'no-such-example'"),
        ("missing_dir/missing.py:make", "does not exist"),
        ("no_such_package_xyz.module:make", "cannot be found"),
        ("{file}:nothing_here", "has no attribute 'nothing_here'"),
        ("{file}:NOT_CALLABLE", "not a callable"),
        ("{file}:broken", "raised RuntimeError: the weights file is missing"),
        ("{file}:not_a_pair", "returned a TwoLayer"),
        ("{file}:tensor_inputs", "wrap a single input as (x,)"),
        ("{file}:", "names no factory"),
    ],
)
def test_bad_target(target: str, expected: str, user_target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["inspect", target.format(file=user_target)])
    assert code == EXIT_USAGE
    assert expected in _error_line(capsys)


def test_unknown_example_lists_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "gtp"]) == EXIT_USAGE
    line = _error_line(capsys)
    assert "gpt" in line and "mlp" in line


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("no_equals_sign", "is not KEY=VALUE"),
        ("not_an_option=1", "unknown mxfp8 option(s) ['not_an_option']"),
        ("scale_mode=round_down", "scale_mode='round_down' is not accepted"),
        ("memory_budget=1", "memory_budget=1: a bare int is ambiguous"),
        ("attention=all", "attention='all' is not accepted; accepted: ['both', 'qk_only', 'off']"),
    ],
)
def test_bad_config(option: str, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "mlp", "--config", option]) == EXIT_USAGE
    assert expected in _error_line(capsys)


def test_budget_that_cannot_be_met_is_a_usage_error(user_target: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", f"{user_target}:make", "--graph", "none", "--config", "memory_budget=1B"]) == EXIT_USAGE
    line = _error_line(capsys)
    assert "memory_budget" in line and "BackendCompilerFailed" not in line  # the planner's own message


def test_profile_out_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "taken"
    out.write_text("")
    assert main(["profile", "mlp", "--out", str(out)]) == EXIT_USAGE
    assert "is not a directory" in _error_line(capsys)


@pytest.mark.parametrize("position", ["before", "after"])
def test_debug_raises(position: str, user_target: Path) -> None:
    args = ["inspect", f"{user_target}:broken"]
    argv = ["--debug", *args] if position == "before" else [*args, "--debug"]
    with pytest.raises(CLIError) as info:
        main(argv)
    assert isinstance(info.value.__cause__, RuntimeError)  # the factory's own exception, chained


def test_bad_steps_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--steps", "0"])
    assert info.value.code == EXIT_USAGE
    assert "give an integer >= 1" in capsys.readouterr().err


def test_subprocess_error_is_one_line(cli: Cli, user_target: Path) -> None:
    result = cli("inspect", f"{user_target}:broken")
    assert result.returncode == EXIT_USAGE
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "raised RuntimeError" in result.stderr
    assert "Traceback" not in result.stderr


def test_subprocess_unknown_example(cli: Cli) -> None:
    result = cli("profile", "nonexistent-example", "--steps", "1")
    assert result.returncode == EXIT_USAGE
    assert result.stderr.startswith("mxcompile: error: unknown example 'nonexistent-example'")
    assert "Traceback" not in result.stderr

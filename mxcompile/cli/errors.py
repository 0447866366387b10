"""Errors the CLI reports as one line (no traceback unless --debug), and their exit codes."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1  # the command ran and something inside mxcompile or torch failed
EXIT_USAGE = 2  # the command line or the target is wrong; the message says what to do
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT


class CLIError(Exception):
    """A problem with what the user asked for: printed as one line, exit code `EXIT_USAGE`."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def root_cause(err: BaseException) -> BaseException:
    """The innermost exception behind `err`: torch wraps backend errors (BackendCompilerFailed
    keeps the original as `inner_exception`, and chains it as `__cause__`)."""
    seen = {id(err)}
    while True:
        inner = getattr(err, "inner_exception", None) or err.__cause__
        if not isinstance(inner, BaseException) or id(inner) in seen:
            return err
        seen.add(id(inner))
        err = inner


def is_mxcompile_value_error(err: BaseException) -> bool:
    """A ValueError raised by mxcompile itself: a setting it cannot honour (e.g. a memory budget
    below the smallest reachable peak), which the user fixes by changing an option."""
    return isinstance(err, ValueError) and type(err).__module__.startswith("mxcompile.")


def one_line(err: BaseException) -> str:
    """The first line of an exception's message, prefixed by its type."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__

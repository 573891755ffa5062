"""How a command ends: stdout guarded so that a failed write is one line, every other word on stderr, and the one
mapping from an exception to a line and an exit code (0 ok, 1 a build step failed, 2 bad input, 3 infrastructure,
130 interrupted)."""

import errno
import os
import signal
import sys

import typer

from qbuild.core.errors import QbuildError


def err(msg: str) -> None:
    """One line on stderr, as it is (no markup, no highlighting)."""
    from qbuild.render import console_err

    console_err().print(msg, markup=False, highlight=False, soft_wrap=True)


class OutputError(QbuildError):
    """stdout cannot take what a command prints (a full disk, /dev/full, a closed pipe): the environment's failure."""

    exit_code = 3

    def __init__(self, e: OSError):
        super().__init__(f"stdout: cannot write the output: {e.strerror or e}")
        self.broken_pipe = isinstance(e, BrokenPipeError)


class GuardedOutput:
    """sys.stdout, whose write errors become OutputError: print(), rich and the JSON writers all write through it,
    so a failed write is one line naming stdout wherever it happens."""

    def __init__(self, stream):
        self._stream = stream   # None where the process started with stdout closed (`>&-`)

    def write(self, text: str) -> int:
        try:
            if self._stream is None:
                raise OSError(errno.EBADF, "stdout is closed")
            return self._stream.write(text)
        except OSError as e:
            raise OutputError(e) from None

    def flush(self) -> None:
        try:
            if self._stream is not None:
                self._stream.flush()
        except OSError as e:
            raise OutputError(e) from None

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def check_cwd() -> None:
    """Every command resolves paths against the working directory; a deleted one fails each differently, deep inside
    (pathlib, torch's own loader), so it is refused first."""
    try:
        os.getcwd()
    except OSError as e:
        from qbuild.core.errors import InfraError

        raise InfraError(f"the current directory is gone ({e.strerror}: it was deleted or unmounted); cd to an "
                         "existing directory and run the command again") from None


def exit_code(e: Exception) -> int:
    """The one mapping from an exception to a line on stderr and an exit code. Anything unknown is a bug: it raises,
    with its traceback."""
    from typer.exceptions import TyperException

    if isinstance(e, OutputError):
        # What could not be written stays in stdout's buffer; the interpreter would try again at exit and fail.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):   # no descriptor behind it
            pass
        if e.broken_pipe:   # the reader stopped reading (`| head`): quiet, as a tool killed by SIGPIPE
            return 128 + signal.SIGPIPE
    if isinstance(e, QbuildError):
        if os.environ.get("QBUILD_DEBUG"):
            raise e
        err(f"error: {e}")
        return e.exit_code
    if isinstance(e, typer.Exit):
        return e.exit_code
    if isinstance(e, typer.Abort):   # click raises it on EOF at a prompt
        err("aborted")
        return 130
    # click's usage errors (unknown flag or command, missing or out-of-range value), from the copy of click that
    # typer vendors (they are not click.ClickException): the usage line, the help hint and one error line.
    if isinstance(e, TyperException) and hasattr(e, "show"):
        e.show()
        return 2
    raise e

"""The CLI's exit codes and how a command reports an error: one line on stderr, and with ``--json`` an
object on stdout, so a script can tell a verdict from bad input from a crash."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from typing import Any

from samestep.exit_codes import DIFFERENCE, INPUT_ERROR, INTERNAL_ERROR, INTERRUPTED, OK, PEER_LOST

__all__ = [
    "DIFFERENCE",
    "EXIT_PEER_LOST",
    "INPUT_ERROR",
    "INTERNAL_ERROR",
    "INTERRUPTED",
    "OK",
    "InputError",
    "console",
    "input_error_of",
    "peer_lost",
    "quiet_stdout",
    "report",
    "verdict",
]

# the exit codes: samestep.exit_codes is their one table (docs/debugging.md's)
EXIT_PEER_LOST = PEER_LOST
# What torch.distributed's backends say when the process at the other end of a collective has gone.
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
    "Socket closed",
)

# A path that cannot be read or written as given: bad input, named by the path.
_PATH_ERRNOS = {
    errno.ENOENT,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EACCES,
    errno.EPERM,
    errno.ELOOP,
    errno.ENAMETOOLONG,
    errno.EROFS,
}


class InputError(Exception):
    """Bad input to a command (a run directory, a file, an option): reported as one line, exit 2."""


def input_error_of(e: BaseException) -> str | None:
    """The line that reports ``e`` as bad input, or None if it is something else (a crash)."""
    if isinstance(e, (InputError, ValueError)):
        return str(e)
    if isinstance(e, OSError) and e.errno in _PATH_ERRNOS:
        return f"{e.filename}: {e.strerror}" if e.filename else str(e)
    return None


def peer_lost(e: BaseException) -> bool:
    """Whether ``e`` is a collective of a multi-process job that lost the process at its other end (that
    process's own exit, or the launcher, names why)."""
    return (
        int(os.environ.get("WORLD_SIZE", "1")) > 1
        and isinstance(e, RuntimeError)
        and any(words in str(e) for words in _PEER_GONE)
    )


def verdict(args: argparse.Namespace, code: int) -> int:
    """Records a command's verdict (its exit code) before it prints it: a reader that closes the pipe early
    (``| head``) ends the printing, never changes the verdict."""
    args.verdict = code
    return code


def console() -> Any:
    """A rich Console on stdout whose closed pipe raises BrokenPipeError, as ``print`` does (rich's own exits
    1, the code of a difference found)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError(errno.EPIPE, "stdout closed")

    return _Console(highlight=False)


def report(args: argparse.Namespace, message: str, code: int) -> int:
    """Reports an error of ``args.command``: one line on stderr (the message as given), and with --json a JSON
    object ``{"error", "exit_code"}`` on stdout. Returns ``code``."""
    verb = getattr(args, "verb", None)  # "receipts verify", "trace certify"
    print(f"samestep {args.command}{' ' + verb if verb else ''}: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        try:
            print(json.dumps({"error": message, "exit_code": code}), flush=True)
        except BrokenPipeError:  # the reader left: the code still says what happened
            quiet_stdout()
    return code


def quiet_stdout() -> None:
    """Points stdout at /dev/null after its reader left (``| head``): the flush at exit then has nowhere to fail."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

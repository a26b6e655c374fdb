"""Durable writes: a file is on disk (fsync'ed) before anything refers to it, and a replaced file is
either the old one or the new one after a crash, never a mix. Safe reads: only regular files are read,
so a FIFO or a device in a file's place is an error, not a read that blocks or never ends."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from samestep.exit_codes import Refusal

__all__ = ["NotAFile", "fsync_dir", "read_file", "replace_atomic", "write_durable"]


class NotAFile(Refusal):
    """A path that samestep reads is a directory, a FIFO, a socket or a device, not a regular file."""


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def read_file(path: str | os.PathLike[str], first_line: bool = False) -> bytes:
    """A regular file's bytes (``first_line``: up to and including its first newline, for a header). The file
    is opened without blocking and checked before any read.

    Raises:
        NotAFile: it is something else, named with the fix; FileNotFoundError and the other OSErrors as
            ``open`` raises them (a missing file is for the caller to name).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise NotAFile(
                f"{path}: is {kind}, not a regular file; samestep reads only regular files (put the "
                "file samestep wrote back in its place)"
            )
        with os.fdopen(fd, "rb") as f:
            fd = -1
            return f.readline() if first_line else f.read()
    finally:
        if fd >= 0:
            os.close(fd)


def fsync_dir(path: Path) -> None:
    """Makes the entries of directory ``path`` (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` and fsyncs it (the directory is fsync'ed by the committer)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_atomic(path: Path, data: bytes) -> None:
    """Replaces ``path`` with ``data`` atomically: temp file, fsync, rename, fsync the directory. A failed
    write (a full disk) leaves ``path`` as it was and no temporary file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)

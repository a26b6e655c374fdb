"""Durable writes: a file is on disk (fsync'ed) before anything refers to it, and a replaced file is
either the old one or the new one after a crash, never a mix."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "replace_atomic", "write_durable"]


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
    """Replaces ``path`` with ``data`` atomically: temp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    write_durable(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)

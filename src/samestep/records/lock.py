"""One writer per run directory: an exclusive flock that the kernel releases when its process dies, so a
killed run never blocks its own resume, and a second writer is refused, naming the holder's pid and host."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from samestep.records.rundir import LOCK, PathLike, RunDirError

__all__ = ["RunLock", "hold"]


class RunLock:
    """An exclusive hold on a run directory, for the life of the process that writes it. It is an
    ``flock``: the kernel releases it when the process dies, so a killed run never blocks its own resume."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd, self.path = fd, path

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the file releases the lock
            self._fd = -1


def hold(run_dir: PathLike) -> RunLock:
    """Takes the run directory for this process (creating it if needed). Every writer of a run directory
    takes it before it writes: ``samestep train``, ``samestep.Run``, and ``samestep.trace`` (unless its
    caller holds it and passes it on).

    Raises:
        RunDirError: another live process holds it; names that process's pid and host.
    """
    import fcntl

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "an unknown process"
        os.close(fd)
        raise RunDirError(
            f"{run_dir} is in use by {holder}, which is writing this run; wait for it to end (or stop "
            "it), or choose another run directory"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    return RunLock(fd, path)

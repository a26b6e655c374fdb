"""Where a replay runs and how long it lives: the scratch directory of ``samestep verify`` and ``samestep bisect``
and the replay's process, which end with the verifier.

- A scratch directory (``samestep-verify-*``, ``samestep-bisect-*`` in the temporary directory) holds its
  verifier's mark (``OWNER``, ``replay_request.process_mark``); it is removed when the verifier ends, by any
  exception or signal (``stopping``: SIGTERM ends it as Ctrl-C does), and, where the verifier was killed at
  once, by the next verifier, which removes every scratch directory whose owner is gone.
- A replay's process runs in its own process group with a parent-death signal (Linux), killed with its group
  when the verifier leaves the wait early; processes a launcher starts in groups of their own (torchrun's
  workers) end themselves once their parent or the verifier is gone (``ReplayRequest.watch``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from samestep.replay.request import alive, process_mark

__all__ = ["OWNER", "kill_children", "remove_stale", "run_child", "scratch_root", "stopping"]

OWNER = "samestep-owner.json"  # in a scratch root: the verifier's mark
_PREFIXES = ("samestep-verify-", "samestep-bisect-")
_PR_SET_PDEATHSIG = 1
_children: set[int] = set()  # the process groups of the replays running now


def remove_stale(where: Path | None = None) -> list[Path]:
    """Removes the scratch roots in ``where`` (default: the temporary directory) whose verifier is gone;
    returns them. A directory without a readable owner file is left alone (not known to be one)."""
    removed = []
    for root in Path(where or tempfile.gettempdir()).iterdir():
        if not root.name.startswith(_PREFIXES) or not root.is_dir():
            continue
        try:
            mark = json.loads((root / OWNER).read_text(encoding="utf-8"))["mark"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(mark, str) and not alive(mark):
            shutil.rmtree(root, ignore_errors=True)
            removed.append(root)
    return removed


@contextlib.contextmanager
def scratch_root(command: str, keep: Path | None) -> Iterator[Path]:
    """A new scratch root for ``command`` ("verify", "bisect") marked with this process, removed on the way out
    whatever ends it; ``keep``: the verifier's own directory instead, left in place. Stale roots of gone
    verifiers are removed first."""
    if keep is not None:
        yield keep
        return
    remove_stale()
    root = Path(tempfile.mkdtemp(prefix=f"samestep-{command}-"))
    try:
        (root / OWNER).write_text(json.dumps({"mark": process_mark()}), encoding="utf-8")
        yield root
    finally:
        kill_children()
        shutil.rmtree(root, ignore_errors=True)


def kill_children() -> None:
    """Kills every replay process group this process runs now (a verifier leaving while its threads wait)."""
    for group in list(_children):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


@contextlib.contextmanager
def stopping() -> Iterator[None]:
    """SIGTERM ends the work inside as Ctrl-C does (``KeyboardInterrupt``), so its replays are killed and its
    scratch removed; the handler before is restored after. Only in the main thread (elsewhere: as it is)."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        before = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _parent_death_signal() -> object | None:
    """A function for the child between fork and exec that has the kernel kill it when this process ends
    (``prctl(PR_SET_PDEATHSIG)``), looked up before the fork (no loader work in the child); None off Linux."""
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def die_with_parent() -> None:  # pragma: no cover - runs in the child
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return die_with_parent


def run_child(
    cmd: list[str], *, timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Runs a replay's process to its end (output captured, no stdin), in a process group of its own that dies
    with this process: killed with its group on any exception here (a timeout, Ctrl-C, SIGTERM under
    ``stopping``), and by the kernel's parent-death signal where this process is killed at once (Linux).

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` (killed).
    """
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_parent_death_signal(),
    )
    _children.add(proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()  # not its pipes: a launcher's workers, in groups of their own, end by their watch
        raise
    finally:
        _children.discard(proc.pid)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)

"""``samestep train --nproc N``: N processes on this machine, started, signalled and ended as one job.

The launcher sets the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and starts each process outside the launcher's process group
(``start_new_session``), so a signal reaches a process once, from the launcher: a scheduler's SIGTERM
or a Ctrl-C is forwarded, every process finishes its step and saves, and the job exits with the
processes' own code (75 when preempted, see samestep.determinism.preempt). It waits for them as long as they take:
the scheduler's kill is the deadline, not a launcher's timeout. A process that fails takes the others
down after ``GRACE_S`` (they would wait in a collective for ever), and its code is the job's: a process killed by
a signal is named by the launcher (the job exits 128 + the signal's number), the others say in one line that they
lost it (``EXIT_PEER_LOST``). Should the
launcher itself die (a SIGKILL), each process gets a SIGTERM from the kernel (``follow_launcher``), so
it saves and stops as if preempted rather than train on unsupervised.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import FrameType

from samestep.cli.errors import EXIT_PEER_LOST
from samestep.determinism.preempt import EXIT_PREEMPTED

__all__ = ["GRACE_S", "LAUNCHER_PID", "follow_launcher", "free_port", "launch"]

GRACE_S = 10.0
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP")  # always passed on, besides the run's exit signals
LAUNCHER_PID = "SAMESTEP_LAUNCHER_PID"  # set for each process: the launcher it follows
_PR_SET_PDEATHSIG = 1
# A process whose failure is not another's consequence: an input error (2), a detected fault (4) or a
# non-finite loss (5) names the cause; the others then fail with whatever their collectives report.
_CAUSES = (2, 4, 5)


def follow_launcher() -> None:
    """In a process started by ``launch``: the kernel sends it SIGTERM when the launcher dies (Linux), so
    it stops after its step with a checkpoint; if the launcher is gone already, it exits now."""
    launcher = os.environ.get(LAUNCHER_PID)
    if not launcher:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launcher's own forwarding is all there is
        return
    if os.getppid() != int(launcher):
        raise SystemExit(EXIT_PREEMPTED)  # nothing trained here yet, nothing lost


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on now (the job's MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _code(returncode: int) -> int:
    """A process's exit status as a shell reports it (a signal N is 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def launch(argv: list[str], nproc: int, threads: int, signals: tuple[str, ...]) -> int:
    """Runs ``python -m samestep *argv`` as ``nproc`` processes of one job; returns the job's exit code: the
    first failing process's, else 75 if they stopped on a signal with a checkpoint, else 0."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        **{LAUNCHER_PID: str(os.getpid())},
    )
    procs: list[subprocess.Popen] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for name in dict.fromkeys((*FORWARDED, *signals)):
            signum = getattr(signal, name)
            previous[signum] = signal.signal(signum, forward)
    try:
        for rank in range(nproc):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "samestep", *argv],
                    start_new_session=True,
                    env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                )
            )
        return _wait(procs)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for p in procs:  # only after a failure of the launcher itself
            if p.poll() is None:
                p.kill()
                p.wait()


def _first_failure(procs: list[subprocess.Popen]) -> int | None:
    """The rank of a process that ended otherwise than 0 or 75 (None: none has); of those that ended since the
    last look, one a signal killed, then one that names a cause (``_CAUSES``), before the others (a rank whose
    collectives lost that one: ``EXIT_PEER_LOST``)."""
    bad = [r for r, p in enumerate(procs) if p.returncode not in (None, 0, EXIT_PREEMPTED)]
    ranked = sorted(
        bad,
        key=lambda r: (
            procs[r].returncode >= 0,
            _code(procs[r].returncode) not in _CAUSES,
            procs[r].returncode == EXIT_PEER_LOST,
        ),
    )
    return ranked[0] if ranked else None


def _wait(procs: list[subprocess.Popen]) -> int:
    failed: int | None = None
    deadline = 0.0
    while any(p.poll() is None for p in procs):
        if failed is None:
            failed = _first_failure(procs)
            deadline = time.monotonic() + GRACE_S
        elif time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    failed = failed if failed is not None else _first_failure(procs)
    if failed is not None:
        code = procs[failed].returncode
        if code < 0:  # no line of its own: a signal ended it; the others only say they lost it
            print(
                f"samestep train: rank {failed} was killed by {signal.Signals(-code).name} (exit {_code(code)}); "
                "the job's other processes were stopped. --resume continues from the newest checkpoint",
                file=sys.stderr,
                flush=True,
            )
        return _code(code)
    return EXIT_PREEMPTED if any(p.returncode == EXIT_PREEMPTED for p in procs) else 0

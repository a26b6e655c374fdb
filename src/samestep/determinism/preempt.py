"""Preemption: when a scheduler asks a run to stop (SIGTERM, or SIGUSR1 with a grace period) or a person
presses Ctrl-C, finish the step, save, and stop; a second signal stops at once.

    with samestep.preempt.StopRequest() as stop:      # your own loop
        for step in ...:
            train_one_step()
            if stop.requested:                         # e.g. "SIGTERM"
                samestep.save_checkpoint(...)
                sys.exit(samestep.preempt.EXIT_PREEMPTED)

``samestep train`` does this itself (``train.exit_signals``) and exits with ``EXIT_PREEMPTED``; its
``--resume`` continues bit for bit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

from samestep import exit_codes

__all__ = ["DEFAULT_SIGNALS", "EXIT_PREEMPTED", "StopRequest", "exit_by_signal", "parse_signals"]

EXIT_PREEMPTED = exit_codes.PREEMPTED  # stopped on request with everything saved; a requeued job resumes
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
DUPLICATE_S = 0.5  # the same signal again within this time is the same request, not a second one


def parse_signals(text: str, what: str = "train.exit_signals") -> tuple[str, ...]:
    """``"SIGTERM,SIGUSR1"`` -> ("SIGTERM", "SIGUSR1"); ``""`` -> () (no handler: a signal acts as usual).

    Raises:
        ValueError: names ``what`` and the unknown signal.
    """
    names = tuple(part.strip().upper() for part in text.split(",") if part.strip())
    for name in names:
        if (
            not name.startswith("SIG")
            or not isinstance(getattr(signal, name, None), signal.Signals)
            or name in ("SIGKILL", "SIGSTOP")
        ):
            raise ValueError(
                f"{what}={text!r}: {name!r} is not a signal that can be caught; use names like "
                "SIGTERM,SIGUSR1,SIGINT (or '' for none)"
            )
    return names


class StopRequest:
    """While entered, the given signals ask the loop to stop at its next step boundary (``requested`` holds
    the first one's name); a second one stops the process at once, with ``exit_by_signal``'s code. The same
    signal again within ``DUPLICATE_S`` is the first one delivered twice (a scheduler that signals every
    process of a job, and a launcher that forwards it), not a second.
    Once the block is left after a stop was asked for, a further signal exits with ``EXIT_PREEMPTED``, and
    while the interpreter exits it is ignored (the exit code stays the process's own).
    Handlers are installed in the main thread only (elsewhere Python refuses them: then nothing is
    installed and ``requested`` stays None)."""

    def __init__(self, signals: tuple[str, ...] = DEFAULT_SIGNALS) -> None:
        self.signals = signals
        self.requested: str | None = None
        self._at = 0.0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested, self._at = name, time.monotonic()
            print(
                f"samestep: {name}: finishing this step, saving, then stopping (send it again to stop now)",
                file=sys.stderr,
                flush=True,
            )
            return
        if name == self.requested and time.monotonic() - self._at < DUPLICATE_S:
            return  # the same request delivered twice (to every process of a job, and by a launcher)
        # the second: stop now, with the code a shell gives a process ended by that signal, on one process or many
        print(
            f"samestep: {name} again: stopping now, without saving (exit {exit_by_signal(signum)})",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(exit_by_signal(signum))

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for name in self.signals:
                signum = getattr(signal, name)
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            # after a stop was asked for (and the loop saved what it had), a further signal ends the process
            # as a preempted one, not as killed by it
            signal.signal(signum, _exit_preempted if self.requested is not None else previous)
        if self.requested is not None and self._previous:
            atexit.register(_ignore_while_exiting, tuple(self._previous))
        self._previous.clear()


def exit_by_signal(signum: int) -> int:
    """The exit code of a process stopped at once by signal ``signum``: 128 + its number, as a shell reports a
    process the signal ended (143 for SIGTERM, 130 for SIGINT)."""
    return 128 + signum


def _exit_preempted(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(EXIT_PREEMPTED)


def _ignore_while_exiting(signums: tuple[int, ...]) -> None:
    """At exit after a stop: the interpreter's finalization puts its handlers back to the default (which ends
    the process by the signal, as killed) while torch and the rest tear down, for a second or so; the process
    is already leaving with everything saved, so a further signal is ignored and its exit code stays its own."""
    for signum in signums:
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signum, signal.SIG_IGN)

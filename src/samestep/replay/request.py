"""A replay request: how `samestep verify` and `samestep bisect` ask a program of one's own to run part of its
run again, with no change to the program (docs/formats.md).

The replay runs the recorded program (``program.relaunch``) with ``SAMESTEP_REPLAY`` set to this request, as
JSON. A ``samestep.Run`` or framework callback whose run directory is the request's ``run_dir`` (the one the
program names, which the run replayed may be a copy of) then works in ``into`` instead (a scratch directory
that holds the run's checkpoint of the step it starts from, and its receipts up to it), resumes there (a
framework from ``resume_from``, the copy of its own checkpoint), traces as the request asks, keeps receipts,
saves no checkpoint, and ends the process (exit 0) once step ``stop_after`` is receipted. A resume its checks
refuse (the checkpoint is not the state its receipt records) leaves the refusal in ``into``
(``REFUSAL``), for the verdict. A replayed process lives no longer than the verifier that started it
(``watch``): every process of it, torchrun's workers included, ends itself once the verifier or its own parent
is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["REFUSAL", "REPLAY_VAR", "ReplayRequest", "alive", "process_mark"]

REPLAY_VAR = "SAMESTEP_REPLAY"
REFUSAL = "replay_refused.txt"  # in ``into``: why the replayed program refused its resume
_WATCH_SECONDS = 0.5  # how soon a replayed process notices that its verifier is gone
_watching: list[str] = []  # the mark this process watches (one watcher a process)


def process_mark(pid: int | None = None) -> str:
    """``PID:START``, a process as no later process with its PID is (its start time, in clock ticks since
    boot; empty where ``/proc`` has none)."""
    pid = os.getpid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]  # field 22, counted after the command's name
    except (OSError, IndexError):
        start = ""
    return f"{pid}:{start}"


def alive(mark: str) -> bool:
    """Whether the process ``mark`` (``process_mark``) still runs."""
    pid, _, start = mark.partition(":")
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return pid.isdigit()
    return not start or process_mark(int(pid)) == mark


def _watch(mark: str, parent: int) -> None:
    """Ends this process once the verifier ``mark`` or this process's parent (a launcher) is gone."""
    while alive(mark) and os.getppid() == parent:
        time.sleep(_WATCH_SECONDS)
    print(
        f"samestep: the verifier that started this replay ({mark.partition(':')[0]}) is gone: the replay ends",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayRequest:
    run_dir: str
    """The run directory the program's Run names (resolved; the run replayed, or the one it was copied from)."""
    into: str
    """The scratch run directory the replay writes."""
    stop_after: int
    """The last step replayed."""
    level: str = "step"
    """The trace level of the replay."""
    trace_steps: str | None = None
    """The steps it traces (text like "5" or "3-7"; None: all)."""
    resume_from: str | None = None
    """A framework's checkpoint (its copy in ``into``) to resume from; None: from scratch, or, for a
    ``samestep.Run``, the checkpoint in ``into``'s ``checkpoints/``."""
    watch: str | None = None
    """The verifier (``process_mark``): the replay ends with it. None: no watch."""

    def to_env(self) -> dict[str, str]:
        return {REPLAY_VAR: json.dumps(asdict(self), sort_keys=True)}

    @classmethod
    def from_env(cls) -> ReplayRequest | None:
        """The request this process runs under (None if none).

        Raises:
            ValueError: ``SAMESTEP_REPLAY`` holds something else than a request; names it.
        """
        text = os.environ.get(REPLAY_VAR)
        if not text:
            return None
        try:
            doc: Any = json.loads(text)
            return cls(**doc)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"{REPLAY_VAR}={text[:200]!r}: not a samestep replay request ({e}); unset it to run "
                "the program as it is"
            ) from None

    def redirects(self, run_dir: Path) -> bool:
        """Whether ``run_dir`` is the run replayed."""
        return Path(run_dir).resolve() == Path(self.run_dir).resolve()

    @classmethod
    def for_run(cls, run_dir: str | os.PathLike[str], who: str) -> ReplayRequest | None:
        """The request this process runs under, for ``who`` (a Run, a callback) writing ``run_dir``; None if none.

        Raises:
            ValueError: a request for another run directory (``who`` would write its own as the program does).
        """
        request = cls.from_env()
        if request is not None and not request.redirects(Path(run_dir)):
            raise ValueError(
                f"{who}({str(run_dir)!r}): this process replays {request.run_dir}, and a run of another "
                "run directory would write it as the run did; replay a program whose run is that one"
            )
        if request is not None and request.watch and not _watching:
            _watching.append(request.watch)
            threading.Thread(
                target=_watch, args=(request.watch, os.getppid()), daemon=True, name="samestep-replay-watch"
            ).start()
        return request

    @contextlib.contextmanager
    def refusing(self, *refusals: type[BaseException]) -> Iterator[None]:
        """Around a replayed resume's checks: one that raises one of ``refusals`` (its checkpoint is not the
        run's) leaves its message in ``into`` (``REFUSAL``) before it propagates; a rank whose checks passed
        while another's refused (``RefusedElsewhere``) leaves the file to the rank that says why."""
        from samestep.records.receipts import RefusedElsewhere

        try:
            yield
        except refusals as e:
            if not isinstance(e, RefusedElsewhere):
                Path(self.into).mkdir(parents=True, exist_ok=True)
                (Path(self.into) / REFUSAL).write_text(f"{type(e).__name__}: {e}\n", encoding="utf-8")
            raise

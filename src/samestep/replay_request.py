"""A replay request: how `samestep verify` and `samestep bisect` ask a program of one's own to run part of its
run again, with no change to the program (docs/formats.md).

The replay runs the recorded program (``program.relaunch``) with ``SAMESTEP_REPLAY`` set to this request, as
JSON. A ``samestep.Run`` whose run directory is the request's ``run_dir`` (the one the program names, which the
run replayed may be a copy of) then works in ``into`` instead (a
scratch directory that holds the run's checkpoint of the step it starts from, and its receipts up to it),
resumes there, traces as the request asks, keeps receipts, saves no checkpoint, and ends the process (exit
0) once step ``stop_after`` is receipted.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["REPLAY_VAR", "ReplayRequest"]

REPLAY_VAR = "SAMESTEP_REPLAY"


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
            raise ValueError(f"{REPLAY_VAR}={text[:200]!r}: not a samestep replay request ({e}); unset it to run "
                             "the program as it is") from None

    def redirects(self, run_dir: Path) -> bool:
        """Whether ``run_dir`` is the run replayed."""
        return Path(run_dir).resolve() == Path(self.run_dir).resolve()

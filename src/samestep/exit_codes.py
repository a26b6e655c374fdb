"""Every exit code a samestep command ends with, in one table: docs/debugging.md's "Exit codes" shows the same
codes (a test holds them together). A code has one meaning in every command, so a script can tell a verdict
from bad input from a crash."""

from __future__ import annotations

import os
import sys
import traceback

__all__ = [
    "DIFFERENCE",
    "FAULT",
    "INPUT_ERROR",
    "INTERNAL_ERROR",
    "INTERRUPTED",
    "MEANINGS",
    "NONFINITE",
    "OK",
    "PEER_LOST",
    "PREEMPTED",
    "Refusal",
    "RESUME_DIVERGED",
    "SIGNALLED",
]

OK = 0  # identical, holds, intact, complete, reproduced, trained
DIFFERENCE = 1  # a difference found: diverged, broken, corrupt, incomplete, not reproduced
INPUT_ERROR = 2  # bad input, named in one line with the fix
INTERNAL_ERROR = 3  # an unexpected error
FAULT = 4  # samestep train: a fault check stopped the run
NONFINITE = 5  # samestep train: a step's loss or gradient norm is not finite
PEER_LOST = 6  # samestep train: a collective lost another process of the job
RESUME_DIVERGED = 7  # a resumed run computed a step again to other bits than its receipt: it lost state
PREEMPTED = 75  # EX_TEMPFAIL: stopped on request with everything saved; a requeued job resumes
INTERRUPTED = 130  # interrupted (Ctrl-C outside a training step)
SIGNALLED = 128  # + N: stopped at once by signal N

MEANINGS = {
    OK: "done, and the same",
    DIFFERENCE: "a difference found",
    INPUT_ERROR: "bad input",
    INTERNAL_ERROR: "an unexpected error",
    FAULT: "a fault check stopped the run",
    NONFINITE: "a non-finite loss or gradient norm",
    PEER_LOST: "a collective lost another process",
    RESUME_DIVERGED: "a resume lost state: a step computed again differs from its receipt",
    PREEMPTED: "stopped after a step, with a checkpoint",
    INTERRUPTED: "interrupted",
}


class Refusal(SystemExit, ValueError):
    """What samestep raises to refuse bad input or a loop's mistake: a ``ValueError`` to a caller that catches it,
    and, left uncaught, the end of the program with one line on stderr (naming the file or field and the fix) and
    ``exit_code``, as samestep's commands report bad input, from a script as from the CLI. The interpreter reads
    ``code`` as an uncaught ``SystemExit`` ends the program: the line is printed then (``SAMESTEP_DEBUG=1``: the
    traceback)."""

    exit_code = INPUT_ERROR

    def __init__(self, *args: object) -> None:
        ValueError.__init__(self, *args)

    @property
    def code(self) -> int:  # type: ignore[override]
        if not getattr(self, "_said", False):  # once: a process's end may read the code more than once
            self._said = True
            if os.environ.get("SAMESTEP_DEBUG") == "1":
                traceback.print_exception(self)
            else:
                print(self, file=sys.stderr, flush=True)
        return self.exit_code

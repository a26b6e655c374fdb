"""Whether deterministic mode still holds what ``enable()`` set, looked at by the recorder at each step (and at
op level at each op): the first knob that no longer holds is recorded once, with a warning naming the line of
the user's loop, and run.json records it as ``determinism_changed`` (which ``samestep diff`` refuses)."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from samestep.determinism.mode import DeterminismReport, drifted, knob_probe

__all__ = ["KnobWatch"]


def _callers_level() -> int:
    """The ``stacklevel`` that makes a warning name the first frame outside samestep and contextlib: the line
    of the user's loop that opened the step, not a library's."""
    ours = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), contextlib.__file__.removesuffix(".py"))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(ours):
        frame, level = frame.f_back, level + 1
    return level


class KnobWatch:
    """The knobs of the ``enable()`` in force (``report``; None if none), checked cheaply by a probe and in
    full when it moved."""

    def __init__(self, report: DeterminismReport | None) -> None:
        self.report = report
        self.changed: dict[str, Any] | None = None  # the first step a knob no longer held, and which
        self._probe: tuple | None = None  # knob_probe() when the knobs were last checked

    def look(self, step: int, where: Callable[[], str] | None = None) -> None:
        """Whether the knobs enable() set still hold: the whole check at the first look, then whenever the
        cheap probe moved; once one no longer holds, never again (run.json records the first). ``where``
        names the op running now (op level looks at each, so a knob a forward flips and puts back is seen)."""
        if self.changed is not None:
            return
        probe = knob_probe()
        if probe != self._probe:
            self._probe = probe
            self._check(step, where)

    def _check(self, step: int, where: Callable[[], str] | None = None) -> None:
        changed = drifted(self.report)
        if changed:
            self.changed = {"step": step, "knobs": {name: list(v) for name, v in changed.items()}}
            inside = where() if where is not None else None
            if inside is not None:
                self.changed["inside"] = inside
            warnings.warn(
                f"samestep.trace: at step {step} deterministic mode no longer holds what enable() set ("
                + ", ".join(f"{name}: {a!r} -> {b!r}" for name, (a, b) in changed.items())
                + (f", while {inside} ran" if inside else "")
                + "); the run's numerics changed, and run.json records it",
                RuntimeWarning,
                stacklevel=_callers_level(),
            )

"""A trace driven by a framework's hooks: the recorder's step and microbatch contexts, opened in one hook
and closed in another, in the order the recorder expects."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

__all__ = ["HookedSteps"]


class HookedSteps:
    """Opens and closes ``Recorder.step`` and ``Recorder.microbatch`` from separate framework callbacks."""

    @classmethod
    def start(cls, run_dir: Path, *, level: str, steps: Any, resume: bool, model: Any, how_to_resume: str,
              ) -> HookedSteps:
        """Starts the trace of ``run_dir`` (a resume continues its stream) with the model's hooks attached.

        Raises:
            ValueError: ``run_dir`` holds a traced run and this is no resume: says ``how_to_resume``.
        """
        from samestep.tracing.start import trace

        try:
            rec = trace(run_dir, level=level, steps=steps, resume=resume)
        except ValueError as e:
            if "already holds a trace" not in str(e):
                raise
            raise ValueError(f"{run_dir} already holds a traced run; continue it with {how_to_resume}, or trace "
                             "into another run directory") from None
        rec.attach(model)
        return cls(rec)

    def __init__(self, rec: Any) -> None:
        self.rec = rec
        self.step: int | None = None
        self.microbatch: int | None = None
        self._step: contextlib.ExitStack | None = None
        self._mb: contextlib.ExitStack | None = None

    def begin_step(self, step: int) -> None:
        self.abort()
        self._step = contextlib.ExitStack()
        self._step.enter_context(self.rec.step(step))
        self.step = step

    def begin_microbatch(self, index: int) -> None:
        self.end_microbatch()
        if self._step is None:
            return
        self._mb = contextlib.ExitStack()
        self._mb.enter_context(self.rec.microbatch(index))
        self.microbatch = index

    def end_microbatch(self) -> None:
        mb, self._mb, self.microbatch = self._mb, None, None
        if mb is not None:
            mb.close()

    def end_step(self) -> None:
        """The step finished normally: its ``step.end`` record follows."""
        self.end_microbatch()
        st, self._step, self.step = self._step, None, None
        if st is not None:
            st.close()

    def abort(self) -> None:
        """A step left open (the framework raised or stopped inside it) ends as failed: no ``step.end``."""
        failed = RuntimeError("the framework left the step unfinished")
        for attr in ("_mb", "_step"):
            stack = getattr(self, attr)
            setattr(self, attr, None)
            if stack is not None:
                with contextlib.suppress(RuntimeError):
                    stack.__exit__(RuntimeError, failed, None)
        self.step = self.microbatch = None

    def close(self) -> None:
        """Ends a step left open as failed, then closes the trace."""
        try:
            self.abort()
        finally:
            self.rec.close()

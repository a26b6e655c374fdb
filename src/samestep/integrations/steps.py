"""A run driven by a framework's hooks: the RunProtocol's trace and receipts (``protocol.RunProtocol``) started when
training begins, and the recorder's step and microbatch contexts, opened in one hook and closed in another,
in the order the recorder expects."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from samestep.loop.protocol import RunProtocol
from samestep.loop.start_checks import declared_config, refuse_changes
from samestep.records.rundir import record_declared

__all__ = ["HookedSteps", "refuse_processes"]


def refuse_processes(world: int, who: str, multiprocess: bool) -> None:
    """Refuses a framework's run on several processes, before anything is written, unless the callback was told
    ``multiprocess=True``: its data-parallel wrapper (DDP) sums each step's gradients in the order its
    collective picks, so the bits are not one process's (samestep's canonical reduction is not in its path).

    Raises:
        ValueError: names the process count and the fixes.
    """
    if world > 1 and not multiprocess:
        raise ValueError(
            f"{who} on {world} processes: the Trainer's DDP all-reduce sums the gradients in an order "
            "its collective picks, so the bits are not one process's. Fix: run on one process; for "
            "several, a loop of one's own under samestep.Run with samestep.distributed."
            f"canonical_ddp_hook (examples/parallel_loop.py); or pass {who}(..., multiprocess=True) to "
            "record this process count's bits, which other counts do not repeat"
        )


class HookedSteps:
    """Opens and closes ``Recorder.step`` and ``Recorder.microbatch`` from separate framework callbacks, and
    has the RunProtocol write a receipt of every step that ends (``samestep.records.receipts``, the rank's file)."""

    @classmethod
    def start(
        cls,
        proto: RunProtocol,
        run_dir: Path,
        *,
        level: str,
        steps: Any,
        resume: bool,
        model: Any,
        how_to_resume: str,
        receipts: bool = False,
        start: int = 0,
        optimizer: Any = None,
        scheduler: Any = None,
        source: str = "",
        rank: int = 0,
        sharded: bool = False,
        program: dict[str, Any] | None = None,
        agree: Callable[[bool], bool] | None = None,
        config: dict[str, Any] | None = None,
    ) -> HookedSteps:
        """Starts the RunProtocol's trace of ``run_dir`` (a resume continues its stream) with the model's hooks
        attached, and, with ``receipts``, the receipts of the state of ``model``, ``optimizer`` and
        ``scheduler`` (``receipt_state.state_tree``): those past ``start`` (the step the framework resumed after,
        0 for a new run) are cut, and a resume whose restored state is not its receipt's is refused before
        anything is written; the optimizer's next step waits for the receipt being made. ``source``: what
        made the run (in the receipts' genesis). ``rank``: the receipts file's; ``sharded``: the model's
        parameters are this rank's shards (the receipts are of them). ``program``: what run.json's ``programs``
        records as running the steps after ``start`` (``program.describe``; a replay's, what it ran, checked
        against the run's; None: nothing, a rank that does not write run.json). ``agree``: where the job keeps
        receipts (on any of its ranks), ``agree.any_rank``, passed on every rank: each checks what it keeps (a
        rank that keeps none, nothing), and no rank writes a file before every rank has checked, a refusal on one
        being every rank's
        (``RunProtocol.check_receipts``); without it a rank that keeps none checks nothing and goes on.

        Raises:
            ValueError: ``run_dir`` holds a traced run and this is no resume: says ``how_to_resume``.
            ReceiptError: the receipts file is damaged or lacks a step up to ``start``, or the restored state
                is not the one its receipt of ``start`` records; under ``agree``, ``RefusedElsewhere`` where that
                was another rank's.
            Refusal: a resume under another ``config`` than the run's.
        """
        from samestep.distributed.placement import model_layout
        from samestep.hashing.checksums import state_hash_for
        from samestep.hashing.state import persistent_buffers
        from samestep.records.receipt_state import state_tree
        from samestep.records.receipts import genesis

        buffers = persistent_buffers(model)  # found once: a model gains or loses no buffer between steps

        def state(step: int) -> dict[str, Any]:
            return state_tree(step, model, optimizer, buffers=buffers, scheduler=scheduler)

        proto.run_dir = Path(run_dir)
        held = None if config is None else {"config": declared_config(config)}
        if held is not None:  # before anything is written
            refuse_changes(proto.run_dir, held, who=f"samestep ({source or 'a callback'})")
        if receipts or agree is not None:  # a resume that cannot go on fails before anything is written
            proto.check_receipts(rank, start, (lambda: state(start)) if receipts else None, agree=agree)
        try:
            proto.trace(model, level=level, steps=steps, resume=resume, layout=model_layout(model), resumed_from=start)
        except ValueError as e:
            if "already holds a trace" not in str(e):
                raise
            raise ValueError(
                f"{run_dir} already holds a traced run; continue it with {how_to_resume}, or trace "
                "into another run directory"
            ) from None
        try:
            if program is not None:  # what samestep verify and bisect run again
                from samestep.replay.program import record

                record(proto.run_dir, start, program)
                if held is not None:
                    record_declared(proto.run_dir, held)
            if receipts:
                proto.open_receipts(
                    rank,
                    start,
                    genesis({}, source),
                    optimizer=optimizer,
                    sharded=sharded,
                    state=lambda step: lambda tree=state(step): tree,
                    hash=state_hash_for(next((p.device for p in model.parameters()), "cpu")),
                )
        except BaseException:
            proto.end()
            raise
        return cls(proto)

    def __init__(self, proto: RunProtocol) -> None:
        self.proto = proto
        self.step: int | None = None
        self.microbatch: int | None = None
        self._step: contextlib.ExitStack | None = None
        self._mb: contextlib.ExitStack | None = None

    @property
    def rec(self) -> Any:
        """The RunProtocol's recorder (for the gradients, the state and the metrics the framework's hooks see)."""
        return self.proto.recorder

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

    def end_step(self, loss: float = math.nan, grad_norm: float = math.nan) -> None:
        """The step finished normally, its update made: its ``step.end`` record follows, and its receipt
        (the state after the update, taken now and checksummed on the receipt thread; the loss and grad
        norm bits where the framework gives them, NaN where not)."""
        self.end_microbatch()
        st, step, self._step, self.step = self._step, self.step, None, None
        if st is not None:
            st.close()
        if step is not None:
            self.proto.receipt(step, loss, grad_norm)

    def sync(self) -> None:
        """The trace and the receipts of every step so far, durable: right before the framework saves a
        checkpoint of them."""
        self.proto.sync()

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
        """Ends a step left open as failed, then closes the trace and the receipts (the RunProtocol goes on:
        deterministic mode stays as the framework's callback left it)."""
        try:
            self.abort()
        finally:
            self.proto.end()

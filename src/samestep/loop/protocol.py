"""The step protocol, in one place (docs/design.md, invariant 4 and "The step protocol"): ``RunProtocol`` owns one
process's part in a run, from deterministic mode on to the run directory released, and the rules every
loop keeps in the same order: the stop every rank agrees on after a step, and what is made durable before a
checkpoint commits. ``samestep train`` (train/loop.py), ``samestep.Run`` (loop/run.py) and the framework
callbacks (integrations/steps.py) drive it."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Generator
from pathlib import Path
from typing import IO, Any

from samestep.determinism import mode
from samestep.determinism.mode import DeterminismReport
from samestep.determinism.preempt import StopRequest
from samestep.distributed.agree import any_rank, most_of
from samestep.distributed.group import rank_and_world
from samestep.hashing.checksums import StepChecksums
from samestep.records.lock import hold
from samestep.records.receipt_writer import ReceiptWriter, continue_receipts
from samestep.records.receipts import (
    ReceiptError,
    RefusedElsewhere,
    check_restored,
    lost_receipts,
    read_run_receipts,
    truncate_receipts,
)
from samestep.records.resume_check import ResumeDiverged

__all__ = ["RunProtocol", "agreed_stop", "make_durable", "save_after_records"]


def agreed_stop(stop: StopRequest, any_rank: Callable[[bool], bool]) -> str | None:
    """Why the loop stops after the step it just finished, the same answer on every rank (a signal may
    reach one rank first): this rank's request (the signal's name), "a signal to another rank", or None to
    go on. Where ``stop`` watches signals this is a collective (``any_rank``): every rank calls it after
    the same steps."""
    if not stop.signals:
        return None
    mine = stop.requested
    if any_rank(mine is not None) and mine is None:
        return "a signal to another rank"
    return mine


def make_durable(recorder: Any = None, receipts: Any = None, metrics: IO[str] | None = None) -> None:
    """Makes the records of every step so far durable, as a checkpoint of them needs: the trace
    (``recorder.sync()``), then the receipts (``receipts.sync()``), then metrics.jsonl (fsync'ed; each line
    was flushed when written). A framework that saves its own checkpoints calls this right before."""
    if recorder is not None:
        recorder.sync()
    if receipts is not None:
        receipts.sync()
    if metrics is not None:
        os.fsync(metrics.fileno())


def save_after_records(
    save: Callable[[], Any], recorder: Any = None, receipts: Any = None, metrics: IO[str] | None = None
) -> None:
    """Saves a checkpoint (``save()``) after the records of every step it holds are durable
    (``make_durable``). A crash right after the commit then loses no record of a step the checkpoint
    holds, and a resume finds every file agreeing with it."""
    make_durable(recorder, receipts, metrics)
    save()


class RunProtocol:
    """One process's part in a run, in the protocol's order; each loop calls the parts it has.

    1. ``RunProtocol(run_dir, hold_dir=...)``: the run directory taken (one writer per run directory: another live
       writer is refused before anything); ``enable(...)``: deterministic mode on.
    2. ``check_receipts(...)``: a resume whose receipts cannot go on is refused before any file changes.
    3. ``trace(...)`` (or ``adopt``): the recorder; ``open_receipts(...)``: the receipts, continued after the
       step the run resumed from.
    4. Within ``watching(signals)``, after each step: ``receipt(step, ...)``, ``agreed_stop(any_rank)``,
       and ``save(...)`` (the trace, the receipts and metrics.jsonl durable, then the checkpoint).
    5. ``end()``: the trace, then the receipts, closed; ``close()``: that, deterministic mode off if this
       object turned it on, and the run directory released.

    ``run_dir`` may be set after the RunProtocol starts (a framework names it when training begins, after
    deterministic mode had to be on), before ``trace`` or ``open_receipts``.
    """

    def __init__(self, run_dir: str | os.PathLike[str] | None = None, *, hold_dir: bool = False) -> None:
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.report: DeterminismReport | None = None
        self.recorder: Any = None
        self.receipts: ReceiptWriter | None = None
        self.same_layout: bool | None = None  # whether the job splits tensors as the one that wrote its checkpoint
        self._settle: int | None = None  # the step after which every rank's check of a resume is agreed
        # one pass over each step's tensors for the receipts, the cross-rank check and the trace's state records
        self.checksums = StepChecksums()
        self.stop = StopRequest(())
        self._own_mode = False
        self._state: Callable[[int], Callable[[], Any]] | None = None
        self.lock = hold(self.run_dir) if hold_dir and self.run_dir is not None else None

    # -- 1. before anything --------------------------------------------------------------------------------
    def enable(
        self, *, threads: int | None = 1, kernels: bool = False, warn_only: bool = False, who: str = "this run"
    ) -> DeterminismReport:
        """Deterministic mode on (``samestep.enable``), turned off again at ``close``. Where this process has
        it on already with the same thread count and kernels, that one is used and left on.

        Raises:
            ValueError: it is on with another thread count or kernel routing (the bits depend on both);
                names both and the fix. Or ``enable`` refused a setting (its message).
        """
        active = mode.active_report()
        if active is None:
            self.report = mode.enable(threads=threads, kernels=kernels, warn_only=warn_only)
            self._own_mode = True
            return self.report
        want = mode.available_threads() if threads is None else threads
        routed = any(k.name == "samestep.kernels" and k.after for k in active.knobs)
        if (active.threads, routed) != (want, kernels):
            raise ValueError(
                f"{who}: deterministic mode is already on in this process with threads={active.threads}, "
                f"kernels={routed}, and {who} asks for threads={want}, kernels={kernels}: the bits "
                "depend on both; ask for the same, or call samestep.disable() first"
            )
        self.report = active
        return active

    # -- 2. before any file changes ------------------------------------------------------------------------
    def check_receipts(
        self,
        rank: int,
        start: int,
        state: Callable[[], Any] | None,
        *,
        checkpoint: Any = None,
        sharded_over: int | None = None,
        same_layout: bool | None = None,
        agree: Callable[[bool], bool] | None = None,
    ) -> None:
        """What going on after step ``start`` needs of the receipts, checked before any file changes. Where this
        rank keeps receipts (``state`` makes the restored state tree they checksum; None: it keeps none),
        their chain whole up to ``start``. Then the restored state against the run's receipts of ``start``:
        where this job has the layout that wrote ``checkpoint`` (a ``LoadedCheckpoint``; whole, or sharded
        over ``sharded_over`` ranks), each rank's restored state against its own receipt; where it has
        another (the receipts are of other shards), rank 0 checks the checkpoint's files against the
        receipts of every rank that wrote them. ``same_layout``: whether this job splits tensors as the one
        that wrote ``checkpoint`` did (None: where both split them over as many ranks; a caller that knows the
        placements says, as the same count may split them otherwise). ``agree``: where the job has several
        processes, ``any_rank`` (a collective every rank calls, keeping receipts or not): no rank goes on to
        write before every rank has checked (rank 0 may be reading the files of ranks that are about to start
        theirs), and a refusal on one rank is every rank's.

        Raises:
            ReceiptError: names the file, the step and what to do; under ``agree``, on the ranks that refused
                nothing themselves, ``RefusedElsewhere``: that another rank refused.
        """
        run_dir = self._dir("check_receipts")
        try:
            self._check_receipts(run_dir, rank, start, state, checkpoint, sharded_over, same_layout)
        except BaseException:
            if agree is not None:
                agree(True)
            raise
        if agree is not None and agree(False):
            raise RefusedElsewhere(
                f"{run_dir}: another rank refused this resume (its error names the file and the "
                "fix); nothing was written"
            )

    def _check_receipts(
        self,
        run_dir: Path,
        rank: int,
        start: int,
        state: Callable[[], Any] | None,
        checkpoint: Any,
        sharded_over: int | None,
        same_layout: bool | None,
    ) -> None:
        if state is not None:
            truncate_receipts(run_dir, rank, start, check_only=True)
        if not start:
            return
        if same_layout is None:
            same_layout = checkpoint is None or checkpoint.shards == sharded_over
        self.same_layout = same_layout
        if state is not None and same_layout:
            lost_receipts(run_dir, rank, start)
        if checkpoint is None or same_layout:
            if state is not None:
                check_restored(run_dir, rank, start, state())
        elif rank == 0:
            from samestep.analysis.receipt_check import checkpoint_mismatches

            chains = read_run_receipts(run_dir)
            if not any(r["step"] == start for _, receipts in chains.values() for r in receipts):
                return  # nothing to compare (a run without receipts), as check_restored
            problems = checkpoint_mismatches(run_dir, checkpoint.path, chains, None)
            if problems:
                raise ReceiptError(f"{problems[0]}; restore it, or resume from an older checkpoint")

    # -- 3. the records ------------------------------------------------------------------------------------
    def trace(self, model: Any = None, **kwargs: Any) -> Any:
        """Starts the trace of the run directory (``samestep.trace``, with ``kwargs``; the RunProtocol's hold of
        the run directory passed on) and attaches its hooks to ``model``."""
        from samestep.tracing.start import trace

        self.recorder = trace(self._dir("trace"), held=self.lock, **kwargs)
        self.recorder.checksums = self.checksums
        if model is not None:
            self.recorder.attach(model)
        return self.recorder

    def adopt(self, recorder: Any) -> None:
        """A recorder the loop built itself (the reference trainer's, built with its model), flushed before each
        save and closed by ``end`` as one this RunProtocol started; its state records share the receipts' pass."""
        self.recorder = recorder
        recorder.checksums = self.checksums

    @staticmethod
    def keeps_receipts(rank: int, sharded: bool) -> bool:
        """Whether this rank keeps a receipts file: rank 0, of the whole state; under sharding every rank, of
        its own shards."""
        return rank == 0 or sharded

    def open_receipts(
        self,
        rank: int,
        start: int,
        first_prev: str,
        *,
        state: Callable[[int], Callable[[], Any]] | None,
        optimizer: Any = None,
        sharded: bool = False,
        keep_file: bool = True,
        hash: str | None = None,
        check_resume: bool | None = None,
    ) -> ReceiptWriter:
        """This rank's receipts of the steps after ``start`` (``receipt_writer.continue_receipts``; ``first_prev``: a
        new file's genesis; ``hash``: a new file's state hash; ``sharded``: of this rank's shards). ``state(step)``
        is called at each step's end and returns what makes the state tree on the receipt thread.
        ``optimizer``: its next ``step()`` waits for the receipt being made. Without ``keep_file`` a writer of
        no file (the cross-rank check's sums alone). ``check_resume``: the receipts a killed segment wrote after
        ``start`` are checked as the steps are computed again (``records.resume_check``); None: where deterministic
        mode is on (a run not deterministic may compute a step again to other bits). Receipts of shards (every
        rank its own) are checked on the layout that wrote them, and held back until every rank's check of the
        last step computed again passed (a rank whose check passed must not write what another's refused)."""
        kind: dict[str, Any] = {"state_of": "rank" if sharded else "run", "shared": self.checksums} | (
            {"hash": hash} if hash else {}
        )
        check = (mode.is_enabled() if check_resume is None else check_resume) and (
            not sharded or self.same_layout is True
        )
        self.receipts = continue_receipts(
            self._dir("open_receipts") if keep_file else None, rank, start, first_prev, check=check, **kind
        )
        if check and sharded and rank_and_world()[1] > 1:
            # every rank its own shards' receipts: none writes a receipt of a step computed again before every
            # rank's check of the last such step passed (``_settle_resume``)
            settle = most_of(self.receipts.last_pending)
            if settle > start:
                self.receipts.hold_until = self._settle = settle
        self._state = state
        if optimizer is not None:
            self.receipts.watch(optimizer)
        return self.receipts

    def receipt_holds(self, step: int) -> bool | None:
        """Whether the state now is the one this rank's receipt of ``step`` (the newest) records: something may
        have changed it since (a framework's callback after samestep's, before the framework saves it). None:
        this rank keeps no receipt of that step."""
        receipts = self.receipts
        if receipts is None or receipts.path is None or self._state is None or receipts.last_step != step:
            return None
        receipts.wait()
        if receipts.last_state is None:
            return None
        from samestep.hashing.checksums import state_checksum
        from samestep.records.receipts import local_tree

        return state_checksum(local_tree(self._state(step)()), receipts.hash) == receipts.last_state

    # -- 4. after each step --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def watching(self, signals: tuple[str, ...]) -> Generator[StopRequest, None, None]:
        """While inside, ``signals`` ask the loop to stop at the next step boundary (``preempt.StopRequest``)."""
        self.stop = StopRequest(signals)
        with self.stop:
            yield self.stop

    def receipt(self, step: int, loss: float = math.nan, grad_norm: float = math.nan, sums: Any = None) -> None:
        """The receipt of ``step``, its update made: the state after it (``open_receipts``'s ``state``, taken now),
        the loss and gradient norm bits (NaN where the loop gives none), and the cross-rank check's ``sums``."""
        if self.receipts is None:
            return
        state = self._state(step) if self._state is not None and self.receipts.path else None
        self.receipts.add(step, state, loss, grad_norm, sums)
        if self._settle == step:
            self._settle = None
            self._settle_resume(step)

    def _settle_resume(self, step: int) -> None:
        """Every rank's check of the steps a resume computed again, agreed at the last of them (a collective):
        where any rank's differed, every rank stops (``ResumeDiverged``) with nothing written; else each writes
        the receipts it held back."""
        error: ResumeDiverged | None = None
        try:
            self.receipts.wait()
        except ResumeDiverged as e:
            error = e
        if any_rank(error is not None):
            raise error or ResumeDiverged(
                f"{self.receipts.path}: another rank's resume computed a step again to other bits than its "
                f"receipt (its line names the step); no rank wrote a receipt of steps up to {step}",
                step,
                self.receipts.path,
            )
        self.receipts.release()

    def agreed_stop(self, any_rank: Callable[[bool], bool]) -> str | None:
        """``agreed_stop`` for the signals being watched (a collective where there are any)."""
        return agreed_stop(self.stop, any_rank)

    def sync(self, metrics: IO[str] | None = None) -> None:
        """The trace, the receipts and ``metrics`` of every step so far durable (``make_durable``)."""
        make_durable(self.recorder, self.receipts, metrics)

    def save(self, save: Callable[[], Any], metrics: IO[str] | None = None) -> None:
        """``save()`` (a checkpoint) after ``sync(metrics)`` (``save_after_records``)."""
        save_after_records(save, self.recorder, self.receipts, metrics)

    # -- 5. the end ----------------------------------------------------------------------------------------
    def end(self) -> None:
        """Closes the trace, then the receipts (the last receipt written); a second call does nothing."""
        recorder, self.recorder = self.recorder, None
        receipts, self.receipts = self.receipts, None
        try:
            if recorder is not None:
                recorder.close()
        finally:
            if receipts is not None:
                receipts.close()

    def close(self) -> None:
        """``end()``, then deterministic mode off if this RunProtocol turned it on, and the run directory
        released."""
        try:
            self.end()
        finally:
            if self._own_mode and mode.is_enabled():
                mode.disable()
            self._own_mode = False
            lock, self.lock = self.lock, None
            if lock is not None:
                lock.release()

    def _dir(self, what: str) -> Path:
        if self.run_dir is None:
            raise RuntimeError(f"RunProtocol.{what}: it has no run directory yet; set run_dir first")
        return self.run_dir

"""The step protocol's rules that every loop keeps in the same order (docs/design.md, invariant 4): the
stop every rank agrees on after a step, and what is made durable before a checkpoint commits.
``samestep train`` (train/loop.py), ``samestep.Run`` (run.py) and the framework callbacks
(integrations/steps.py) follow them from here."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO, Any

from samestep.preempt import StopRequest

__all__ = ["agreed_stop", "make_durable", "save_after_records"]


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


def save_after_records(save: Callable[[], Any], recorder: Any = None, receipts: Any = None,
                       metrics: IO[str] | None = None) -> None:
    """Saves a checkpoint (``save()``) after the records of every step it holds are durable
    (``make_durable``). A crash right after the commit then loses no record of a step the checkpoint
    holds, and a resume finds every file agreeing with it."""
    make_durable(recorder, receipts, metrics)
    save()

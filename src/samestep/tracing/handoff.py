"""The recorder's digest worker, handed each flush's batch: at most one batch in flight, the stream opened at
the first flush (a resumed run's a new segment), and a tensor digested without a copy that was changed in
place before its digest was done refused, on the training thread, after the worker finished (so whether it
raises depends only on what the training code did, never on the worker's timing)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from samestep.tracing.process_worker import ProcessWorker
from samestep.tracing.staging import Staging
from samestep.tracing.stream import stream_path, stream_segments
from samestep.tracing.thread_worker import ThreadWorker

__all__ = ["Handoff"]


class Handoff:
    """This rank's worker (``kind``: "thread" or "process") and its stream in ``run_dir``."""

    def __init__(self, run_dir: Path, rank: int, meta: dict[str, Any], kind: str, staging: Staging) -> None:
        self.run_dir, self.rank, self._meta, self.kind, self._staging = run_dir, rank, meta, kind, staging
        # what a gradient changed in place after rec.grads() is reported as (None: the recorder's own words)
        self.grads_changed: Callable[[int, str], Exception | None] = lambda step, name: None
        self._writing = False  # the stream is opened at the first flush: nothing is written before
        self._inflight: Any = None  # the batch the worker is digesting
        self._worker: ThreadWorker | ProcessWorker | None = None

    @property
    def worker(self) -> ThreadWorker | ProcessWorker | None:
        """The worker, once started."""
        return self._worker

    @property
    def in_process(self) -> bool:
        """Whether the worker is a child process (it reads tensors where they lie from their descriptions)."""
        return isinstance(self._worker, ProcessWorker)

    def start(self) -> None:
        """Starts the worker (the process worker at the recorder's start: its imports overlap the first step)."""
        if self.kind == "process":
            try:
                self._worker = ProcessWorker()
            except OSError as e:
                raise RuntimeError(f"trace.worker=process: {e}") from None
        else:
            self._worker = ThreadWorker()

    def send(self, batch: Any) -> None:
        """Hands a flush's batch to the worker (started at the first one; the stream opened then)."""
        if self._worker is None:
            # Staged copies are never written again, and digests are exact integer arithmetic, so a worker
            # can digest them while the training thread runs the next step.
            self.start()
        if not self._writing:  # a new segment: a resumed run never overwrites the earlier stream
            path = stream_path(self.run_dir, self.rank, len(stream_segments(self.run_dir, self.rank)))
            self._worker.open(path, self._meta)
            self._writing = True
        self._inflight = batch
        # On a GPU, the worker's kernels run on its own thread's current stream: they start after
        # everything the training thread has queued so far (the copies, the values recorded) is done.
        events = []
        # without CUDA started, no tensor is on a GPU (and listing the devices is not free)
        for device in batch.devices() if torch.cuda.is_initialized() else ():
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                events.append((device, event))
        self._worker.submit(batch, events)

    def sync(self) -> None:
        """Makes every record of the steps closed so far durable: written and fsync'ed. Call it before
        a checkpoint commits (``samestep train`` does), so a crash right after the commit cannot lose
        the trace of a step the checkpoint holds."""
        self.wait()
        if self._worker is not None and self._writing:
            self._worker.sync()

    def wait(self) -> None:
        """Waits for the batch in flight, writes it (if nothing it read without a copy changed) and frees it."""
        batch, self._inflight = self._inflight, None
        if batch is not None:
            try:
                # Re-raises a failure of the worker here, in the training thread. The batch is written only
                # if no tensor digested without a copy was changed in place before its digest was done.
                self._worker.wait()
                changed = batch.changed()
                self._worker.commit(not changed)
            finally:
                self._staging.free(batch.packs)
            self._refuse(batch, changed)

    def _refuse(self, batch: Any, changed: list[int]) -> None:
        """Raises for the first tensor digested without a copy that was changed in place before its digest
        was done.

        The check runs on the training thread after the worker has finished, so whether it raises depends
        only on what the training code did before this point, never on the worker's timing.
        """
        if changed:
            k = changed[0]
            live, version, i = batch.check_live[k], batch.check_version[k], batch.check_record[k]
            step, mb, phase, scope, op, occurrence = (
                batch.step[i],
                batch.mb[i],
                batch.phase[i],
                batch.scope[i],
                batch.op[i],
                batch.occ[i],
            )
            if phase == "step" and op == "grad" and (error := self.grads_changed(step, scope)) is not None:
                raise error
            fix = (
                "call rec.grads() where the gradients are final (after clipping, or clip out of place), or "
                "rec.grads(..., copy=True)"
                if phase == "step" and op == "grad"
                else "record copies instead (trace.copy=true, or samestep.trace(..., copy=True))"
            )
            raise RuntimeError(
                f"trace: the tensor of record step={step} microbatch={mb} phase={phase} scope={scope!r} "
                f"op={op!r} occurrence={occurrence} was changed in place after it was recorded (version "
                f"{version} -> {live._version}), so its digest may not be of the recorded value; {fix}"
            )

    def close(self) -> None:
        """Drops what is in flight and closes the worker (the recorder flushed and waited first)."""
        self._inflight = None
        worker, self._worker = self._worker, None
        self._staging.drop_chunks()
        self._writing = False
        if worker is not None:
            worker.close()

"""The thread worker: digests a flushed batch on a second thread of the training process, any device.

Its Python code (a few hundred operations per batch) takes the interpreter lock from the training
thread; on Linux CPU the process worker spares the training thread that (see process_worker.py).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from samestep.tracing.batch import Batch, expand
from samestep.tracing.stream import StreamWriter
from samestep.tracing.writer import batch_lanes, state_digests, write_lanes

__all__ = ["ThreadWorker"]


class ThreadWorker:
    """Digests on a second thread of this process (any device)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="samestep-trace")
        self._writer: StreamWriter | None = None
        self._pending: Future | None = None
        self._held: tuple | None = None  # a digested batch with checked live tensors, until commit

    def open(self, path: Path, meta: dict[str, Any]) -> None:
        self._writer = StreamWriter(path, meta)

    def submit(self, b: Batch, events: list[tuple[torch.device, Any]]) -> None:
        self._pending = self._pool.submit(self._run, b, events)

    def _run(self, b: Batch, events: list[tuple[torch.device, Any]]) -> None:
        for device, event in events:  # kernels on this thread's stream start after the staged copies
            torch.cuda.current_stream(device).wait_event(event)
        done = (b, [len(pack.nbytes) for pack in b.packs], batch_lanes(b.packs, expand(b.tensors)), state_digests(b))
        if b.check_live:  # written once the training thread has seen them unchanged (commit), as the process does
            self._held = done
        else:
            write_lanes(self._writer, *done)

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # re-raises a failure of the worker here, in the training thread

    def commit(self, write: bool) -> None:
        """A digested batch holding live tensors is written (on this thread: the next ``wait`` waits for
        it) if ``write`` (they did not change before they were digested), else discarded."""
        held, self._held = self._held, None
        if held is not None and write:
            self._pending = self._pool.submit(write_lanes, self._writer, *held)

    def sync(self) -> None:
        """Waits for every batch submitted and committed so far to be written, then makes it durable."""
        self.wait()
        if self._writer is not None:
            self._writer.sync()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown()
            if self._writer is not None:
                self._writer.close()
                self._writer = None

"""The receipt thread: after each step's update, the state checksum of the step (on a thread of its own, the
optimizer's next step waiting for it), the loss and gradient norm bits, chained by hash and appended to this
rank's receipts file (the format: ``records/receipts.py``); and the cross-rank check's sums."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from samestep.hashing.checksums import STATE_HASH, STATE_HASHES, Checksums, StepChecksums, state_checksum
from samestep.records.durable import replace_atomic
from samestep.records.receipts import (
    RECEIPTS_FORMAT,
    RECEIPTS_VERSION,
    ReceiptError,
    local_tree,
    read_header,
    receipt_hash,
    receipts_path,
    state_hash_of,
    truncate_receipts,
)
from samestep.records.resume_check import ResumeDiverged, diverged, receipts_after

__all__ = ["CrossRankSums", "ReceiptWriter", "continue_receipts"]


@dataclass(slots=True)
class CrossRankSums:
    """Checksums of one step's tensors for the cross-rank check, by group ("grads", "params") and name
    (``checksums.Checksums``, the pass the step's receipt shares)."""

    step: int
    sums: dict[str, dict[str, str]] = field(default_factory=dict)
    digest: bytes = b""  # SHA-256 of the sums' JSON: what the ranks compare

    def __post_init__(self) -> None:
        self.digest = hashlib.sha256(json.dumps(self.sums).encode()).digest()


class ReceiptWriter:
    """Appends this rank's receipts; see the module docstring.

    ``add`` is called after each step's update with a function that returns the state tree (called on the
    receipt thread) and the step's loss and grad norm. The optimizer's next ``step()`` waits for the
    previous receipt (``watch``), and ``sync`` makes every receipt so far durable (before a checkpoint
    commits). A failure of the thread is raised on the training thread at the next wait. Without
    ``run_dir`` no receipt is made or written: the thread makes the cross-rank check's ``last`` sums alone (a
    rank that keeps no receipts). ``hash``: the state hash of a new file (``checksums.state_hash_for`` the
    state's device) and of the sums (every rank's alike); a file that exists keeps its own, and its version.
    ``shared``: where each step's pass over the tensors is shared with the trace's state records.
    ``pending``: the receipts after ``start`` the file holds already (a killed segment's,
    ``resume_check.receipts_after``): each step's receipt is checked against its old one instead of written,
    and the first that differs is raised (``ResumeDiverged``) with the file unchanged.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None,
        rank: int,
        first_prev: str,
        *,
        state_of: str = "run",
        start: int = 0,
        hash: str = STATE_HASH,
        shared: StepChecksums | None = None,
        pending: list[dict[str, Any]] | None = None,
    ) -> None:
        self.path = receipts_path(run_dir, rank) if run_dir is not None else None
        self._file = None
        self.hash, self.sums_hash, self.version, self.state_of = hash, hash, RECEIPTS_VERSION, state_of
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not self.path.exists() or self.path.stat().st_size == 0
            if not fresh:  # a resumed run goes on in its file's format and hash
                header = read_header(self.path)
                self.hash, self.version = state_hash_of(header), header["version"]
            if fresh:  # durable now: a run killed before its first checkpoint must still read as a run
                # start: the step before its first receipt, where a rank joins a run resumed on more processes.
                # Whole or absent: another process may be reading the run's receipts files as this one starts.
                replace_atomic(
                    self.path,
                    (
                        json.dumps(
                            {
                                "format": RECEIPTS_FORMAT,
                                "version": RECEIPTS_VERSION,
                                "rank": rank,
                                "state_hash": hash,
                                "genesis": first_prev,
                                **({"start": start} if start else {}),
                            },
                            sort_keys=True,
                        )
                        + "\n"
                    ).encode("utf-8"),
                )
            self._file = open(self.path, "a", encoding="utf-8")
        if hash not in STATE_HASHES:  # a file's own was checked as it was read
            raise ReceiptError(f"{self.path}: state hash {hash!r} is not one of {', '.join(STATE_HASHES)}")
        self.shared = shared if shared is not None else StepChecksums()
        self.prev, self.last_step, self.start = first_prev, start, start
        self._pending = {r["step"]: r for r in pending or ()}
        self._last_pending = max(self._pending, default=start)
        self._diverged: ResumeDiverged | None = None  # once set, nothing more is written
        self.hold_until = start  # new receipts of steps up to this one kept in memory until ``release``
        self._held: list[str] = []
        self.last: CrossRankSums | None = None  # of the newest step given ``sums`` (read after ``wait``)
        self.last_state: str | None = None  # the newest receipt's state checksum (read after ``wait``)
        self.cpu_seconds = 0.0  # the receipt thread's CPU time, all steps: what the receipts take from the machine
        self._error: BaseException | None = None
        self._hooks: list[Any] = []
        # One thread for the writer's life, fed one step at a time: starting a thread a step costs more.
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._serve, name="samestep-receipts", daemon=True)
        self._thread.start()

    def watch(self, optimizer: Any) -> None:
        """Makes ``optimizer.step()`` wait for the receipt being made: it changes the state that receipt reads."""
        self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self.wait()))

    def add(
        self,
        step: int,
        state: Callable[[], Any] | None,
        loss: float,
        grad_norm: float,
        sums: dict[str, list[tuple[str, Any]]] | None = None,
    ) -> None:
        """Starts the receipt of ``step``: ``state()`` is called and checksummed on the receipt thread (a writer
        without a file takes None), and the tensors of ``sums`` (groups of named tensors that stay unchanged
        until the next wait) are checksummed for ``last``."""
        self.wait()
        if step != self.last_step + 1:
            raise ReceiptError(
                f"{self.path}: receipt of step {step} follows step {self.last_step}; steps are "
                "receipted in order, one each"
            )
        self.last_step = step
        self._idle.clear()
        fields = {"step": step, "loss_hex": float(loss).hex(), "grad_norm_hex": float(grad_norm).hex()}
        self._jobs.put((fields, state, sums))

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fields, state, sums = job
            began = time.thread_time()
            try:
                memo = self.shared.of_step(fields["step"], self.hash)  # one pass over the step's tensors
                if sums is not None:
                    of = memo if self.sums_hash == self.hash else Checksums(self.sums_hash)  # a version-1 file's
                    self.last = CrossRankSums(
                        fields["step"],
                        {group: of.named([(n, local_tree(t)) for n, t in named]) for group, named in sums.items()},
                    )
                if self._file is not None:
                    receipt = {
                        **fields,
                        "state": state_checksum(local_tree(state()), self.hash, memo),
                        "prev": self.prev,
                    }
                    if self.version >= 2:
                        receipt["state_of"] = self.state_of
                    receipt["hash"] = receipt_hash(receipt)
                    self._keep(receipt)
                    self.prev, self.last_state = receipt["hash"], receipt["state"]
            except BaseException as e:  # raised on the training thread at the next wait
                self._error = e
            finally:
                self.cpu_seconds += time.thread_time() - began
                self._idle.set()

    def _keep(self, receipt: dict[str, Any]) -> None:
        """Writes ``receipt``, or checks it against the file's old receipt of its step (a resume's recomputed
        step); flushed to the OS at once, so a killed process leaves the receipts of the steps it finished."""
        if self._diverged is not None:
            return
        old = self._pending.pop(receipt["step"], None)
        if old is not None:
            if old != receipt:
                self._diverged = diverged(self.path, self.start, old, receipt, self._last_pending)
                raise self._diverged
            return
        if receipt["step"] <= self.hold_until:
            self._held.append(json.dumps(receipt, sort_keys=True) + "\n")
            return
        self._file.write(json.dumps(receipt, sort_keys=True) + "\n")
        self._file.flush()

    @property
    def last_pending(self) -> int:
        """The last step whose old receipt this writer checks (its start where none)."""
        return self._last_pending

    def release(self) -> None:
        """Writes the receipts held back (``hold_until``): every rank's check of the steps computed again passed."""
        self.wait()
        if self._held and self._file is not None:
            self._file.write("".join(self._held))
            self._file.flush()
        self._held.clear()
        self.hold_until = self.start

    def wait(self) -> None:
        """Waits for the receipt being made; raises its failure, if it failed (a ``ResumeDiverged`` as itself)."""
        self._idle.wait()
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, ResumeDiverged):
                raise error
            raise RuntimeError(f"receipt of step {self.last_step} failed: {error}") from error

    def sync(self) -> None:
        """Every receipt so far, written and fsync'ed."""
        self.wait()
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        try:
            self.sync()
        finally:
            self._jobs.put(None)
            self._thread.join()
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            if self._file is not None:
                self._file.close()


def continue_receipts(
    run_dir: str | os.PathLike[str] | None,
    rank: int,
    start: int,
    first_prev: str,
    *,
    check: bool = True,
    state_of: str = "run",
    **kwargs: Any,
) -> ReceiptWriter:
    """This rank's receipt writer for a run that goes on after step ``start``; ``first_prev`` is a new file's
    genesis. The receipts of later steps a killed run wrote are kept and checked as the resume computes those
    steps again (``resume_check``); without ``check`` (a run not deterministic, or whose receipts are of other
    shards than this job's) they are cut, and the chain goes on from step ``start``. Without ``run_dir``, a
    writer of no file (``ReceiptWriter``). ``kwargs``: ``ReceiptWriter``'s (``hash``, ``state_of``,
    ``shared``)."""
    kwargs["state_of"] = state_of
    if run_dir is None:
        return ReceiptWriter(None, rank, first_prev, start=start, **kwargs)
    pending = receipts_after(run_dir, rank, start) if check else []
    if pending and not start and pending[0]["prev"] != first_prev:
        pending = []  # a run started afresh under another genesis (config, data): nothing of it to check
    if any(r.get("state_of", "run") != state_of for r in pending):
        pending = []  # receipts of a rank's shards, resumed as the whole state (or the reverse): not comparable
    if pending:
        truncate_receipts(run_dir, rank, pending[-1]["step"])  # a torn line after them, if any, cut
        return ReceiptWriter(run_dir, rank, pending[0]["prev"], start=start, pending=pending, **kwargs)
    prev = truncate_receipts(run_dir, rank, start)
    return ReceiptWriter(run_dir, rank, prev or first_prev, start=start, **kwargs)

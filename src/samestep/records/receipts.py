"""Receipts (format "samestep.receipts", version 2; docs/formats.md): one line per step, chained by hash.

    RUN/receipts/rank_00000.jsonl   a header line naming the state hash, then one receipt per step:
        {"step": 7, "state": <checksum>, "state_of": "run", "loss_hex": ..., "grad_norm_hex": ...,
         "prev": <hash>, "hash": <hash>}

``state`` is the state checksum (``checksums.state_checksum`` by the header's ``state_hash``) of the state
after the step's update: the parameters, optimizer state, data cursor and step, what final.json's
``state_checksum`` and a restored checkpoint are checksummed as; ``state_of`` says whether it is of the whole
state ("run") or of the writing rank's shards ("rank"). ``hash`` is SHA-256 over the receipt without it, so
each receipt vouches for every one before it and an edit anywhere breaks the chain from there on. The first
``prev`` is the run's genesis: a digest of its config and data, so two runs of one config and data (on any
layout) have the same chain while they agree. Version 1 (``state``: the SHA-256 state digest, ``state_of`` in
the header) is read as version 2 with ``state_hash`` "sha256", and a run resumed on a version-1 file goes on
writing version 1.

The state is checksummed on a thread of its own while the next step's forward and backward run (they read
the parameters and the optimizer state, never change them); the optimizer's next ``step()`` waits for it (a
pre-hook), so the checksum is of the state as the receipt says. A forward may change the model's buffers
in place (running statistics): the receipt takes copies of them at the step's end (``buffers_now``).
Rank 0 writes receipts of the whole state; under sharding each rank writes those of its own shards
(``state_of: "rank"``). The cross-rank check's sums come from the same pass
(``checksums.Checksums``), and so do a step-level trace's state records where the writer and the recorder
share a ``checksums.StepChecksums`` (``protocol.RunProtocol`` hands them one): no tensor is hashed twice a
step.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from samestep.hashing.checksums import STATE_HASH, STATE_HASHES, Checksums, StepChecksums, state_checksum
from samestep.hashing.state import canonical_json, dotted
from samestep.records.durable import read_file, replace_atomic
from samestep.records.rundir import NUMERICS_NEUTRAL, receipts_dir

__all__ = ["RECEIPTS_FORMAT", "RECEIPTS_VERSION", "ReceiptError", "ReceiptWriter", "RefusedElsewhere", "StepSums",
           "chain_break", "check_restored", "continue_receipts", "genesis", "local_tree", "lost_receipts",
           "read_header", "read_receipts", "read_run_receipts", "receipt_hash", "receipts_path", "receipt_state_of",
           "state_hash_of", "truncate_receipts"]

RECEIPTS_FORMAT, RECEIPTS_VERSION = "samestep.receipts", 2


class ReceiptError(ValueError):
    """A receipts file is missing, malformed, or its chain is broken."""


class RefusedElsewhere(ReceiptError):
    """Another rank of the job refused a resume that this rank's own checks passed: the other rank's error names
    the file and the fix (``protocol.RunProtocol.check_receipts`` under ``agree``)."""


def receipts_path(run_dir: str | os.PathLike[str], rank: int = 0) -> Path:
    return receipts_dir(run_dir) / f"rank_{rank:05d}.jsonl"


def genesis(config: dict[str, Any], data_fingerprint: str) -> str:
    """The ``prev`` of a run's first receipt: its config, less the fields that change no bit (rundir's
    ``NUMERICS_NEUTRAL``: a traced replay of a run has the run's chain), and its data."""
    kept = {k: v for k, v in dotted(config).items() if k not in NUMERICS_NEUTRAL}
    return hashlib.sha256(canonical_json({"format": RECEIPTS_FORMAT, "config": kept,
                                          "data": data_fingerprint})).hexdigest()


def receipt_hash(receipt: dict[str, Any]) -> str:
    """SHA-256 over a receipt's canonical JSON without its ``hash``."""
    return hashlib.sha256(canonical_json({k: v for k, v in receipt.items() if k != "hash"})).hexdigest()


def local_tree(tree: Any) -> Any:
    """A state tree with each DTensor replaced by its local shard: checksumming one must not start a
    collective (the receipt thread joins none)."""
    if isinstance(tree, dict):
        return {k: local_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_tree(v) for v in tree)
    to_local = getattr(tree, "to_local", None)
    return to_local() if callable(to_local) else tree


@dataclass(slots=True)
class StepSums:
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
    """

    def __init__(self, run_dir: str | os.PathLike[str] | None, rank: int, first_prev: str, *,
                 state_of: str = "run", start: int = 0, hash: str = STATE_HASH,
                 shared: StepChecksums | None = None) -> None:
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
                replace_atomic(self.path, (json.dumps({"format": RECEIPTS_FORMAT, "version": RECEIPTS_VERSION,
                                                       "rank": rank, "state_hash": hash, "genesis": first_prev,
                                                       **({"start": start} if start else {})}, sort_keys=True)
                                           + "\n").encode("utf-8"))
            self._file = open(self.path, "a", encoding="utf-8")
        if hash not in STATE_HASHES:  # a file's own was checked as it was read
            raise ReceiptError(f"{self.path}: state hash {hash!r} is not one of {', '.join(STATE_HASHES)}")
        self.shared = shared if shared is not None else StepChecksums()
        self.prev, self.last_step = first_prev, start
        self.last: StepSums | None = None  # of the newest step given ``sums`` (read after ``wait``)
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

    def add(self, step: int, state: Callable[[], Any] | None, loss: float, grad_norm: float,
            sums: dict[str, list[tuple[str, Any]]] | None = None) -> None:
        """Starts the receipt of ``step``: ``state()`` is called and checksummed on the receipt thread (a writer
        without a file takes None), and the tensors of ``sums`` (groups of named tensors that stay unchanged
        until the next wait) are checksummed for ``last``."""
        self.wait()
        if step != self.last_step + 1:
            raise ReceiptError(f"{self.path}: receipt of step {step} follows step {self.last_step}; steps are "
                               "receipted in order, one each")
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
                    self.last = StepSums(fields["step"], {group: of.named([(n, local_tree(t)) for n, t in named])
                                                          for group, named in sums.items()})
                if self._file is not None:
                    receipt = {**fields, "state": state_checksum(local_tree(state()), self.hash, memo),
                               "prev": self.prev}
                    if self.version >= 2:
                        receipt["state_of"] = self.state_of
                    receipt["hash"] = receipt_hash(receipt)
                    self._file.write(json.dumps(receipt, sort_keys=True) + "\n")  # flushed by sync
                    self.prev, self.last_state = receipt["hash"], receipt["state"]
            except BaseException as e:  # raised on the training thread at the next wait
                self._error = e
            finally:
                self.cpu_seconds += time.thread_time() - began
                self._idle.set()

    def wait(self) -> None:
        """Waits for the receipt being made; raises its failure, if it failed."""
        self._idle.wait()
        if self._error is not None:
            error, self._error = self._error, None
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


def _text(path: Path, first_line: bool = False) -> str:
    try:
        return read_file(path, first_line).decode("utf-8")
    except FileNotFoundError:
        raise ReceiptError(f"{path}: missing; the run wrote no receipts (a run of samestep before receipts, or "
                           "not a samestep run directory)") from None
    except UnicodeDecodeError as e:
        raise ReceiptError(f"{path}: not UTF-8 text ({e})") from None


def _checked_header(path: Path, row: Any) -> dict[str, Any]:
    """A receipts file's first line, parsed, as this samestep reads it."""
    if not isinstance(row, dict) or row.get("format") != RECEIPTS_FORMAT:
        raise ReceiptError(f"{path}:1: not a receipts header (format {RECEIPTS_FORMAT!r})")
    version = row.get("version")
    if version not in (1, RECEIPTS_VERSION) or isinstance(version, bool):
        raise ReceiptError(f"{path}:1: receipts version {version!r}; this samestep reads versions 1 to "
                           f"{RECEIPTS_VERSION} (a newer samestep wrote it: read it with that one)")
    if version >= 2 and row.get("state_hash") not in STATE_HASHES:
        raise ReceiptError(f"{path}:1: state_hash {row.get('state_hash')!r} is not one of {', '.join(STATE_HASHES)}")
    return row


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A receipts file's header alone (its first line: the rest is not read).

    Raises:
        ReceiptError: as ``read_receipts`` for its first line.
    """
    path = Path(path)
    try:
        row = json.loads(_text(path, first_line=True))
    except json.JSONDecodeError:
        raise ReceiptError(f"{path}:1: not valid JSON") from None
    return _checked_header(path, row)


def read_receipts(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A receipts file's header and receipts, up to a torn last line of a killed run.

    Raises:
        ReceiptError: it is missing, of another format or version, or a line before the last is damaged,
            naming the file and line.
    """
    path = Path(path)
    lines = _text(path).splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and number > 1:
                break  # a torn last line of a killed run
            raise ReceiptError(f"{path}:{number}: not valid JSON; only the last line may be torn") from None
        if not isinstance(row, dict):
            raise ReceiptError(f"{path}:{number}: {line[:60]!r} is not a table")
        rows.append(row)
    header = _checked_header(path, rows[0] if rows else None)
    keys = ("step", "state", "loss_hex", "grad_norm_hex", "prev", "hash")
    keys += ("state_of",) if header["version"] >= 2 else ()
    for number, row in enumerate(rows[1:], 2):
        for key in keys:
            if key not in row:
                raise ReceiptError(f"{path}:{number}: receipt without {key!r}")
        step = row["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ReceiptError(f"{path}:{number}: step {step!r} is not a step number (an integer from 1): the file "
                               "was edited; restore it")
        bad = next((k for k in keys if k != "step" and not isinstance(row[k], str)), None)
        if bad is not None:
            raise ReceiptError(f"{path}:{number}: {bad} {row[bad]!r} is not a string: the file was edited; restore it")
    return header, rows[1:]


def state_hash_of(header: dict[str, Any]) -> str:
    """The hash a receipts file's ``state`` fields are made with (version 1: the SHA-256 state digest)."""
    return header.get("state_hash", "sha256") if header.get("version", 1) >= 2 else "sha256"


def receipt_state_of(header: dict[str, Any], receipt: dict[str, Any]) -> str:
    """What a receipt's ``state`` is of: "run" (the whole state) or "rank" (the writer's shards)."""
    return receipt.get("state_of", header.get("state_of", "run"))


def read_run_receipts(run_dir: str | os.PathLike[str]) -> dict[int, tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Every rank's receipts file of a run, each read once: ``{rank: (header, receipts)}`` in rank order
    (empty where the run wrote none).

    Raises:
        ReceiptError: a file is damaged (``read_receipts``), or its header names another rank than its name.
    """
    out = {}
    for path in sorted(receipts_dir(run_dir).glob("rank_*.jsonl")):
        rank = int(path.stem.removeprefix("rank_")) if path.stem.removeprefix("rank_").isdigit() else None
        header, receipts = read_receipts(path)
        if rank is None or header.get("rank") != rank:
            raise ReceiptError(f"{path}: its header says rank {header.get('rank')!r}; a receipts file is named "
                               f"rank_RRRRR.jsonl after the rank that wrote it (move it back, or remove it)")
        out[rank] = (header, receipts)
    return out


def chain_break(header: dict[str, Any], receipts: list[dict[str, Any]], first_prev: str | None = None) -> str | None:
    """Why the chain does not hold (None if it does): the first receipt whose ``prev`` is not the hash before
    it, whose ``hash`` is not its own, or whose step is not the one after. ``first_prev``: what the first
    receipt must follow (default: the header's genesis)."""
    prev = header.get("genesis") if first_prev is None else first_prev
    step = receipts[0]["step"] - 1 if receipts else 0
    for r in receipts:
        if r["step"] != step + 1:
            return f"step {r['step']} follows step {step}"
        if r["prev"] != prev:
            return f"step {r['step']}: prev {str(r['prev'])[:16]}... is not the hash before it ({str(prev)[:16]}...)"
        if receipt_hash(r) != r["hash"]:
            return f"step {r['step']}: its hash is not of its contents (the receipt was changed after it was written)"
        prev, step = r["hash"], r["step"]
    return None


def truncate_receipts(run_dir: str | os.PathLike[str], rank: int, last_step: int, *,
                      check_only: bool = False) -> str | None:
    """Keeps the receipts of steps <= last_step (a killed run may have written more, or a torn line); returns
    the hash of the last one kept (the header's genesis if none; None if there is no file, or ``last_step``
    is 0: a run resumed from no checkpoint starts its receipts afresh). ``check_only``: raise what it would
    raise, and change nothing (a resume checks every file before it writes any).

    Raises:
        ReceiptError: the file is damaged, its chain is broken, or it lacks a step up to ``last_step``.
    """
    path = receipts_path(run_dir, rank)
    if not path.exists():
        return None
    if last_step == 0:
        if not check_only:
            path.unlink()
        return None
    header, receipts = read_receipts(path)
    first = header.get("start", 0)  # a rank that joined the run at a resume on more processes starts after it
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise ReceiptError(f"{path}: its header's start is {first!r}, not a step; restore the file, or resume into "
                           "a new run directory")
    if first and last_step <= first:
        if not check_only:  # all of it is of a segment after the step resumed from, on more processes
            path.unlink()
        return None
    kept = [r for r in receipts if r["step"] <= last_step]
    why = chain_break(header, kept)
    if why is None and [r["step"] for r in kept] != list(range(first + 1, last_step + 1)):
        why = (f"holds steps {kept[0]['step'] if kept else '-'}..{kept[-1]['step'] if kept else '-'}, not "
               f"{first + 1}..{last_step}")
    if why is not None:
        raise ReceiptError(f"{path}: {why}; resuming would break the chain: restore the file, or resume into a new "
                           "run directory")
    if check_only:
        return kept[-1]["hash"] if kept else header["genesis"]
    replace_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in [header, *kept]).encode())
    return kept[-1]["hash"] if kept else header["genesis"]


def lost_receipts(run_dir: str | os.PathLike[str], rank: int, step: int) -> None:
    """Refuses to go on after ``step`` where ``rank``'s receipts file is missing though the run kept receipts
    then: rank 0's file (which every run that keeps receipts writes; for rank 0, the lowest other rank's) holds
    a receipt of ``step``. On the layout that wrote the checkpoint, every rank that keeps receipts now kept them
    then (receipts are on or off for the whole run), so its file was lost; starting it afresh at ``step + 1``
    would leave a chain that can never verify. One other file is read, whatever the rank count.

    Raises:
        ReceiptError: names the missing file, the file that shows it was kept and what to do.
    """
    path = receipts_path(run_dir, rank)
    if path.exists():
        return
    others = [receipts_path(run_dir, 0)] if rank else sorted(receipts_dir(run_dir).glob("rank_*.jsonl"))[:1]
    witness = others[0] if others else None
    if witness is None or not witness.exists():
        return
    try:
        _, receipts = read_receipts(witness)
    except ReceiptError:
        return  # its own check names it
    if any(r["step"] == step for r in receipts):
        raise ReceiptError(f"{path}: missing, though the run kept receipts at step {step} ({witness.name} holds "
                           f"that step's): restore the file, or resume into a new run directory")


def check_restored(run_dir: str | os.PathLike[str], rank: int, step: int, tree: Any) -> None:
    """Refuses a resume whose restored state is not what the run's own receipt of ``step`` records: a
    checkpoint edited after it was written (its manifest's digests recomputed), or another run's. The
    receipts are a chain a checkpoint cannot rewrite. Nothing to compare (no receipts, step 0, no receipt of
    that step: ``truncate_receipts`` names that) passes.

    Raises:
        ReceiptError: names the step, both digests and what to do.
    """
    path = receipts_path(run_dir, rank)
    if not step or not path.exists():
        return
    header, receipts = read_receipts(path)
    receipt = next((r for r in receipts if r["step"] == step), None)
    if receipt is None:
        return
    digest = state_checksum(local_tree(tree), state_hash_of(header))
    if digest != receipt["state"]:
        raise ReceiptError(f"the checkpoint of step {step} restores state {digest[:16]}..., but {path} records "
                           f"{receipt['state'][:16]}... for that step: the checkpoint was changed after it was "
                           "written, or is another run's; restore it, or resume from an older checkpoint")


def continue_receipts(run_dir: str | os.PathLike[str] | None, rank: int, start: int, first_prev: str,
                      **kwargs: Any) -> ReceiptWriter:
    """This rank's receipt writer for a run that goes on after step ``start``: the receipts of later steps (a
    killed run wrote them) cut, the chain continued from the last one kept; ``first_prev`` is a new file's
    genesis. Without ``run_dir``, a writer of no file (``ReceiptWriter``). ``kwargs``: ``ReceiptWriter``'s
    (``hash``, ``state_of``, ``shared``)."""
    prev = truncate_receipts(run_dir, rank, start) if run_dir is not None else None
    return ReceiptWriter(run_dir, rank, prev or first_prev, start=start, **kwargs)

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
from pathlib import Path
from typing import Any

from samestep.exit_codes import Refusal
from samestep.hashing.checksums import STATE_HASHES, state_checksum
from samestep.hashing.state import canonical_json, dotted
from samestep.records.durable import read_file, replace_atomic
from samestep.records.rundir import NUMERICS_NEUTRAL, receipts_dir

__all__ = [
    "RECEIPTS_FORMAT",
    "RECEIPTS_VERSION",
    "ReceiptError",
    "RefusedElsewhere",
    "chain_break",
    "check_restored",
    "genesis",
    "local_tree",
    "lost_receipts",
    "read_header",
    "read_receipts",
    "read_run_receipts",
    "receipt_hash",
    "receipt_state_of",
    "receipts_path",
    "state_hash_of",
    "truncate_receipts",
]

RECEIPTS_FORMAT, RECEIPTS_VERSION = "samestep.receipts", 2


class ReceiptError(Refusal):
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
    return hashlib.sha256(
        canonical_json({"format": RECEIPTS_FORMAT, "config": kept, "data": data_fingerprint})
    ).hexdigest()


def receipt_hash(receipt: dict[str, Any]) -> str:
    """SHA-256 over a receipt's canonical JSON without its ``hash``."""
    return hashlib.sha256(canonical_json({k: v for k, v in receipt.items() if k != "hash"})).hexdigest()


def _text(path: Path, first_line: bool = False) -> str:
    try:
        return read_file(path, first_line).decode("utf-8")
    except FileNotFoundError:
        raise ReceiptError(
            f"{path}: missing; the run wrote no receipts (a run of samestep before receipts, or "
            "not a samestep run directory)"
        ) from None
    except UnicodeDecodeError as e:
        raise ReceiptError(f"{path}: not UTF-8 text ({e})") from None


def _checked_header(path: Path, row: Any) -> dict[str, Any]:
    """A receipts file's first line, parsed, as this samestep reads it."""
    if not isinstance(row, dict) or row.get("format") != RECEIPTS_FORMAT:
        raise ReceiptError(f"{path}:1: not a receipts header (format {RECEIPTS_FORMAT!r})")
    version = row.get("version")
    if version not in (1, RECEIPTS_VERSION) or isinstance(version, bool):
        raise ReceiptError(
            f"{path}:1: receipts version {version!r}; this samestep reads versions 1 to "
            f"{RECEIPTS_VERSION} (a newer samestep wrote it: read it with that one)"
        )
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
            raise ReceiptError(
                f"{path}:{number}: step {step!r} is not a step number (an integer from 1): the file "
                "was edited; restore it"
            )
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
            raise ReceiptError(
                f"{path}: its header says rank {header.get('rank')!r}; a receipts file is named "
                f"rank_RRRRR.jsonl after the rank that wrote it (move it back, or remove it)"
            )
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


def truncate_receipts(
    run_dir: str | os.PathLike[str], rank: int, last_step: int, *, check_only: bool = False
) -> str | None:
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
        raise ReceiptError(
            f"{path}: its header's start is {first!r}, not a step; restore the file, or resume into a new run directory"
        )
    if first and last_step <= first:
        if not check_only:  # all of it is of a segment after the step resumed from, on more processes
            path.unlink()
        return None
    kept = [r for r in receipts if r["step"] <= last_step]
    why = chain_break(header, kept)
    if why is None and [r["step"] for r in kept] != list(range(first + 1, last_step + 1)):
        why = (
            f"holds steps {kept[0]['step'] if kept else '-'}..{kept[-1]['step'] if kept else '-'}, not "
            f"{first + 1}..{last_step}"
        )
    if why is not None:
        raise ReceiptError(
            f"{path}: {why}; resuming would break the chain: restore the file, or resume into a new run directory"
        )
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
        raise ReceiptError(
            f"{path}: missing, though the run kept receipts at step {step} ({witness.name} holds "
            f"that step's): restore the file, or resume into a new run directory"
        )


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
        raise ReceiptError(
            f"the checkpoint of step {step} restores state {digest[:16]}..., but {path} records "
            f"{receipt['state'][:16]}... for that step: the checkpoint was changed after it was "
            "written, or is another run's; restore it, or resume from an older checkpoint"
        )


def local_tree(tree: Any) -> Any:
    """A state tree with each DTensor replaced by its local shard: checksumming one must not start a
    collective (the receipt thread joins none)."""
    if isinstance(tree, dict):
        return {k: local_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_tree(v) for v in tree)
    to_local = getattr(tree, "to_local", None)
    return to_local() if callable(to_local) else tree

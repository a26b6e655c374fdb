"""final.json (format "samestep.final", version 1; docs/formats.md): what a finished run ends with, its last
step and the digest of its final state, written atomically and read by diff, verify and the demo."""

from __future__ import annotations

import json
from typing import Any

from samestep.records.durable import read_file, replace_atomic
from samestep.records.rundir import PathLike, RunDirError, check_version, final_path

__all__ = ["FINAL_FORMAT", "FINAL_VERSION", "final_digest", "final_doc", "read_final", "write_final"]


FINAL_FORMAT, FINAL_VERSION = "samestep.final", 1


def final_doc(
    step: int,
    state_digest: str,
    loss: float,
    world_size: int,
    state_checksum: dict[str, str] | None = None,
    whole: bool = False,
) -> dict[str, Any]:
    """final.json's contents: the last step, the final state digest (SHA-256), the last loss bits, the world
    size, and the final state's checksum by the receipts' hash (``{hash: value}``; none without receipts).
    ``whole``: the digest is of the whole state as one process holds and names it (``samestep.Run``'s: shards
    gathered, a DDP wrapper's names unwrapped), which its receipts' state need not be."""
    doc = {
        "format": FINAL_FORMAT,
        "version": FINAL_VERSION,
        "step": step,
        "state_digest": state_digest,
        "loss_hex": loss.hex(),
        "world_size": world_size,
    }
    if state_checksum:
        doc["state_checksum"] = state_checksum
    if whole:
        doc["state_digest_of"] = "whole"
    return doc


def write_final(run_dir: PathLike, final: dict[str, Any]) -> None:
    """Writes final.json (atomically)."""
    replace_atomic(final_path(run_dir), (json.dumps(final, indent=1) + "\n").encode())


def read_final(run_dir: PathLike) -> dict[str, Any] | None:
    """final.json, or None if the run has none (it did not finish).

    Raises:
        RunDirError: it is there but damaged: not JSON, not a table, or without a state digest string.
    """
    path = final_path(run_dir)
    try:
        doc = json.loads(read_file(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise RunDirError(f"{path}: not readable JSON ({e}); the run's final record is damaged") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("state_digest"), str):
        raise RunDirError(
            f"{path}: is {json.dumps(doc)[:60]}, expected a table with a 'state_digest' string; the "
            "run's final record is damaged"
        )
    if "version" in doc:
        check_version(path, doc, FINAL_VERSION)
    return doc


def final_digest(run_dir: PathLike) -> str | None:
    """The final state digest of a finished run (None if it has none)."""
    final = read_final(run_dir)
    return final.get("state_digest") if final is not None else None

"""A resume checks itself (docs/design.md, "The contract"): the steps between the checkpoint a run resumed from
and the last receipt the killed segment wrote are computed again, and each receipt the resume makes of them
must be the old one, bit for bit. The old receipts stay in the file until each is matched; the first that
differs stops the run before any is replaced (``ResumeDiverged``, exit 7)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from samestep.exit_codes import RESUME_DIVERGED
from samestep.records.receipts import ReceiptError, chain_break, read_receipts, receipts_path

__all__ = ["ResumeDiverged", "diverged", "receipts_after"]

# What a resume restores, and what a loop may keep outside it: the message's list of likely causes.
_HELD = "the model, the optimizer, the scheduler and data cursor given to it, the RNG states"
_NOT_HELD = (
    "an LR scheduler not passed as scheduler=, a DataLoader or sampler not passed as data_cursor=, a "
    "generator of the loop's own, a batch fetched ahead of its step"
)


class ResumeDiverged(ReceiptError):
    """A resumed run computed a step again to other bits than the run's receipt of it records: the resume
    restored other state than the run had. ``step``: that step; ``path``: the receipts file, unchanged."""

    exit_code = RESUME_DIVERGED

    def __init__(self, message: str, step: int, path: Path) -> None:
        super().__init__(message)
        self.step, self.path = step, path


def receipts_after(run_dir: str | os.PathLike[str], rank: int, start: int) -> list[dict[str, Any]]:
    """The receipts of ``rank`` after step ``start`` that a killed segment wrote and that continue the chain
    whole (up to the first break or torn line): the steps a resume from ``start`` computes again and checks."""
    path = receipts_path(run_dir, rank)
    if not path.exists():
        return []
    header, receipts = read_receipts(path)
    before = next((r for r in receipts if r["step"] == start), None)
    prev = before["hash"] if before is not None else header.get("genesis") if start == header.get("start", 0) else None
    if prev is None:
        return []
    after = [r for r in receipts if r["step"] > start]
    kept: list[dict[str, Any]] = []
    for r in after:
        if chain_break(header, [r], prev) is not None or r["step"] != start + len(kept) + 1:
            break
        kept.append(r)
        prev = r["hash"]
    return kept


def diverged(path: Path, start: int, old: dict[str, Any], new: dict[str, Any], last: int) -> ResumeDiverged:
    """The error of a resume from ``start`` whose receipt ``new`` of a step is not the run's ``old`` one (the
    killed segment's receipts ran to step ``last``): the step, what differs and what a resume restores."""
    step = old["step"]
    parts = []
    if new["loss_hex"] != old["loss_hex"]:
        parts.append(f"loss {float.fromhex(new['loss_hex'])!r}, not {float.fromhex(old['loss_hex'])!r}")
    if new["grad_norm_hex"] != old["grad_norm_hex"]:
        parts.append(f"grad norm {float.fromhex(new['grad_norm_hex'])!r}, not {float.fromhex(old['grad_norm_hex'])!r}")
    if new["state"] != old["state"]:
        parts.append(f"state {new['state'][:16]}..., not {old['state'][:16]}...")
    what = "; ".join(parts) or "a receipt of other fields"
    return ResumeDiverged(
        f"{path}: the resume from step {start} computed step {step} again to other bits than the run's receipt "
        f"of it ({what}): it restored other state than the run had. A resume restores {_HELD}; state kept "
        f"outside them ({_NOT_HELD}) is lost. Hand it to samestep.Run (or the callback) and run again: the "
        f"run's receipts of steps {step}..{last} are kept, and the check repeats",
        step,
        path,
    )

"""``samestep receipts verify RUN``: a run's receipts hold together, and its files agree with them.

Checked: each rank's chain (from the genesis of run.json's config and data), metrics.jsonl's loss and
grad-norm bits against rank 0's receipts, final.json's state digest against the last receipt, and the
newest checkpoint, restored into a model built from run.json's config and digested as the run digests
its state, against the receipt of its step. A problem is named by file and step.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from samestep.receipts import chain_break, genesis, read_receipts, read_run_receipts, receipts_path
from samestep.rundir import read_final, read_metrics, read_run

__all__ = ["check_receipts", "checkpoint_state_digest"]


def checkpoint_state_digest(config: dict[str, Any], step_dir: Path) -> str:
    """The state digest of a ``samestep train`` checkpoint as the run digests its state after that step
    (``train.loop.run_state_digest``): restored into a model built from ``config`` on one process."""
    from samestep.checkpoint import load_checkpoint
    from samestep.train.config import Config
    from samestep.train.loop import build, run_state_digest

    parts = build(Config.from_dict({k: dict(v) for k, v in config.items()}, where="run.json config"))
    with warnings.catch_warnings():  # another environment is named by the checks that compare them
        warnings.simplefilter("ignore")
        loaded = load_checkpoint(step_dir, model=parts.model, optimizer=parts.optimizer, scheduler=parts.schedule,
                                 data_cursor=parts.cursor, restore_rng=False)
    return run_state_digest(parts.model, parts.optimizer, parts.cursor, loaded.step)


def check_receipts(run_dir: str | Path) -> dict[str, Any]:
    """Checks a run's receipts; returns ``{"ok", "problems", "ranks": {rank: {"steps", "state_of"}},
    "checked": [what was compared]}``.

    Raises:
        RunDirError, ReceiptError: run.json or a receipts file is missing or malformed (an input error,
            not a verdict).
    """
    run_dir = Path(run_dir)
    doc = read_run(run_dir)
    chains = read_run_receipts(run_dir)
    if not chains:
        read_receipts(receipts_path(run_dir, 0))  # raises: missing
    data = doc.get("data") if isinstance(doc.get("data"), dict) else {}
    first = genesis(doc["config"], data["fingerprint"]) if "fingerprint" in data else None
    problems, checked, ranks = [], [], {}
    for rank, (header, receipts) in chains.items():
        path = receipts_path(run_dir, rank)
        ranks[rank] = {"steps": f"1-{receipts[-1]['step']}" if receipts else "none",
                       "state_of": header.get("state_of")}
        if first is not None and header.get("genesis") != first:
            problems.append(f"{path}: its genesis is not of run.json's config and data (receipts of another run?)")
        why = chain_break(header, receipts)
        if why is not None:
            problems.append(f"{path}: chain broken at {why}")
        elif receipts and receipts[0]["step"] != 1:
            problems.append(f"{path}: starts at step {receipts[0]['step']}, not 1")
    checked.append(f"the hash chain of {len(chains)} rank(s)")
    header, receipts = chains.get(0, ({}, []))
    by_step = {r["step"]: r for r in receipts}
    metrics = read_metrics(run_dir)
    for row in metrics:
        r = by_step.get(row["step"])
        if r is None:
            problems.append(f"{run_dir / 'metrics.jsonl'}: step {row['step']} has no receipt")
            break
        if (row.get("loss_hex"), row.get("grad_norm_hex")) != (r["loss_hex"], r["grad_norm_hex"]):
            problems.append(f"{run_dir / 'metrics.jsonl'}: step {row['step']}: loss or grad norm bits differ from "
                            "its receipt")
            break
    checked.append(f"metrics.jsonl's {len(metrics)} step(s) against rank 0's receipts")
    whole = header.get("state_of") == "run"
    final = read_final(run_dir)
    if final is not None and whole:
        r = by_step.get(final.get("step"))
        if r is None or r["state"] != final["state_digest"]:
            problems.append(f"{run_dir / 'final.json'}: its state digest is not the receipt's of step {final.get('step')}")
        checked.append("final.json against its step's receipt")
    problems += _check_checkpoint(run_dir, doc, by_step if whole else None, checked)
    return {"ok": not problems, "problems": problems, "ranks": {str(k): v for k, v in sorted(ranks.items())},
            "checked": checked}


def _check_checkpoint(run_dir: Path, doc: dict[str, Any], by_step: dict[int, dict] | None,
                      checked: list[str]) -> list[str]:
    """The newest committed checkpoint against the receipt of its step (receipts of the whole state only)."""
    from samestep.checkpoint import CheckpointError, verify_checkpoint

    root = run_dir / "checkpoints"
    if not any(root.glob("step_*")):
        checked.append("no checkpoint (none to compare)")
        return []
    if by_step is None:
        checked.append("no checkpoint: the receipts are of each rank's shards, a checkpoint of the whole state")
        return []
    if doc.get("written_by") == "samestep.trace":
        checked.append("no checkpoint: a loop of your own, whose model only it can build")
        return []
    try:
        step_dir = verify_checkpoint(root)
    except CheckpointError as e:
        return [f"{root}: the newest checkpoint is damaged: {e}"]
    step = int(step_dir.name.split("_")[1])
    try:
        digest = checkpoint_state_digest(doc["config"], step_dir)
    except ValueError as e:  # it does not load into this run's model, optimizer or data cursor
        return [f"{step_dir}: does not fit this run, so it is a checkpoint of another run: {e}"]
    checked.append(f"checkpoint {step_dir.name} against its step's receipt")
    r = by_step.get(step)
    if r is None:
        return [f"{step_dir}: no receipt of step {step}"]
    if r["state"] != digest:
        return [f"{step_dir}: its state digest {digest[:16]}... is not the receipt's of step {step} "
                f"({r['state'][:16]}...): a checkpoint of another run, or changed since"]
    return []

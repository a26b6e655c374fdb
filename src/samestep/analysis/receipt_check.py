"""``samestep receipts verify RUN``: a run's receipts hold together, and its files agree with them.

Checked: each rank's chain (from the genesis of run.json's config and data), the loss and grad-norm bits every
rank of samestep train receipts alike against each other, metrics.jsonl against rank 0's receipts (every step
receipted, in order, with the receipt's loss and grad-norm bits), final.json against the last receipt (step, loss
bits, state checksum), and the newest checkpoint against the receipt of its
step: its state, rebuilt from its files (each rank's shards where the run sharded it), checksummed by the
receipts' state hash. A problem is named by file and step. Nothing to check (no receipt) is an input
error, not a pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from samestep.hashing.checksums import state_checksum
from samestep.records.durable import read_file
from samestep.records.final import read_final
from samestep.records.metrics import read_metrics
from samestep.records.receipt_state import receipted_state
from samestep.records.receipts import (
    ReceiptError,
    chain_break,
    genesis,
    read_receipts,
    read_run_receipts,
    receipts_path,
    state_hash_of,
)
from samestep.records.rundir import checkpoints_dir, final_path, layout_at, metrics_path, read_run

__all__ = ["check_receipts", "checkpoint_mismatches"]

Chains = dict[int, tuple[dict[str, Any], list[dict[str, Any]]]]


def checkpoint_mismatches(run_dir: Path, step_dir: Path, chains: Chains, written_by: str | None) -> list[str]:
    """Where a checkpoint is not the state the run's receipts of its step record: for each rank that receipted
    it under the layout that wrote it, its part of the checkpoint (the whole state, on rank 0; or, of a sharded
    checkpoint, each rank's own shards) against its receipt. ``written_by`` is run.json's (whose state
    the receipts checksum: ``receipted_state``).

    Raises:
        CheckpointError: the checkpoint is damaged.
    """
    from samestep.checkpoint import checkpoint_state, shard_count

    step = int(step_dir.name.split("_")[1])
    shards = shard_count(step_dir)
    problems = []
    for rank in range(shards) if shards else [0]:
        header, receipts = chains.get(rank, ({}, []))
        receipt = next((r for r in receipts if r["step"] == step), None)
        if receipt is None:
            problems.append(f"{step_dir}: {receipts_path(run_dir, rank).name} holds no receipt of step {step}")
            continue
        of = receipt.get("state_of")  # version 2 says; version 1's header may predate a change of layout
        if of is not None and of != ("rank" if shards else "run"):
            what = "the whole state" if of == "run" else "one rank's shards"
            problems.append(
                f"{step_dir}: {receipts_path(run_dir, rank).name}'s receipt of step {step} is of "
                f"{what}, but the checkpoint is "
                f"{'sharded' if shards else 'whole'}: a checkpoint of another layout, or changed since"
            )
            continue
        tree = receipted_state(checkpoint_state(step_dir, rank if shards else None), written_by)
        digest = state_checksum(tree, state_hash_of(header))
        if digest != receipt["state"]:
            whose = f"rank {rank}'s shards" if shards else "its state"
            problems.append(
                f"{step_dir}: {whose} checksum {digest[:16]}... is not the receipt's of step {step} "
                f"({receipt['state'][:16]}...): a checkpoint of another run, or changed since"
            )
    return problems


def _check_metrics(run_dir: Path, by_step: dict[int, dict], last: int, finished: bool) -> list[str]:
    """metrics.jsonl (samestep train's) holds steps 1..last in order with their receipts' bits; a finished run
    no step more, an unfinished one may hold steps past its last receipt (written before a kill)."""
    path = metrics_path(run_dir)
    if not path.exists():
        return [f"{path}: missing, though the run receipted steps 1-{last}"]
    rows = read_metrics(run_dir)
    lines = read_file(path).decode("utf-8").splitlines()
    steps = [row["step"] for row in rows]
    if steps[:last] != list(range(1, last + 1)):
        bad = next((i for i, s in enumerate(steps[:last], 1) if s != i), min(len(steps), last) + 1)
        return [
            f"{path}: line {bad} should be step {bad} (the receipts cover steps 1-{last}); it holds "
            f"{steps[bad - 1] if bad <= len(steps) else 'nothing'}: rows deleted, moved or repeated"
        ]
    if finished and (len(steps) > last or len(lines) > len(rows)):
        return [f"{path}: holds {len(lines) - last} line(s) past step {last}, the run's last (a torn or added row)"]
    for row in rows[:last]:
        r = by_step.get(row["step"])
        if r is None:
            return [f"{path}: step {row['step']} has no receipt in rank 0's file (a receipt deleted: see its chain)"]
        if (row.get("loss_hex"), row.get("grad_norm_hex")) != (r["loss_hex"], r["grad_norm_hex"]):
            return [f"{path}: step {row['step']}: loss or grad norm bits differ from its receipt"]
    return []


def _check_final(
    run_dir: Path, final: dict[str, Any], header: dict[str, Any], by_step: dict[int, dict], last: int, sharded: bool
) -> tuple[list[str], str]:
    """final.json against the last receipt; and what was compared. ``sharded``: the layout of the last step
    (run.json's), what a version-1 receipt, which does not say what its state is of, is taken by."""
    path = final_path(run_dir)
    if final.get("step") != last:
        return [f"{path}: says step {final.get('step')!r}, but the receipts end at step {last}"], ""
    r = by_step[last]
    if final.get("loss_hex") != r["loss_hex"]:
        return [f"{path}: its loss bits {final.get('loss_hex')!r} are not the receipt's of step {last}"], ""
    if r.get("state_of", "rank" if sharded else "run") != "run":
        return [], "final.json's step and loss bits against the last receipt (of one rank's shards: no state)"
    hash_ = state_hash_of(header)
    # a digest of the whole state as one process names it (samestep.Run's) is not of the receipts' tree
    digest = final["state_digest"] if final.get("state_digest_of") != "whole" else None
    held = digest if hash_ == "sha256" else (final.get("state_checksum") or {}).get(hash_)
    if held is None:
        return [], f"final.json's step and loss bits against the last receipt (it holds no {hash_} state checksum)"
    if r["state"] != held:
        return [f"{path}: its state checksum ({hash_}) is not the receipt's of step {last}"], ""
    return [], "final.json's step, loss bits and state against the last receipt"


def check_receipts(run_dir: str | Path) -> dict[str, Any]:
    """Checks a run's receipts; returns ``{"ok", "problems", "ranks": {rank: {"steps", "state_of"}},
    "checked": [what was compared]}``.

    Raises:
        RunDirError, ReceiptError: run.json or a receipts file is missing or malformed, or the run holds no
            receipt to check (an input error, not a verdict).
    """
    run_dir = Path(run_dir)
    doc = read_run(run_dir)
    chains = read_run_receipts(run_dir)
    if not chains:
        read_receipts(receipts_path(run_dir, 0))  # raises: missing
    if not any(receipts for _, receipts in chains.values()):
        raise ReceiptError(
            f"{run_dir / 'receipts'}: holds no receipt (the run stopped before its first step, or "
            "wrote none): there is nothing to check"
        )
    data = doc.get("data") if isinstance(doc.get("data"), dict) else {}
    first = genesis(doc["config"], data["fingerprint"]) if "fingerprint" in data else None
    problems, checked, ranks = [], [], {}
    resumed = {r["step"] for r in doc.get("resumes", []) if isinstance(r, dict) and isinstance(r.get("step"), int)}

    # parallel.tp_chunks gives every rank receipts of its shards, whatever the degree, and no resume changes it
    chunks = (doc.get("config") or {}).get("parallel", {}).get("tp_chunks", 0)

    def joined(rank: int, first: int) -> bool:
        """Whether ``rank`` first kept receipts at step ``first``: a resume from the step before it onto more
        processes, or from a layout whose rank 0 alone kept receipts, of the whole state (unsharded data
        parallelism, a pipeline's, expert parallelism's) onto one whose every rank keeps its own."""
        if first - 1 not in resumed:
            return False
        before, after = layout_at(doc, first - 1), layout_at(doc, first)["world_size"]
        alone = before["pipeline_parallel"] > 1 or before["expert_parallel"] > 1 or not (before["sharded"] or chunks)
        return (1 if alone else before["world_size"]) <= rank < after

    for rank, (header, receipts) in chains.items():
        path = receipts_path(run_dir, rank)
        ranks[rank] = {
            "steps": f"{receipts[0]['step']}-{receipts[-1]['step']}" if receipts else "none",
            "state_of": header.get("state_of"),
        }
        if first is not None and header.get("genesis") != first:
            problems.append(f"{path}: its genesis is not of run.json's config and data (receipts of another run?)")
        why = chain_break(header, receipts)
        if why is not None:
            problems.append(f"{path}: chain broken at {why}")
        elif receipts and receipts[0]["step"] != 1 and not joined(rank, receipts[0]["step"]):
            problems.append(f"{path}: starts at step {receipts[0]['step']}, not 1 (nor after a resume)")
    checked.append(f"the hash chain of {len(chains)} rank(s)")
    if len(chains) > 1 and doc.get("written_by") != "samestep.trace":
        problems += _check_ranks_agree(run_dir, chains)
        checked.append(f"the loss and grad-norm bits of {len(chains)} ranks against each other")
    header, receipts = chains.get(0, ({}, []))
    by_step = {r["step"]: r for r in receipts}
    last = receipts[-1]["step"] if receipts else 0
    final = read_final(run_dir)
    if doc.get("written_by") != "samestep.trace" and last:  # samestep train writes metrics.jsonl
        problems += _check_metrics(run_dir, by_step, last, final is not None)
        checked.append(f"metrics.jsonl's steps 1-{last} against rank 0's receipts")
    if final is not None and last:
        found, what = _check_final(run_dir, final, header, by_step, last, layout_at(doc, last)["sharded"])
        problems += found
        if what:
            checked.append(what)
    problems += _check_checkpoint(run_dir, doc, chains, checked)
    return {
        "ok": not problems,
        "problems": problems,
        "ranks": {str(k): v for k, v in sorted(ranks.items())},
        "checked": checked,
    }


def _check_ranks_agree(run_dir: Path, chains: Chains) -> list[str]:
    """Every rank of samestep train receipts one loss and one grad norm a step (each is reduced over the ranks
    before it is receipted), so a rank whose bits are not those of the lowest rank that receipted the step had
    its file edited, its chain rehashed. (A loop of one's own may receipt each rank's local loss: not checked.)"""
    first: dict[int, tuple[int, dict[str, Any]]] = {}
    for rank, (_, receipts) in sorted(chains.items()):
        for r in receipts:
            if r["step"] not in first:
                first[r["step"]] = (rank, r)
                continue
            low, other = first[r["step"]]
            differ = [f for f in ("loss_hex", "grad_norm_hex") if r[f] != other[f]]
            if differ:
                return [
                    f"{receipts_path(run_dir, rank)}: step {r['step']}: {' and '.join(differ)} "
                    f"{', '.join(r[f] for f in differ)} differ from rank {low}'s "
                    f"{', '.join(other[f] for f in differ)}; every rank receipts the same reduced bits, so one "
                    "of the files was edited"
                ]
    return []


def _check_checkpoint(run_dir: Path, doc: dict[str, Any], chains: Chains, checked: list[str]) -> list[str]:
    """The newest committed checkpoint against the receipts of its step."""
    from samestep.checkpoint import CheckpointError, committed_steps, verify_checkpoint

    root = checkpoints_dir(run_dir)
    if not committed_steps(root):
        checked.append("no checkpoint (none to compare)")
        return []
    try:
        step_dir = verify_checkpoint(root)
        problems = checkpoint_mismatches(run_dir, step_dir, chains, doc.get("written_by"))
    except CheckpointError as e:
        return [f"{root}: the newest checkpoint is damaged: {e}"]
    checked.append(f"checkpoint {step_dir.name} against its step's receipt(s)")
    return problems

"""Receipts, ``samestep receipts verify``, ``samestep verify`` and ``samestep bisect`` on real runs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from samestep.records.receipts import read_receipts
from tests.controls import (
    resume_without_the_optimizer,
    resume_without_the_optimizer_restored_unchecked,
    resume_without_the_optimizer_unchecked,
)
from tests.forgery import rewrite_receipts
from tests.support import TINY, cli_here, killed_in_step_4, run_files, train_here, train_ranks

pytestmark = pytest.mark.slow


def _cli(*args: str) -> tuple[int, str, str]:
    proc = cli_here(*args)  # verify's and bisect's replays start their own processes
    return proc.returncode, proc.stdout, proc.stderr


def _receipts(run_dir, rank=0) -> list[dict]:
    return read_receipts(run_dir / "receipts" / f"rank_{rank:05d}.jsonl")[1]


def _rewrite(run_dir, edit) -> None:
    """Edits rank 0's receipts with ``edit(receipts)``, then re-hashes the chain, as a forger would."""
    rewrite_receipts(run_dir / "receipts" / "rank_00000.jsonl", edit)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_run):
    """An uninterrupted run (the suite's, copied), one stopped after step 3 and resumed, and one of another
    seed."""
    root = tmp_path_factory.mktemp("receipts")
    shutil.copytree(tiny_run, root / "a")
    assert train_here(root / "b", *TINY, stop_after=3) is None
    train_here(root / "b", *TINY, resume=True)
    train_here(root / "other", *TINY, "train.seed=7")
    return root


def test_receipts_are_the_runs_state_and_survive_a_resume(runs, tmp_path):
    """Every step has a receipt (version 2, XXH3-128 state checksums of the whole state) whose chain holds; the
    last one's state is final.json's checksum; a resumed run's receipts file is byte for byte the uninterrupted
    run's. Negative controls: a resume that leaves the optimizer's state out is refused by the receipt of its
    step; with that check lifted, its receipts are the run's up to step 3 and differ from step 4 on."""
    a, b = runs / "a", runs / "b"
    header, receipts = read_receipts(a / "receipts" / "rank_00000.jsonl")
    assert (header["version"], header["state_hash"]) == (2, "xxh3-128")
    assert [r["step"] for r in receipts] == list(range(1, 9)) and {r["state_of"] for r in receipts} == {"run"}
    assert receipts[-1]["state"] == json.loads((a / "final.json").read_text())["state_checksum"]["xxh3-128"]
    assert (a / "receipts" / "rank_00000.jsonl").read_bytes() == (b / "receipts" / "rank_00000.jsonl").read_bytes()
    code, out, err = _cli("receipts", "verify", str(b))
    assert code == 0, out + err
    assert "checkpoint step_000008 against its step's receipt" in out and "final.json" in out

    cut = tmp_path / "cut"
    assert train_here(cut, *TINY, stop_after=3) is None
    train_ranks(
        cut, *TINY, nproc=1, resume=True, patch=resume_without_the_optimizer, exit_code=2, stderr=tmp_path / "refused"
    )
    assert "the checkpoint of step 3 restores state" in (tmp_path / "refused").read_text()
    train_ranks(cut, *TINY, nproc=1, resume=True, patch=resume_without_the_optimizer_unchecked)
    forgot = _receipts(cut)
    assert [r["state"] for r in forgot[:3]] == [r["state"] for r in receipts[:3]]
    assert all(f["state"] != r["state"] for f, r in zip(forgot[3:], receipts[3:]))


def test_a_resume_that_lost_state_stops_at_the_first_step_it_computes_again(runs, tmp_path):
    """Two data-parallel processes, rank 1 SIGKILLed in step 4 (checkpoint 2; rank 0's receipts of steps 1..3
    on disk). Resumed with the optimizer's state left out and only the restored state's check lifted, step 3
    computed again is not its receipt: exit 7, one line naming the step, and rank 0's receipts as the kill left
    them. Control: the same directory resumed as it is ends on the uninterrupted run's receipts, byte for
    byte (steps 3 and later checked, then written)."""
    run = tmp_path / "run"
    killed_in_step_4(run, *TINY, nproc=2, copies=("lost",))
    assert [r["step"] for r in _receipts(run)] == [1, 2, 3]
    before = run_files(tmp_path / "lost" / "receipts")
    err = tmp_path / "lost.err"
    train_ranks(
        tmp_path / "lost",
        *TINY,
        nproc=2,
        resume=True,
        patch=resume_without_the_optimizer_restored_unchecked,
        exit_code=7,
        stderr=err,
    )
    assert "the resume from step 2 computed step 3 again to other bits than the run's receipt" in err.read_text()
    assert run_files(tmp_path / "lost" / "receipts") == before
    train_ranks(run, *TINY, nproc=2, resume=True)
    assert (run / "receipts" / "rank_00000.jsonl").read_bytes() == (
        runs / "a" / "receipts" / "rank_00000.jsonl"
    ).read_bytes()


def test_receipts_verify_catches_an_edit_and_a_foreign_checkpoint(runs, tmp_path):
    """An edited receipt breaks the chain (exit 1, naming the step); a checkpoint of another run put in the run's
    place is named (exit 1); a run directory without receipts is an input error (exit 2)."""
    edited = tmp_path / "edited"
    shutil.copytree(runs / "a", edited)
    path = edited / "receipts" / "rank_00000.jsonl"
    lines = path.read_text().splitlines()
    r = json.loads(lines[5])  # step 5
    r["loss_hex"] = (0.5).hex()
    lines[5] = json.dumps(r, sort_keys=True)
    path.write_text("\n".join(lines) + "\n")
    code, out, _ = _cli("receipts", "verify", str(edited))
    assert code == 1 and "chain broken at step 5" in out, out

    foreign = tmp_path / "foreign"
    shutil.copytree(runs / "a", foreign)
    shutil.rmtree(foreign / "checkpoints" / "step_000008")
    shutil.copytree(runs / "other" / "checkpoints" / "step_000008", foreign / "checkpoints" / "step_000008")
    code, out, _ = _cli("receipts", "verify", str(foreign))
    assert code == 1 and "step_000008: " in out and "another run" in out, out

    shutil.rmtree(foreign / "receipts")
    code, _, err = _cli("receipts", "verify", str(foreign))
    assert code == 2 and "rank_00000.jsonl: missing" in err, err


def test_verify_replays_and_names_the_first_step_that_does_not_reproduce(runs, tmp_path):
    """verify replays from the newest checkpoint before A and every receipt reproduces (exit 0). Controls: a
    receipt forged with its chain re-hashed is named by its step (exit 1); a checkpoint of another run in the
    run's place is refused as not the run's (exit 1); steps beyond the receipts cannot be replayed (2)."""
    code, out, err = _cli("verify", str(runs / "a"), "--steps", "5-6", "--json")
    assert code == 0, out + err
    report = json.loads(out)
    assert report["reproduced"] and report["replayed_from"] == 4 and report["compared"] == 2

    forged = tmp_path / "forged"
    shutil.copytree(runs / "a", forged)
    _rewrite(forged, lambda rs: rs[5].update(state="0" * 64))  # step 6
    code, out, _ = _cli("receipts", "verify", str(forged))
    assert code == 0, out  # a re-hashed chain holds: only a replay shows the forgery
    code, out, _ = _cli("verify", str(forged), "--steps", "5-6")
    assert code == 1 and "NOT REPRODUCED: step 6 (rank 0): state differ" in out, out

    foreign = tmp_path / "foreign"
    shutil.copytree(runs / "a", foreign)
    shutil.rmtree(foreign / "checkpoints" / "step_000004")
    shutil.copytree(runs / "other" / "checkpoints" / "step_000004", foreign / "checkpoints" / "step_000004")
    code, out, _ = _cli("verify", str(foreign), "--steps", "5-6", "--json")
    assert code == 1, out
    assert json.loads(out)["first_mismatch"]["step"] == 4 and json.loads(out)["first_mismatch"]["fields"] == [
        "checkpoint"
    ]

    code, _, err = _cli("verify", str(runs / "a"), "--steps", "7-9")
    assert code == 2 and "receipted steps 1-8" in err, err


# Determinism off + the token lookup by indexing: index_put_ accumulate races in backward (real, on CPU).
RACY = (
    "train.device=cpu",
    "train.steps=5",
    "train.global_batch=16",
    "train.micro_batch=8",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=64",
    "model.block_size=64",
    "model.embedding=index",
    "determinism.enabled=false",
    "train.checkpoint_every=2",
    "trace.level=op",
    "trace.steps=1",
)


def test_bisect_locates_a_real_race_at_a_step_nobody_traced(tmp_path):
    """Two runs share steps 1-2 (one is the other's copy at its step-2 checkpoint), then race on their own.
    Only step 1 was traced. bisect finds the first differing step after 2, replays both from the common
    step-2 checkpoint with op tracing of that step, and names index_put in transformer.wte's backward."""
    for attempt in range(3):  # the race is real; a pair can (rarely) agree on every step
        a, b = tmp_path / f"a{attempt}", tmp_path / f"b{attempt}"
        torch.set_num_threads(2)  # determinism off leaves the thread count as it finds it
        train_here(a, *RACY, stop_after=2)
        shutil.copytree(a, b)
        train_here(a, *RACY, resume=True)
        train_here(b, *RACY, resume=True)
        code, out, err = _cli("bisect", str(a), str(b), "--json")
        assert code in (0, 1), err
        report = json.loads(out)
        if code == 1 and report["reproduced"]:
            break
    assert code == 1 and report["reproduced"], report["summary"]
    assert report["first_divergent_step"] >= 3 and report["replayed_from"] == 2
    o = report["origin"]
    assert o["op"].startswith("aten.index_put") and o["scope"] == "transformer.wte" and o["phase"] == "backward"
    assert o["inputs_matched"] and o["step"] == report["first_divergent_step"] and o["rank"] == 0


def test_bisect_finds_a_planted_ulp_exactly_across_layouts(tmp_path, tiny_run):
    """A 2-process run with one ULP planted at step 5 on rank 1 (microbatch 2's final layer norm) against the
    same run on 2 processes: bisect names exactly that op, occurrence, microbatch, step and rank, and rank 0 as
    a receiver through the collective. Control: the
    unplanted 2-process run against a 1-process run of the same config is identical."""
    target = "rank=1,step=5,microbatch=2,phase=forward,scope=transformer.ln_f,op=aten.native_layer_norm.default"
    train_ranks(tmp_path / "two", *TINY, nproc=2)
    train_ranks(tmp_path / "planted", *TINY, "trace.level=op", "trace.steps=5", f"trace.perturb={target}", nproc=2)
    shutil.copytree(tiny_run, tmp_path / "one")
    code, out, err = _cli("bisect", str(tmp_path / "two"), str(tmp_path / "planted"), "--json")
    assert code == 1, err
    report = json.loads(out)
    o = report["origin"]
    assert report["first_divergent_step"] == 5 and report["replayed_from"] == 4
    assert (o["rank"], o["step"], o["microbatch"], o["phase"], o["scope"], o["op"], o["occurrence"]) == (
        1,
        5,
        2,
        "forward",
        "transformer.ln_f",
        "aten.native_layer_norm.default",
        0,
    )
    assert o["inputs_matched"]
    # rank 0 computed nothing wrong: the damage reached it through the canonical combine
    other = report["per_rank"]["0"]["divergence"]
    assert other["kind"] == "receiver" and other["scope"] == "collective" and other["step"] == 5
    assert "rank(s) 1 only, of 2 (0-1)" in report["diff"]
    code, out, err = _cli("bisect", str(tmp_path / "two"), str(tmp_path / "one"), "--json")
    assert code == 0, out + err
    report = json.loads(out)
    assert report["identical"] and report["first_divergent_step"] is None and report["steps_compared"] == 8

"""What `samestep receipts verify` and `samestep diff` say of a TP-2 run's receipts files edited, cut or lost:
a rank's rehashed loss bits break the receipts (every rank receipts one reduced loss), a receipt deleted or a
step written as a string is named (a break, or one line naming the file and line), and a diff never says
"identical" over receipts that one run lacks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.forgery import rewrite_receipts
from tests.support import TINY, cli_here, train_ranks

pytestmark = pytest.mark.slow

TP2 = (
    *[s for s in TINY if not s.startswith(("model.n_head", "train.steps"))],
    "model.n_head=4",
    "train.steps=4",
    "parallel.tp_chunks=8",
    "parallel.tp=2",
)


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory) -> Path:
    """A finished TP-2 run: ranks 0 and 1 each keep receipts of their shards (copy it before changing it)."""
    d = tmp_path_factory.mktemp("tp2") / "run"
    train_ranks(d, *TP2, nproc=2)
    return d


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def test_a_ranks_loss_bits_edited_and_rehashed_break_the_receipts(tp2_run, tmp_path):
    """Rank 1's loss bits of step 3 changed and its chain rehashed: the chain holds, but the bits are not rank
    0's, which every rank of samestep train receipts alike; verify names the file and step (exit 1). The same
    for the grad norm. Negative control: the untouched run's receipts hold, with the cross-rank comparison
    among what was checked."""
    ok = cli_here("receipts", "verify", str(tp2_run))
    assert ok.returncode == 0 and "the loss and grad-norm bits of 2 ranks against each other" in ok.stdout, ok
    for field in ("loss_hex", "grad_norm_hex"):
        run = _copy(tp2_run, tmp_path / field)
        rewrite_receipts(
            run / "receipts" / "rank_00001.jsonl",
            lambda rs: rs[2].update({field: float.fromhex(rs[2][field]).__add__(1e-3).hex()}),
        )
        out = cli_here("receipts", "verify", str(run))
        assert (
            out.returncode == 1
            and "BROKEN: " in out.stdout
            and f"rank_00001.jsonl: step 3: {field} " in out.stdout
            and "differ from rank 0's" in out.stdout
        ), out


@pytest.mark.parametrize("cut", ["lost", "cut"])
def test_diff_is_not_identical_over_receipts_one_run_lacks(tp2_run, tmp_path, cut):
    """Run B, a copy of run A whose rank-1 receipts file is deleted, or cut to 2 of its 4 steps: diff says what
    was not compared and its verdict is identical only over part (exit 0, with --strict 1), never
    "identical". Negative control: the untouched copy is identical (exit 0 with --strict)."""
    a = tp2_run
    same = _copy(a, tmp_path / "same")
    out = cli_here("diff", str(a), str(same), "--json", "--strict")
    assert out.returncode == 0 and json.loads(out.stdout)["verdict"] == "identical", out
    b = _copy(a, tmp_path / "b")
    path = b / "receipts" / "rank_00001.jsonl"
    if cut == "lost":
        path.unlink()
    else:
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:3]))
    out = cli_here("diff", str(a), str(b), "--json")
    report = json.loads(out.stdout)
    gap = "run B has no receipts of rank 1" if cut == "lost" else "rank 1: run B's receipts lack step(s) 3-4"
    assert out.returncode == 0 and not report["identical"] and report["partial"], out
    assert report["verdict"] == "identical over steps 1-4 of 1-4, less the receipts one run lacks"
    assert any(gap in g for g in report["not_compared"]) and gap in report["summary"], report
    assert cli_here("diff", str(a), str(b), "--strict").returncode == 1


def test_a_receipt_deleted_or_a_step_written_as_a_string_is_named(tp2_run, tmp_path):
    """Rank 0's receipt of step 2 deleted: verify reports the chain broken and metrics.jsonl's step 2 without a
    receipt (exit 1, no KeyError), and diff names the receipt run B lacks. Its step written as the string "2":
    verify and diff refuse with one line naming the file and line (exit 2). Negative control: the untouched
    copy verifies."""
    assert cli_here("receipts", "verify", str(_copy(tp2_run, tmp_path / "ok"))).returncode == 0
    deleted = _copy(tp2_run, tmp_path / "deleted")
    path = deleted / "receipts" / "rank_00000.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2] + lines[3:]))
    out = cli_here("receipts", "verify", str(deleted))
    assert out.returncode == 1 and "rank_00000.jsonl: chain broken at step 3 follows step 1" in out.stdout, out
    assert "metrics.jsonl: step 2 has no receipt in rank 0's file" in out.stdout and "Error" not in out.stderr
    diff = json.loads(cli_here("diff", str(tp2_run), str(deleted), "--json").stdout)
    assert diff["not_compared"] == ["rank 0: run B's receipts lack step(s) 2, which the other run's hold"], diff
    text = _copy(tp2_run, tmp_path / "text")
    path = text / "receipts" / "rank_00000.jsonl"
    header, *receipts = path.read_text().splitlines()
    receipts[1] = receipts[1].replace('"step": 2', '"step": "2"')
    path.write_text("\n".join([header, *receipts]) + "\n")
    for cmd in (("receipts", "verify", str(text)), ("diff", str(tp2_run), str(text))):
        out = cli_here(*cmd)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out
        assert "rank_00000.jsonl:3: step '2' is not a step number" in out.stderr, out

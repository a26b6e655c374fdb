"""`samestep verify` and `samestep bisect` on runs of the framework callbacks: the examples (examples/hf_trainer.py,
examples/lightning_fit.py), copied into the test's directory (their working tree) and run as a user runs them,
are run again from their recorded commands under a replay request, resuming from a copy of the framework's own
checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.forgery import flip_a_weight, rewrite_receipts
from tests.support import cli_here

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _start(where: Path, example: str, *args: str) -> subprocess.Popen:
    """``python EXAMPLE ARGS`` in ``where``, as a user starts it there."""
    env = {k: v for k, v in os.environ.items() if k != "SAMESTEP_REPLAY"}
    return subprocess.Popen(
        [sys.executable, example, *args],
        cwd=where,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def _finish(*procs: subprocess.Popen) -> None:
    for proc in procs:
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]


def _json(proc: subprocess.CompletedProcess, code: int) -> dict:
    assert proc.returncode == code, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def _files(where: Path) -> dict[str, int]:
    return {str(p.relative_to(where)): p.stat().st_mtime_ns for p in sorted(where.rglob("*")) if p.is_file()}


def test_an_hf_trainer_run_is_verified_from_its_checkpoint_and_bisected_to_a_planted_step(tmp_path):
    """Two runs of the HF Trainer example (6 steps, the Trainer's checkpoints every 3): a, and one with a ULP
    planted in a weight after step 5. run.json records the program and where the Trainer checkpoints; verify
    of steps 4-6 resumes the Trainer from a copy of checkpoint-3 and reproduces every receipt, leaving the
    run's files as they were; bisect of the two replays both from checkpoint-3 and names step 5, the steps
    before it agreeing (two independent runs agree to the bit: test_frameworks.py). Negative control: a weight
    flipped in checkpoint-3 is refused by the replayed callback's resume check (NOT THE RUN'S, exit 1)."""
    shutil.copy(EXAMPLES / "hf_trainer.py", tmp_path)
    _finish(*(_start(tmp_path, "hf_trainer.py", name, *extra) for name, *extra in (("a",), ("p", "--plant-step", "5"))))
    program = json.loads((tmp_path / "a" / "run.json").read_text())["programs"][0]
    assert program["resumes"] == {"by": "transformers.Trainer", "checkpoints": "."}, program
    before = _files(tmp_path / "a")
    report = _json(cli_here("verify", "--yes", str(tmp_path / "a"), "--steps", "4-6", "--json"), 0)
    assert report["reproduced"] and report["replayed_from"] == 3 and report["compared"] == 3, report
    assert _files(tmp_path / "a") == before

    bisected = _json(cli_here("bisect", "--yes", str(tmp_path / "a"), str(tmp_path / "p"), "--json"), 1)
    assert bisected["first_divergent_step"] == 5 and bisected["replayed_from"] == 3, bisected["summary"]
    assert bisected["steps_compared"] == 6 and bisected["reproduced"], bisected

    checkpoint = tmp_path / "a" / "checkpoint-3" / "model.safetensors"
    checkpoint.write_bytes(flip_a_weight(checkpoint.read_bytes()))
    proc = cli_here("verify", "--yes", str(tmp_path / "a"), "--steps", "4-6")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "NOT THE RUN'S: the checkpoint of step 3" in proc.stdout and "model differs" in proc.stdout, proc.stdout


def test_a_lightning_run_is_verified_from_its_indexed_checkpoint_and_an_edited_loss_is_not_reproduced(tmp_path):
    """The Lightning example (6 steps, 2 batches a step, ModelCheckpoint every 3): run.json indexes the files of
    steps 3 and 6; verify of steps 4-6 resumes fit from a copy of step 3's file and reproduces every receipt
    (loss bits and state), writing nothing into the run's checkpoint folder. The indexed paths are relative to
    the run directory: a copy of the run with one weight of its step-3 file changed is NOT THE RUN'S (it was
    checked against the original's files when they were absolute). A run with a ULP planted after step 5 is
    bisected to step 5 (both replayed from step 3), its origin not the collate's set_ of a fresh storage, which
    op tracing once took for data. Negative control: the loss of step 5 edited in the receipts, the chain
    rehashed, is NOT REPRODUCED at step 5."""
    shutil.copy(EXAMPLES / "lightning_fit.py", tmp_path)
    _finish(_start(tmp_path, "lightning_fit.py", "run"), _start(tmp_path, "lightning_fit.py", "p", "--plant-step", "5"))
    run = tmp_path / "run"
    doc = json.loads((run / "run.json").read_text())
    assert doc["programs"][0]["resumes"] == {"by": "lightning.Trainer"}
    assert sorted(e["step"] for e in doc["checkpoints"]) == [3, 6], doc["checkpoints"]
    assert all(e["path"].startswith("checkpoints/") for e in doc["checkpoints"]), doc["checkpoints"]
    before = _files(run)
    report = _json(cli_here("verify", "--yes", str(run), "--steps", "4-6", "--json"), 0)
    assert report["reproduced"] and report["replayed_from"] == 3 and report["compared"] == 3, report
    assert _files(run) == before

    bisected = _json(cli_here("bisect", "--yes", str(run), str(tmp_path / "p"), "--json"), 1)
    assert bisected["first_divergent_step"] == 5 and bisected["replayed_from"] == 3, bisected["summary"]
    assert bisected["reproduced"] and "set_" not in bisected["summary"], bisected["summary"]

    copy = tmp_path / "copy"  # a copy is verified against its own checkpoint files, not the original's
    shutil.copytree(run, copy)
    (ckpt,) = [copy / e["path"] for e in doc["checkpoints"] if e["step"] == 3]
    state = torch.load(ckpt, weights_only=False)
    weight = state["state_dict"]["net.0.weight"].view(-1)
    weight[0] = torch.nextafter(weight[0], torch.tensor(float("inf")))
    torch.save(state, ckpt)
    proc = cli_here("verify", "--yes", str(copy), "--steps", "4-6")
    assert proc.returncode == 1 and "NOT THE RUN'S: the checkpoint of step 3" in proc.stdout, proc.stdout + proc.stderr

    rewrite_receipts(run / "receipts" / "rank_00000.jsonl", lambda rs: rs[4].update(loss_hex=(0.5).hex()))
    proc = cli_here("verify", "--yes", str(run), "--steps", "5")
    assert proc.returncode == 1 and "NOT REPRODUCED: step 5 (rank 0): loss" in proc.stdout, proc.stdout + proc.stderr

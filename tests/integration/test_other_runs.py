"""A run directory that samestep train did not write (a loop of one's own under ``samestep.Run``): ``samestep
train`` over it and ``samestep diff`` of it beside a reference run each say so in one line, exit 2, never a
field-by-field list of one config against nothing."""

from __future__ import annotations

import shutil

import torch

import samestep
from tests.support import cli_here, run_files


def _own_run(run_dir) -> None:
    """Three steps of a loop of one's own under samestep.Run."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with samestep.Run(run_dir, model=model, optimizer=optimizer) as run:
        for step in run.steps(3):
            x = torch.randn(2, 4, generator=samestep.rng.generator(0, step, 0, "data"))
            loss = model(x).pow(2).mean()
            loss.backward()
            run.metric("loss", loss)
            optimizer.step()
            optimizer.zero_grad()


def test_train_over_a_loop_of_ones_own_is_one_line_and_leaves_it_as_it_was(tmp_path):
    """With and without --resume: one line naming the directory and what it holds, exit 2, every file as it
    was. Negative control: the same command on a new directory trains."""
    own = tmp_path / "own"
    _own_run(own)
    before = run_files(own)
    for extra in ((), ("--resume",)):
        r = cli_here("train", "--run-dir", str(own), "--set", "train.steps=1", *extra)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "holds a loop of one's own (samestep.Run" in r.stderr and "Fix: choose a new --run-dir" in r.stderr
        assert " vs None" not in r.stderr and "-> " not in r.stderr
    assert run_files(own) == before
    assert cli_here("train", "--run-dir", str(tmp_path / "new"), "--set", "train.steps=1").returncode == 0


def test_diff_of_a_reference_run_and_a_loop_of_ones_own_says_what_each_is(tiny_run, tmp_path):
    """One line naming what wrote each run, exit 2. Negative control: with --force the records are compared
    (and differ: another model), with a note saying what each run is."""
    own = tmp_path / "own"
    _own_run(own)
    refused = cli_here("diff", str(tiny_run), str(own))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "run A is samestep train's reference run and run B a loop of one's own" in refused.stderr
    assert " vs None" not in refused.stderr
    forced = cli_here("diff", str(tiny_run), str(own), "--force")
    assert forced.returncode == 1 and "run B a loop of one's own" in forced.stdout, forced.stdout + forced.stderr
    copy = tmp_path / "copy"
    shutil.copytree(own, copy)
    assert cli_here("diff", str(own), str(copy)).returncode == 0

"""The mistakes a loop under ``samestep.Run`` makes first: a missing ``zero_grad`` and a second ``run.steps()``
each end the program with one line naming the fix and exit 2, before the update they would spoil."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import samestep
from samestep.loop.step_checks import LoopError
from tests.support import Forked

LOOP = """
import sys, torch, samestep
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
with samestep.Run(sys.argv[1], model=model, optimizer=optimizer) as run:
    for step in run.steps(3):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
"""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _loop(
    run_dir,
    model: torch.nn.Module | None = None,
    steps: int = 3,
    zero: str | None = "after",
    twice: bool = False,
    copy: bool = False,
) -> torch.nn.Module:
    """A small loop under Run over ``model`` (a fresh one where None), which it returns; ``zero``: where it zeroes
    the gradients ("after" the update, "before" the backward, "in_place": after, keeping the tensors, or None:
    nowhere)."""
    model = model if model is not None else _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with samestep.Run(run_dir, model=model, optimizer=optimizer, copy=copy) as run:
        for _ in range(2 if twice else 1):
            for step in run.steps(steps):
                if zero == "before":
                    optimizer.zero_grad()
                for i in range(2):  # two microbatches: the second adds to the first's gradients
                    x = torch.randn(2, 4, generator=samestep.rng.generator(0, step, i, "data"))
                    model(x).sum().backward()
                optimizer.step()
                if zero == "after":
                    optimizer.zero_grad()
                elif zero == "in_place":
                    optimizer.zero_grad(set_to_none=False)
    return model


def _bits(model: torch.nn.Module) -> bytes:
    return b"".join(p.detach().reshape(-1).view(torch.uint8).numpy().tobytes() for p in model.parameters())


def test_a_loop_that_never_zeroes_its_gradients_stops_before_the_second_update(tmp_path, capsys):
    """No ``zero_grad``: step 2's backward adds to step 1's gradients, and the run ends at step 2's
    ``optimizer.step()`` with one line naming the fix and exit 2, the model as one step left it. Negative
    controls: zeroing after the update or before the backward trains all 3 steps, to one model."""
    model = _model()
    with pytest.raises(LoopError) as e:  # a Refusal: uncaught, the program ends as its code is read
        _loop(tmp_path / "none", model, zero=None)
    assert e.value.code == 2  # the interpreter reads it as it ends the program, and the line is printed
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert "step 2's backward added to the gradients of step 1" in err and "optimizer.zero_grad()" in err
    assert _bits(model) == _bits(_loop(tmp_path / "one", steps=1))
    trained = {zero: _bits(_loop(tmp_path / zero, zero=zero)) for zero in ("after", "before")}
    assert len(set(trained.values())) == 1 and trained["after"] != _bits(model)


def test_gradients_zeroed_in_place_before_their_digest_are_one_line_naming_copy(tmp_path, capsys):
    """``zero_grad(set_to_none=False)`` right after the update changes the gradients the step recorded before
    their digest is done: one line naming ``samestep.Run(..., copy=True)`` and exit 2 (not the recorder's
    ``rec.grads`` advice). Negative control: with ``copy=True`` the same loop trains, to the bits of zeroing
    by ``set_to_none``."""
    with pytest.raises(LoopError) as e:  # a Refusal: uncaught, the program ends as its code is read
        _loop(tmp_path / "in_place", zero="in_place")
    assert e.value.code == 2  # the interpreter reads it as it ends the program, and the line is printed
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "samestep.Run(..., copy=True)" in err, err
    assert "rec.grads" not in err
    assert _bits(_loop(tmp_path / "copied", zero="in_place", copy=True)) == _bits(_loop(tmp_path / "after"))


def test_a_second_steps_loop_is_refused_before_it_takes_a_step(tmp_path, capsys):
    """``run.steps()`` called again after the loop: exit 2 with one line, before any update of the second loop
    (the model is the first loop's). Negative control: the model differs from one that took a fourth step."""
    model = _model()
    with pytest.raises(LoopError) as e:  # a Refusal: uncaught, the program ends as its code is read
        _loop(tmp_path / "twice", model, twice=True)
    assert e.value.code == 2  # the interpreter reads it as it ends the program, and the line is printed
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "steps() was called a second time" in err, err
    assert _bits(model) == _bits(_loop(tmp_path / "once"))
    assert _bits(model) != _bits(_loop(tmp_path / "four", steps=4))


def test_the_program_ends_with_one_line_and_no_traceback(tmp_path):
    """As a user's script runs: stderr is the one line, the exit code 2; ``SAMESTEP_DEBUG=1`` shows the traceback
    (the negative control: the same failure, reported the other way)."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    quiet = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "a")],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert quiet.returncode == 2 and quiet.stderr.count("\n") == 1 and "Traceback" not in quiet.stderr, quiet.stderr
    loud = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "b")],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
        env={**os.environ, "SAMESTEP_DEBUG": "1"},
    )
    assert loud.returncode == 2 and "Traceback" in loud.stderr and "LoopError" in loud.stderr, loud.stderr


SETTINGS = """
import sys, torch, samestep
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=float(sys.argv[2]))
with samestep.Run(sys.argv[1], model=model, optimizer=optimizer, config={"lr": float(sys.argv[2])}) as run:
    for step in run.steps(2):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
"""


def test_runs_refusals_before_the_loop_end_a_script_with_one_line_and_exit_2(tmp_path):
    """A run directory continued under other settings, and a run directory that is a file: from a script, each
    is one line naming the field or file and the fix, exit 2, no traceback. Negative control: in this process
    the same refusal is a ValueError (a RunDirError) the caller catches, and the program goes on."""
    (tmp_path / "file").write_text("")

    def run(run_dir: str, lr: str) -> Forked:
        proc = Forked([run_dir, lr], code=SETTINGS)
        proc.wait()
        return proc

    assert run(str(tmp_path / "a"), "0.1").returncode == 0
    changed, is_file = run(str(tmp_path / "a"), "0.2"), run(str(tmp_path / "file"), "0.1")
    for proc, words in ((changed, "config.lr: 0.1 -> 0.2"), (is_file, "is a file, not a directory")):
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    from samestep.records.rundir import RunDirError

    model = torch.nn.Linear(4, 1)
    with pytest.raises(RunDirError, match="is a file, not a directory"):
        samestep.Run(tmp_path / "file", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _keyed(run_dir, dropout: str) -> list[str]:
    """Three steps of a keyed loop whose dropout draws from torch's global generator ("global") or from
    ``samestep.rng.generator`` ("keyed"); the warnings it gave."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with samestep.Run(run_dir, model=model, optimizer=optimizer, rng="keyed") as run:
            for step in run.steps(3):
                x = torch.randn(2, 4, generator=samestep.rng.generator(0, step, 0, "data"))
                if dropout == "global":
                    x = torch.nn.functional.dropout(x, 0.5)
                else:
                    keep = torch.rand(x.shape, generator=samestep.rng.generator(0, step, 0, "dropout")) >= 0.5
                    x = x * keep * 2
                model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    return [str(w.message) for w in caught if "global generator" in str(w.message)]


def test_a_keyed_loop_that_draws_from_the_global_generator_is_warned_once_by_step(tmp_path):
    """rng="keyed" and a dropout on torch's global generator: one warning, naming step 1 and the fix. Negative
    control: the same dropout drawn from samestep.rng.generator gives none."""
    said = _keyed(tmp_path / "global", "global")
    assert len(said) == 1 and "step 1 drew from torch's global generator" in said[0], said
    assert "samestep.rng.generator" in said[0]
    assert _keyed(tmp_path / "keyed", "keyed") == []


def _prefetching(run_dir, ahead: bool) -> list[str]:
    """Three steps of nanoGPT's shape under rng="restore": each step's batch drawn from torch's global
    generator, ``ahead`` at the end of the step before (its prefetch), else inside the step; the warnings."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with samestep.Run(run_dir, model=model, optimizer=optimizer) as run:
            batch = torch.randn(2, 4)
            for _ in run.steps(3):
                if not ahead:
                    batch = torch.randn(2, 4)
                model(batch).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                if ahead:
                    batch = torch.randn(2, 4)  # the next step's, while this one's checkpoint is not yet written
    return [str(w.message) for w in caught if "global generator" in str(w.message)]


def test_a_batch_fetched_after_the_update_is_warned_once_by_step(tmp_path):
    """A loop that draws the next step's batch after this step's update (nanoGPT's prefetch): its checkpoint
    holds the generator after the draw, not the batch, and a stop on a signal leaves no receipt past it to
    catch the resume that trains on another batch: one warning, naming step 1 and the fix. Negative control:
    the batch drawn inside its step gives none."""
    said = _prefetching(tmp_path / "ahead", ahead=True)
    assert len(said) == 1 and "step 1 drew from torch's global generator after its update" in said[0], said
    assert "before optimizer.step()" in said[0]
    assert _prefetching(tmp_path / "inside", ahead=False) == []


def _loader_loop(run_dir, held: bool) -> list[str]:
    """Two steps over a shuffled loader: a torch DataLoader kept by the loop, or a StatefulDataLoader with its
    generator given to Run as ``data_cursor``; the warnings about a loose loader."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = torch.arange(32, dtype=torch.float32).reshape(16, 2)
    if held:
        loader = StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with samestep.Run(run_dir, model=model, optimizer=optimizer, data_cursor=loader if held else None) as run:
            batches = iter(loader)
            for _ in run.steps(2):
                model(next(batches)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    return [str(w.message) for w in caught if "is not the data_cursor" in str(w.message)]


def test_a_shuffled_loader_kept_outside_run_is_warned_after_the_first_step(tmp_path):
    """A shuffled DataLoader the loop keeps: one warning after step 1 naming data_cursor. Negative control: the
    loader given to Run as its data cursor gives none."""
    said = _loader_loop(tmp_path / "loose", held=False)
    assert len(said) == 1 and "data_cursor=loader" in said[0], said
    assert _loader_loop(tmp_path / "held", held=True) == []

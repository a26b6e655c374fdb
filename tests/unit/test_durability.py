"""What a crash cannot take: the trace and metrics of every step a checkpoint holds are written and
fsync'ed before it commits; a checkpoint directory named ``step_*`` is whole at every instant of a save
and of pruning; loaders take the newest save (docs/formats.md)."""

from __future__ import annotations

import importlib
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

import samestep
from samestep.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, verify_checkpoint
from samestep.records.metrics import read_metrics
from samestep.tracing import Recorder, read_stream, stream_path
from samestep.tracing.stream import END
from samestep.train import load_config
from samestep.train import loop as loop_module
from tests.support import TINY

thread_worker = importlib.import_module("samestep.tracing.thread_worker")
save_mod = importlib.import_module("samestep.checkpoint.save")


def _watch_saves(monkeypatch, run: Path) -> list[dict]:
    """At each checkpoint save: the steps whose step.end record the stream holds, the last step in
    metrics.jsonl, and the files fsync'ed since the previous save."""
    synced: set[str] = set()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    seen: list[dict] = []
    real_save = loop_module.save_checkpoint

    def save(root, step, **kw):
        try:
            table = read_stream(stream_path(run, 0)).table
            ended = {s for s, op in zip(table.column("step").to_pylist(), table.column("op").to_pylist()) if op == END}
        except (ValueError, FileNotFoundError):  # nothing written yet, not even the stream's header
            ended = set()
        seen.append({"step": step, "ended": ended, "metrics": read_metrics(run)[-1]["step"], "synced": set(synced)})
        synced.clear()
        return real_save(root, step, **kw)

    monkeypatch.setattr(loop_module, "save_checkpoint", save)
    return seen


# The process worker's child is a fresh interpreter: its writes are slowed by a sitecustomize it imports at start.
_SLOW_CHILD = """
import time
import samestep.tracing.writer as writer
real = writer.write_lanes
writer.write_lanes = lambda *args: (time.sleep(0.3), real(*args))[1]
"""


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_checkpoints_commit_after_their_steps_trace_and_metrics_are_durable(tmp_path, monkeypatch, worker):
    """Each save of ``samestep train`` finds its step's step.end record in the trace stream and its metrics
    line in metrics.jsonl, both fsync'ed since the previous save (the process worker fsyncs in its child,
    so there only the stream's contents are checked here). The stream's writer is slowed down (in the child,
    for the process worker), so a save that did not wait would find the record missing: the negative control,
    with ``Recorder.sync`` a no-op, does."""
    if worker == "thread":
        real_write = thread_worker.write_lanes

        def slow_write(*args):
            time.sleep(0.3)
            real_write(*args)

        monkeypatch.setattr(thread_worker, "write_lanes", slow_write)
    else:
        (tmp_path / "slow").mkdir()
        (tmp_path / "slow" / "sitecustomize.py").write_text(_SLOW_CHILD)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "slow"), os.environ.get("PYTHONPATH", "")]))
    cfg = load_config(None, [*TINY, "train.steps=4", "trace.level=step", f"trace.worker={worker}"])
    seen = _watch_saves(monkeypatch, tmp_path / "run")
    with samestep.enable(threads=1):
        loop_module.train(cfg, tmp_path / "run", out=lambda _: None)
    assert [s["step"] for s in seen] == [2, 4]
    for s in seen:
        assert s["step"] in s["ended"] and s["metrics"] == s["step"]
        if worker == "thread":
            assert {str(stream_path(tmp_path / "run", 0)), str(tmp_path / "run" / "metrics.jsonl")} <= s["synced"]
    monkeypatch.setattr(Recorder, "sync", lambda self: None)
    seen = _watch_saves(monkeypatch, tmp_path / "unsynced")
    with samestep.enable(threads=1):
        loop_module.train(cfg, tmp_path / "unsynced", out=lambda _: None)
    assert any(s["step"] not in s["ended"] for s in seen)


def _state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    return model, opt


def _save(root: Path, step: int, **kw) -> Path:
    model, opt = _state(step)
    return save_checkpoint(root, step, model=model, optimizer=opt, **kw)


def _named_ones_verify(root: Path) -> list[str]:
    """The step directories of ``root``, each verified (a CheckpointError names one that is not whole)."""
    names = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    for name in names:
        verify_checkpoint(root / name)
    return names


class _Killed(BaseException):
    """Stands for a SIGKILL at that instant: nothing after it runs, and what is on disk stays."""


def test_a_crash_mid_prune_leaves_every_named_checkpoint_whole(tmp_path, monkeypatch):
    """A save with ``keep=2`` killed while deleting the oldest checkpoint (after one of its files went):
    every ``step_*`` directory left is whole, the half-deleted one has a hidden name, and the next save
    clears it. Negative control: deleting in place, as ``shutil.rmtree(step_dir)`` does, leaves a named
    ``step_*`` directory that fails verification."""
    root = tmp_path / "ckpt"
    for step in (1, 2):
        _save(root, step, keep=2)
    real_rmtree = save_mod.shutil.rmtree

    def killed_rmtree(path, *a, **kw):
        victim = Path(path)
        if victim.is_dir() and (victim / "state.json").exists():
            (victim / "state.json").unlink()
            raise _Killed
        return real_rmtree(path, *a, **kw)

    monkeypatch.setattr(save_mod.shutil, "rmtree", killed_rmtree)
    with pytest.raises(_Killed):
        _save(root, 3, keep=2)
    assert _named_ones_verify(root) == ["step_000002", "step_000003"]
    assert (root / ".step_000001.prune").is_dir()
    monkeypatch.setattr(save_mod.shutil, "rmtree", real_rmtree)
    _save(root, 4, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000003", "step_000004"]

    monkeypatch.setattr(save_mod.shutil, "rmtree", killed_rmtree)
    monkeypatch.setattr(save_mod, "_prune", lambda root_, path: save_mod.shutil.rmtree(path))
    with pytest.raises(_Killed):
        _save(root, 5, keep=2)
    with pytest.raises(CheckpointError, match="step_000003"):
        _named_ones_verify(root)


def test_a_symlinked_old_checkpoint_is_pruned_as_a_name_only(tmp_path):
    """An old checkpoint that is a symbolic link to a directory elsewhere (kept by hand): pruning removes
    the link, later saves go on, and what it pointed at is untouched. Negative control: removing it the
    way a directory is removed fails (``shutil.rmtree`` refuses links), so every later save would."""
    root, kept = tmp_path / "ckpt", tmp_path / "archive"
    _save(root, 1)
    (root / "step_000001").rename(kept)
    (root / "step_000001").symlink_to(kept)
    before = {p.name: p.read_bytes() for p in kept.iterdir()}
    for step in (2, 3):
        _save(root, step, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == before
    (root / "step_000001").symlink_to(kept)
    with pytest.raises(OSError):
        shutil.rmtree(root / "step_000001")


def test_a_save_moves_later_steps_of_an_abandoned_line_aside(tmp_path):
    """Checkpoints 1, 2 and 3; the loop goes back to step 1 and saves step 2 again: the old step 3 moves to
    ``superseded/`` (with a warning; nothing is deleted), and loading the root takes the new step 2.
    Negative control: without moving it, the root's newest committed checkpoint is the abandoned step 3."""
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        _save(root, step)
    old3 = (root / "step_000003" / "model.safetensors").read_bytes()
    with pytest.warns(RuntimeWarning, match=r"step_000003: a later step than the checkpoint being saved \(2\)"):
        _save(root, 2)
    assert (root / "superseded" / "step_000003" / "model.safetensors").read_bytes() == old3
    model, opt = _state(0)
    assert load_checkpoint(root, model=model, optimizer=opt).step == 2
    assert _named_ones_verify(root) == ["step_000001", "step_000002"]

    other = tmp_path / "other"
    for step in (1, 2, 3):
        _save(other, step)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(save_mod, "_supersede", lambda root_, step: None)
        _save(other, 2)
    assert load_checkpoint(other, model=model, optimizer=opt).step == 3


def test_a_second_tracer_of_a_users_run_is_refused_until_the_first_closes(tmp_path):
    """``samestep.trace`` of a loop of your own takes the run directory for rank 0 until its recorder
    closes: a second tracer of the same run (a requeued job beside the live one) is refused, naming the
    holder's pid, with nothing written. Negative control: once the first closes, the same call resumes."""
    import socket

    from samestep.records.rundir import RunDirError

    run = tmp_path / "run"
    model = torch.nn.Linear(4, 1)
    first = samestep.trace(run, level="step")
    first.attach(model)
    with first.step(1):
        first.metric("loss", 1.0)
    first.sync()
    before = {p.name: p.read_bytes() for p in (run / "trace").iterdir()}, (run / "run.json").read_bytes()
    with pytest.raises(RunDirError, match=rf"{run} is in use by pid {os.getpid()} on host {socket.gethostname()}"):
        samestep.trace(run, level="step", resume=True)
    assert ({p.name: p.read_bytes() for p in (run / "trace").iterdir()}, (run / "run.json").read_bytes()) == before
    first.close()
    second = samestep.trace(run, level="step", resume=True)
    second.close()

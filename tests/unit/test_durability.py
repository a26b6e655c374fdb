"""What a crash cannot take: the trace and metrics of every step a checkpoint holds are written and
fsync'ed before it commits (docs/formats.md, run directory)."""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path

import pytest

import samestep
from samestep.rundir import read_metrics
from samestep.tracing import read_stream, stream_path
from samestep.tracing.stream import END
from samestep.train import load_config
from samestep.train import loop as loop_module
from tests.conftest import TINY

thread_worker = importlib.import_module("samestep.tracing.thread_worker")


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
            ended = {s for s, op in zip(table.column("step").to_pylist(), table.column("op").to_pylist())
                     if op == END}
        except (ValueError, FileNotFoundError):  # nothing written yet, not even the stream's header
            ended = set()
        seen.append({"step": step, "ended": ended, "metrics": read_metrics(run)[-1]["step"], "synced": set(synced)})
        synced.clear()
        return real_save(root, step, **kw)

    monkeypatch.setattr(loop_module, "save_checkpoint", save)
    return seen


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_checkpoints_commit_after_their_steps_trace_and_metrics_are_durable(tmp_path, monkeypatch, worker):
    """Each save of ``samestep train`` finds its step's step.end record in the trace stream and its metrics
    line in metrics.jsonl, both fsync'ed since the previous save (the process worker fsyncs in its child,
    so there only the stream's contents are checked here). The stream's writer is slowed down, so a save
    that did not wait would find the record missing: the negative control, with ``Recorder.sync`` a
    no-op, does."""
    if worker == "thread":
        real_write = thread_worker.write_lanes

        def slow_write(*args):
            time.sleep(0.3)
            real_write(*args)

        monkeypatch.setattr(thread_worker, "write_lanes", slow_write)
    cfg = load_config(None, [*TINY, "train.steps=4", "trace.level=step", f"trace.worker={worker}"])
    seen = _watch_saves(monkeypatch, tmp_path / "run")
    with samestep.enable(threads=1):
        loop_module.train(cfg, tmp_path / "run", out=lambda _: None)
    assert [s["step"] for s in seen] == [2, 4]
    for s in seen:
        assert s["step"] in s["ended"] and s["metrics"] == s["step"]
        if worker == "thread":
            assert {str(stream_path(tmp_path / "run", 0)), str(tmp_path / "run" / "metrics.jsonl")} <= s["synced"]
    if worker == "process":
        return
    monkeypatch.setattr(loop_module.Recorder, "sync", lambda self: None)
    seen = _watch_saves(monkeypatch, tmp_path / "unsynced")
    with samestep.enable(threads=1):
        loop_module.train(cfg, tmp_path / "unsynced", out=lambda _: None)
    assert any(s["step"] not in s["ended"] for s in seen)

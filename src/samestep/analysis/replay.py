"""Replaying part of a ``samestep train`` run into a scratch run directory: what ``samestep verify`` and
``samestep bisect`` are made of.

A replay starts from a checkpoint of the run (its step directory copied, with the metrics and receipts
up to it), or from scratch at step 0, and runs ``samestep train --resume`` in a new process with the
run's recorded config and the layout it had then, plus any numerics-neutral settings (a trace level).
The run's bits do not depend on where it runs, so the replay's receipts and traces are the run's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from samestep._state import dotted
from samestep.checkpoint import committed_steps, step_dir_name
from samestep.env import numerics_differences
from samestep.receipts import read_run_receipts, receipts_path
from samestep.rundir import checkpoints_dir, layout_at, metrics_path, read_metrics, read_run, receipts_dir

__all__ = ["ReplayError", "check_replayable", "environment_differences", "replay", "replay_start"]


class ReplayError(RuntimeError):
    """A replay could not run (its process failed): not a verdict on the run."""


def check_replayable(run_dir: Path, doc: dict[str, Any]) -> None:
    """Refuses a run this module cannot replay: a loop of one's own, whose code only its owner has.

    Raises:
        ReplayError: names the run and what to use instead.
    """
    if doc.get("written_by") == "samestep.trace":
        raise ReplayError(f"{run_dir} is a run of a loop of your own (samestep.trace or samestep.Run wrote its "
                          "run.json): only samestep train's runs can be replayed here; check its receipts with "
                          "samestep receipts verify, or compare two runs with samestep diff")


def replay_start(run_dir: Path, before: int) -> int:
    """The step of the newest committed checkpoint of the run at or before ``before`` (0: from scratch)."""
    return next((s for s, _ in committed_steps(checkpoints_dir(run_dir)) if s <= before), 0)


def environment_differences(doc: dict[str, Any], replayed: Path) -> dict[str, tuple[Any, Any]]:
    """How the replay's environment differs from the run's, in fields that can change a bit
    (``env.numerics_differences``)."""
    return numerics_differences(doc.get("environment", {}), read_run(replayed).get("environment", {}))


def replay(run_dir: Path, scratch: Path, start: int, end: int, settings: tuple[str, ...] = (),
           timeout: float = 3600) -> None:
    """Replays steps ``start + 1`` to ``end`` of the run in ``run_dir`` into ``scratch`` (a new directory),
    from its checkpoint of step ``start`` (0: from scratch), with ``settings`` (``section.key=value``, only
    numerics-neutral ones keep the run's bits) over the run's config.

    Raises:
        ReplayError: the replay's process failed; the message ends with its last lines of stderr.
    """
    doc = read_run(run_dir)
    check_replayable(run_dir, doc)
    scratch.mkdir(parents=True)
    if start:
        shutil.copytree(checkpoints_dir(run_dir) / step_dir_name(start), checkpoints_dir(scratch) / step_dir_name(start))
        rows = [json.dumps(r) + "\n" for r in read_metrics(run_dir) if r["step"] <= start]
        metrics_path(scratch).write_text("".join(rows), encoding="utf-8")
        for rank, (header, receipts) in read_run_receipts(run_dir).items():
            receipts_dir(scratch).mkdir(exist_ok=True)
            kept = [header, *(r for r in receipts if r["step"] <= start)]
            receipts_path(scratch, rank).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept),
                                                    encoding="utf-8")
    layout = layout_at(doc, start + 1)  # the layout that ran the first step replayed
    config = dotted(doc["config"])
    config["parallel.fsdp"] = layout.get("sharded") == "fsdp2"
    config["parallel.tp"] = layout["tensor_parallel"]
    args = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in config.items()]
    cmd = [sys.executable, "-m", "samestep", "train", "--run-dir", str(scratch), "--nproc",
           str(layout.get("world_size", 1)), "--stop-after", str(end - start),
           *(["--resume"] if start else []), *(a for s in [*args, *settings] for a in ("--set", s))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise ReplayError(f"the replay of steps {start + 1}-{end} of {run_dir} failed (exit {proc.returncode}): {tail}")

"""Replaying part of a run into a scratch run directory: what ``samestep verify`` and ``samestep bisect`` are
made of.

A replay starts from a checkpoint of the run (its step directory copied, with the metrics and receipts
up to it), or from scratch at step 0. A ``samestep train`` run is replayed by ``samestep train --resume`` in
a new process with the run's recorded config and the layout it had then, plus any numerics-neutral settings
(a trace level). A loop of one's own (``samestep.Run``) is replayed by running its recorded program again
(``program.relaunch``: its interpreter, arguments, directory, launcher and process count) under a replay
request (``replay_request``): its Run works in the scratch directory, traces as asked and ends the process
after the last step; a framework's run (the Hugging Face or Lightning callback) likewise, resuming from a copy
of the framework's own checkpoint (``resume_points``). The run's bits do not depend on where it runs, so the
replay's receipts and traces are the run's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from samestep import program, resume_points
from samestep._state import dotted
from samestep.checkpoint import committed_steps, step_dir_name
from samestep.env import numerics_differences
from samestep.receipts import read_run_receipts, receipts_path
from samestep.replay_request import REFUSAL, ReplayRequest
from samestep.rundir import checkpoints_dir, holds_run, layout_at, metrics_path, read_metrics, read_run, receipts_dir

__all__ = ["ReplayError", "ReplayRefused", "check_replayable", "checkpoint_steps", "environment_differences",
           "framework_run", "replay", "replay_start"]


class ReplayError(RuntimeError):
    """A replay could not run (its process failed): not a verdict on the run."""


class ReplayRefused(ReplayError):
    """The replayed program refused to resume from the run's checkpoint: it is not the state the run's receipt of
    its step records (a verdict on the checkpoint)."""


def framework_run(doc: dict[str, Any]) -> bool:
    """Whether a framework saves the run's checkpoints (the Hugging Face or Lightning callback's run)."""
    return doc.get("written_by") == "samestep.trace" and resume_points.resumed_by(doc) != resume_points.RUN


def check_replayable(run_dir: Path, doc: dict[str, Any]) -> None:
    """Refuses a run this module cannot replay: a loop of one's own that recorded no program (it traced itself
    with ``samestep.trace``, not through ``samestep.Run``), or one whose program cannot run again (a notebook,
    ``-c``, stdin, several nodes).

    Raises:
        ReplayError: names the run, why, and what to use instead.
    """
    if doc.get("written_by") != "samestep.trace":
        return
    programs = [p for p in doc.get("programs", []) if isinstance(p, dict)]
    if not programs:
        raise ReplayError(f"{run_dir / 'run.json'} records no program to run again (the loop traced itself with "
                          "samestep.trace): train through samestep.Run, the HF or Lightning callback or the "
                          "torchtitan integration to replay it; check its receipts with samestep receipts verify, "
                          "or compare two runs with samestep diff")
    for p in programs:
        if p.get("not_replayable"):
            program.check(p, run_dir)  # raises, naming why


def checkpoint_steps(run_dir: Path) -> set[int]:
    """The steps of the run's checkpoints a replay can start from: samestep's committed ones, or a framework's
    (``resume_points``)."""
    doc = read_run(run_dir)
    if framework_run(doc):
        return set(resume_points.points(run_dir, doc))
    return {s for s, _ in committed_steps(checkpoints_dir(run_dir))}


def replay_start(run_dir: Path, before: int) -> int:
    """The step of the newest checkpoint of the run at or before ``before`` (0: from scratch)."""
    return max((s for s in checkpoint_steps(run_dir) if s <= before), default=0)


def environment_differences(doc: dict[str, Any], replayed: Path) -> dict[str, tuple[Any, Any]]:
    """How the replay's environment differs from the run's, in fields that can change a bit
    (``env.numerics_differences``)."""
    return numerics_differences(doc.get("environment", {}), read_run(replayed).get("environment", {}))


def replay(run_dir: Path, scratch: Path, start: int, end: int, settings: tuple[str, ...] = (),
           timeout: float = 3600, force: bool = False) -> list[str]:
    """Replays steps ``start + 1`` to ``end`` of the run in ``run_dir`` into ``scratch`` (a new directory),
    from its checkpoint of step ``start`` (0: from scratch), with ``settings`` (``section.key=value``, only
    numerics-neutral ones keep the run's bits; a loop of one's own takes ``trace.level`` and ``trace.steps``)
    over the run's config. Returns notes for the verdict (a changed program replayed with ``force``).

    Raises:
        ReplayError: the replay's process failed (the message ends with its last lines of stderr), or a loop of
            one's own whose program changed since the run (without ``force``); ProgramError: its program cannot
            run again here.
    """
    doc = read_run(run_dir)
    check_replayable(run_dir, doc)
    scratch.mkdir(parents=True)
    resume_from = None
    if framework_run(doc):  # a seed checkpoint of step 0 (torchtitan's) is copied too
        point = resume_points.points(run_dir, doc).get(start)
        resume_from = None if point is None else resume_points.stage(point, scratch, doc)
    elif start:
        name = step_dir_name(start)
        shutil.copytree(checkpoints_dir(run_dir) / name, checkpoints_dir(scratch) / name)
    if start:
        if metrics_path(run_dir).exists():  # samestep train's (a loop of one's own keeps its metrics in the trace)
            rows = [json.dumps(r) + "\n" for r in read_metrics(run_dir) if r["step"] <= start]
            metrics_path(scratch).write_text("".join(rows), encoding="utf-8")
        for rank, (header, receipts) in read_run_receipts(run_dir).items():
            receipts_dir(scratch).mkdir(exist_ok=True)
            kept = [header, *(r for r in receipts if r["step"] <= start)]
            receipts_path(scratch, rank).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept),
                                                    encoding="utf-8")
    if doc.get("written_by") == "samestep.trace":
        return _replay_program(run_dir, doc, scratch, start, end, dict(s.split("=", 1) for s in settings), timeout,
                               force, resume_from)
    layout = layout_at(doc, start + 1)  # the layout that ran the first step replayed
    config = dotted(doc["config"])
    config["parallel.fsdp"] = layout.get("sharded") == "fsdp2"
    config["parallel.tp"] = layout["tensor_parallel"]
    args = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in config.items()]
    cmd = [sys.executable, "-m", "samestep", "train", "--run-dir", str(scratch), "--nproc",
           str(layout.get("world_size", 1)), "--stop-after", str(end - start),
           *(["--resume"] if start else []), *(a for s in [*args, *settings] for a in ("--set", s))]
    _run(cmd, f"the replay of steps {start + 1}-{end} of {run_dir}", timeout)
    return []


def _run(cmd: list[str], what: str, timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    """Runs a replay's process to its end.

    Raises:
        ReplayError: it failed; names ``what`` and ends with its last lines of stderr.
    """
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise ReplayError(f"{what} failed (exit {proc.returncode}): {tail}")


def _replay_program(run_dir: Path, doc: dict[str, Any], scratch: Path, start: int, end: int,
                    settings: dict[str, str], timeout: float, force: bool, resume_from: Path | None) -> list[str]:
    """``replay`` of a loop of one's own: its recorded program run again under a replay request (resuming a
    framework's run from ``resume_from``).

    Raises:
        ReplayRefused: the program refused its resume from the run's checkpoint (names why).
    """
    ran = program.program_at(doc, start + 1)
    if ran is None:
        raise ReplayError(f"{run_dir / 'run.json'} records no program for step {start + 1} (its programs start "
                          "later): replay steps a recorded program ran")
    changed = program.check(ran, run_dir)
    if changed and not force:
        raise ReplayError(f"{run_dir}: the program changed since the run ({'; '.join(changed[:3])}"
                          f"{' ...' if len(changed) > 3 else ''}): a replay would run other code; restore it, or "
                          "pass --force (the verdict then says so)")
    nproc = ran.get("launcher", {}).get("nproc_per_node", 1)
    if doc.get("environment", {}).get("cuda.device_count") and nproc > (here := _gpus_here()):
        raise ReplayError(f"{run_dir} ran {nproc} processes a node on GPUs; this machine has {here}: replay it on a "
                          "machine with as many")
    # the directory the program's Run names: where a copy or a move of the run is replayed from, it is not this one
    request = ReplayRequest(run_dir=str(program.run_dir_of(ran)), into=str(scratch.resolve()), stop_after=end,
                            level=settings.get("trace.level", "off"), trace_steps=settings.get("trace.steps"),
                            resume_from=None if resume_from is None else str(resume_from.resolve()))
    cmd, cwd, env = program.relaunch(ran)
    try:
        _run(cmd, f"the replay of steps {start + 1}-{end} of {run_dir} ({' '.join(cmd)})", timeout, cwd,
             {**env, **request.to_env()})
    except ReplayError:
        if (scratch / REFUSAL).is_file():
            raise ReplayRefused((scratch / REFUSAL).read_text(encoding="utf-8").strip()) from None
        raise
    if not holds_run(scratch):
        raise ReplayError(f"the replay of {run_dir} ({' '.join(cmd)}) ended (exit 0) before its samestep.Run of "
                          f"{run_dir} started: the program no longer reaches it as it ran")
    return [f"the program changed since the run, replayed as it is now (--force): {'; '.join(changed)}"] if changed \
        else []


def _gpus_here() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0

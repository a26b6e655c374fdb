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

``plan`` says what a replay will run (``consent.Launch``: shown to the verifier, who agrees before a program of
the run's runs, ``consent.Consent``) and refuses what it cannot check; ``replay`` runs a plan into a scratch
directory, its process dying with the verifier (``scratch.run_child``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from samestep.checkpoint import committed_steps, step_dir_name
from samestep.determinism.env import ENV_VARS, numerics_differences
from samestep.hashing.state import dotted
from samestep.records.metrics import read_metrics
from samestep.records.receipts import read_run_receipts, receipts_path
from samestep.records.rundir import checkpoints_dir, holds_run, layout_at, metrics_path, read_run, receipts_dir
from samestep.replay import program, resume_points
from samestep.replay.consent import Launch
from samestep.replay.request import REFUSAL, ReplayRequest, process_mark
from samestep.replay.scratch import run_child

__all__ = [
    "Plan",
    "ReplayError",
    "ReplayRefused",
    "check_replayable",
    "checkpoint_steps",
    "environment_differences",
    "framework_run",
    "plan",
    "replay",
    "replay_start",
    "unrecorded_sources",
]


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
        raise ReplayError(
            f"{run_dir / 'run.json'} records no program to run again (the loop traced itself with "
            "samestep.trace): train through samestep.Run, the HF or Lightning callback or the "
            "torchtitan integration to replay it; check its receipts with samestep receipts verify, "
            "or compare two runs with samestep diff"
        )
    for p in programs:
        if p.get("not_replayable"):
            program.check(p, run_dir)  # raises, naming why


def checkpoint_steps(run_dir: Path, doc: dict[str, Any] | None = None) -> set[int]:
    """The steps of the run's checkpoints a replay can start from: samestep's committed ones, or a framework's
    (``resume_points``). ``doc``: run.json, where the caller read it already."""
    doc = read_run(run_dir) if doc is None else doc
    if framework_run(doc):
        return set(resume_points.points(run_dir, doc))
    return {s for s, _ in committed_steps(checkpoints_dir(run_dir))}


def replay_start(run_dir: Path, before: int, doc: dict[str, Any] | None = None) -> int:
    """The step of the newest checkpoint of the run at or before ``before`` (0: from scratch)."""
    return max((s for s in checkpoint_steps(run_dir, doc) if s <= before), default=0)


def environment_differences(doc: dict[str, Any], replayed: Path) -> dict[str, tuple[Any, Any]]:
    """How the replay's environment differs from the run's, in fields that can change a bit
    (``env.numerics_differences``)."""
    return numerics_differences(doc.get("environment", {}), read_run(replayed).get("environment", {}))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A replay of steps ``start + 1`` to ``end`` of a run, checked and ready to run (``plan``)."""

    run_dir: Path
    doc: dict[str, Any]
    start: int
    end: int
    launch: Launch
    """What it runs, as the verifier is shown it."""
    program: dict[str, Any] | None = None
    """A loop of one's own: the program record it runs (the run's, or with the verifier's command line)."""
    env: dict[str, str] = field(default_factory=dict)
    """The whole environment of its process (a program's)."""
    changed: tuple[str, ...] = ()
    """The program's files changed since the run (``program.check``; replayed only with ``force``)."""
    notes: tuple[str, ...] = ()
    """For the verdict: what the replay does otherwise than the record says, and why."""


def plan(
    run_dir: Path,
    start: int,
    end: int,
    *,
    force: bool = False,
    given: list[str] | None = None,
    doc: dict[str, Any] | None = None,
) -> Plan:
    """What a replay of steps ``start + 1`` to ``end`` of the run in ``run_dir`` runs, from its checkpoint of step
    ``start`` (0: from scratch): ``samestep train`` with the run's config, or the program that ran step
    ``start + 1`` (with ``given``: the verifier's command line in its place), checked. ``doc``: run.json as the
    caller read it and checked it replayable (``check_replayable``); without it, read and checked here.

    Raises:
        ReplayError: a program of one's own that changed since the run (without ``force``) or is not recorded
            for that step; ProgramError: that program cannot run again here (how it was started, a record that
            disagrees with itself, more processes than this machine has).
    """
    run_dir = Path(run_dir)
    if doc is None:
        doc = read_run(run_dir)
        check_replayable(run_dir, doc)
    if doc.get("written_by") != "samestep.trace":
        return _train_plan(run_dir, doc, start, end)
    ran = program.program_at(doc, start + 1)
    if ran is None:
        raise ReplayError(
            f"{run_dir / 'run.json'} records no program for step {start + 1} (its programs start "
            "later): replay steps a recorded program ran"
        )
    interpreter, notes = None, []
    if given is not None:
        ran, interpreter = program.given(ran, given, Path.cwd())
    elif ran.get("executable") != sys.executable:
        notes.append(f"run under this interpreter ({sys.executable}), not the recorded {ran.get('executable')}")
    changed = program.check(ran, run_dir)
    if changed and not force:
        raise ReplayError(
            f"{run_dir}: the program changed since the run ({'; '.join(changed[:3])}"
            f"{' ...' if len(changed) > 3 else ''}): a replay would run other code; restore it, or "
            "pass --force (the verdict then says so)"
        )
    if changed:
        notes.append(f"the program changed since the run, replayed as it is now (--force): {'; '.join(changed)}")
    gpus = _gpus_here() if doc.get("environment", {}).get("cuda.device_count") else None  # None: a CPU run
    nproc = program.process_cap(ran, run_dir, gpus)
    ignored = program.ignored_env(ran)
    if ignored:
        notes.append(
            f"not applied from the record: {', '.join(ignored)} (a replay applies only the variables that change bits)"
        )
    cmd, cwd, env = program.relaunch(ran, interpreter)
    applied = {k: env[k] for k in ENV_VARS if isinstance(ran.get("env", {}).get(k), str)}
    launch = Launch(
        run_dir=run_dir,
        cmd=cmd,
        cwd=cwd,
        env=applied,
        nproc=nproc,
        identity=program.identity(ran),
        given=given is not None,
        ignored=tuple(ignored),
        cap=program.machine_cap(gpus),
    )
    return Plan(
        run_dir=run_dir,
        doc=doc,
        start=start,
        end=end,
        launch=launch,
        program=ran,
        env=env,
        changed=tuple(changed),
        notes=tuple(notes),
    )


def _train_plan(run_dir: Path, doc: dict[str, Any], start: int, end: int) -> Plan:
    """``plan`` of a ``samestep train`` run: samestep's trainer on the layout that ran step ``start + 1``.

    Raises:
        ReplayError: that layout's process count is not one.
    """
    nproc = layout_at(doc, start + 1).get("world_size", 1)
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ReplayError(
            f"{run_dir / 'run.json'}: the layout of step {start + 1} has world_size={nproc!r}, not a "
            "process count (an integer >= 1): the run cannot be replayed"
        )
    device = dotted(doc.get("config", {})).get("train.device", "auto")
    gpus = _gpus_here() if device == "cuda" or (device == "auto" and _gpus_here()) else None
    launch = Launch(
        run_dir=run_dir,
        cmd=[sys.executable, "-m", "samestep", "train"],
        cwd=Path.cwd(),
        nproc=nproc,
        cap=program.machine_cap(gpus),
    )
    return Plan(run_dir=run_dir, doc=doc, start=start, end=end, launch=launch)


def replay(plan: Plan, scratch: Path, settings: tuple[str, ...] = (), timeout: float = 3600) -> list[str]:
    """Replays ``plan`` into ``scratch`` (a new directory) with ``settings`` (``section.key=value``, only
    numerics-neutral ones keep the run's bits; a loop of one's own takes ``trace.level`` and ``trace.steps``)
    over the run's config. Returns notes for the verdict (``plan.notes``). Run a program of the run's only on
    the verifier's word (``consent.Consent.grant`` of ``plan.launch``).

    Raises:
        ReplayError: the replay's process failed (the message ends with its last lines of stderr);
            ReplayRefused: the program refused its resume from the run's checkpoint.
    """
    run_dir, doc, start, end = plan.run_dir, plan.doc, plan.start, plan.end
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
            receipts_path(scratch, rank).write_text(
                "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept), encoding="utf-8"
            )
    if plan.program is not None:
        _replay_program(plan, scratch, dict(s.split("=", 1) for s in settings), timeout, resume_from)
        return list(plan.notes)
    layout = layout_at(doc, start + 1)  # the layout that ran the first step replayed
    config = dotted(doc["config"])
    config["parallel.fsdp"] = layout.get("sharded") == "fsdp2"
    config["parallel.tp"] = layout["tensor_parallel"]
    args = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in config.items()]
    cmd = [
        *plan.launch.cmd,
        "--run-dir",
        str(scratch),
        "--nproc",
        str(plan.launch.nproc),
        "--stop-after",
        str(end - start),
        *(["--resume"] if start else []),
        *(a for s in [*args, *settings] for a in ("--set", s)),
    ]
    _run(cmd, f"the replay of steps {start + 1}-{end} of {run_dir}", timeout)
    return list(plan.notes)


def unrecorded_sources(plan: Plan, scratch: Path) -> list[str]:
    """The files of the working tree the replayed program ran (as its own record in ``scratch`` says) other than
    those the verifier was shown (``plan.launch.identity``: the run's hashed files as they are now), as
    ``"path: why"``. Empty for ``samestep train``, and where the replay recorded no program (torchtitan's)."""
    if plan.program is None or plan.launch.identity is None:
        return []
    replayed = program.program_at(read_run(scratch), plan.start + 1) if holds_run(scratch) else None
    if replayed is None:
        return []
    shown = plan.launch.identity["files"]
    return [
        f"{name}: {'not hashed by the run' if name not in shown else 'changed while the replay ran'}"
        for name, sha in replayed.get("sources", {}).items()
        if shown.get(name) != sha
    ]


def _run(cmd: list[str], what: str, timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    """Runs a replay's process to its end (``scratch.run_child``: it dies with this process).

    Raises:
        ReplayError: it failed; names ``what`` and ends with its last lines of stderr.
    """
    try:
        proc = run_child(cmd, timeout=timeout, cwd=cwd, env=env)
    except subprocess.TimeoutExpired:
        raise ReplayError(f"{what} ran past {timeout:.0f} s and was stopped") from None
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise ReplayError(f"{what} failed (exit {proc.returncode}): {tail}")


def _replay_program(
    plan: Plan, scratch: Path, settings: dict[str, str], timeout: float, resume_from: Path | None
) -> None:
    """``replay`` of a loop of one's own: its program run again under a replay request (resuming a framework's
    run from ``resume_from``).

    Raises:
        ReplayRefused: the program refused its resume from the run's checkpoint (names why).
    """
    # the directory the program's Run names: where a copy or a move of the run is replayed from, it is not this one
    request = ReplayRequest(
        run_dir=str(program.run_dir_of(plan.program)),
        into=str(scratch.resolve()),
        stop_after=plan.end,
        level=settings.get("trace.level", "off"),
        trace_steps=settings.get("trace.steps"),
        watch=process_mark(),
        resume_from=None if resume_from is None else str(resume_from.resolve()),
    )
    cmd, run_dir = plan.launch.cmd, plan.run_dir
    try:
        _run(
            cmd,
            f"the replay of steps {plan.start + 1}-{plan.end} of {run_dir} ({' '.join(cmd)})",
            timeout,
            plan.launch.cwd,
            {**plan.env, **request.to_env()},
        )
    except ReplayError:
        if (scratch / REFUSAL).is_file():
            raise ReplayRefused((scratch / REFUSAL).read_text(encoding="utf-8").strip()) from None
        raise
    if not holds_run(scratch):
        raise ReplayError(
            f"the replay of {run_dir} ({' '.join(cmd)}) ended (exit 0) before its samestep.Run of "
            f"{run_dir} started: the program no longer reaches it as it ran"
        )


def _gpus_here() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0

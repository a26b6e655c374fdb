"""``samestep.trace``: start recording this rank's trace stream in a loop of the user's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from samestep.determinism.env import compare_environments, environment
from samestep.determinism.mode import active_report
from samestep.distributed.group import group_up
from samestep.records.lock import RunLock, hold
from samestep.records.rundir import (
    determinism_diff,
    holds_run,
    new_run,
    read_run,
    record_close,
    record_resume,
    write_run,
)
from samestep.tracing.perturb import Perturb
from samestep.tracing.recorder import Recorder
from samestep.tracing.selection import format_selection, parse_selection
from samestep.tracing.stream import stream_segments

__all__ = ["trace"]


def trace(
    run_dir: str | Path,
    *,
    level: str = "op",
    steps: set[int] | str | None = None,
    ranks: set[int] | str | None = None,
    rank: int | None = None,
    perturb: Perturb | None = None,
    copy: bool = False,
    worker: str = "auto",
    resume: bool = False,
    held: RunLock | None = None,
    layout: dict[str, Any] | None = None,
    resumed_from: int | None = None,
) -> Recorder:
    """Starts recording this rank's trace stream into ``run_dir/trace``. Rank 0 also writes
    ``run_dir/run.json`` if there is none, so that ``samestep diff`` and ``samestep trace certify`` read a
    run of your own loop as they read ``samestep train``'s: call ``samestep.enable()`` first, to have
    deterministic mode recorded there.

    Args:
        run_dir: the run directory.
        level: ``"step"``, ``"module"`` or ``"op"`` (each includes the ones before), or ``"off"``.
        steps: the 1-based steps to record (a set, or text like ``"1-5"``); ``None`` records all.
        ranks: the ranks that record; ``None`` is all.
        rank: this process's rank (default: torch.distributed's, else 0).
        perturb: fault injection for validating ``samestep diff`` (see ``Perturb``).
        copy: module level: digest copies of module outputs and gradients instead of the tensors
            themselves (which are checked unchanged until digested; a change in place raises).
        worker: where digests are computed: ``"thread"`` (any device; ``"auto"`` is this) or, opted
            into, ``"process"`` (a child process that reads this process's memory; CPU tensors on Linux
            only). Both write the same stream.
        resume: continue the run that ``run_dir`` holds (after loading its checkpoint): the stream gets a
            new segment, and run.json a resume record with what differs from the run's start.
        held: the run directory's lock (``samestep.records.lock.hold``) where the caller holds it already and
            keeps it past the recorder's close (``samestep.Run``).
        layout: what run.json records of the layout besides the world size (``distributed.placement.
            model_layout``): ``samestep diff`` pairs trace records only between steps written on one layout.
        resumed_from: the step a resume continues after (its checkpoint's), recorded with the resume: the
            steps after it were written on the resume's layout.

    Rank 0 holds the run directory's lock (``.samestep.lock``) until the recorder closes, so a second
    process writing into it is refused (``samestep train``, ``samestep.Run`` and ``samestep.trace`` all
    take it; holds within one process share it).

    Raises:
        ValueError: ``run_dir`` already holds a traced run and ``resume`` is not set.
        RunDirError: another live process is writing the run (a ValueError; it names its pid and host).
    """
    import torch.distributed as dist

    distributed = group_up()
    if rank is None:
        rank = dist.get_rank() if distributed else 0
    if isinstance(steps, str):
        steps = parse_selection(steps, "steps")
    if isinstance(ranks, str):
        ranks = parse_selection(ranks, "ranks")
    run_dir = Path(run_dir)
    # one writer per run (rank 0 holds it until its recorder closes; shared with a samestep.Run or samestep
    # train of this process that holds it): a second job on the same directory is refused here, before it
    # touches anything
    lock = hold(run_dir) if rank == 0 and held is None else None
    try:
        segments = stream_segments(run_dir, rank)
        if segments and not resume:
            raise ValueError(
                f"samestep.trace: {run_dir} already holds a trace ({segments[-1]}); pass resume=True "
                "to continue that run (after loading its checkpoint), or trace into a new run "
                "directory"
            )
        rec = Recorder(
            run_dir, level=level, steps=steps, ranks=ranks, rank=rank, perturb=perturb, copy=copy, worker=worker
        )
        if rank == 0:  # at level "off" too: the run directory is a run the CLI reads (receipts, checkpoints)
            world = dist.get_world_size() if distributed else 1
            if not holds_run(run_dir):
                _describe_run(run_dir, level, steps, ranks, {"world_size": world, **(layout or {})})
            elif resume:
                _record_resume(run_dir, len(segments), {"world_size": world, **(layout or {})}, resumed_from)
            if read_run(run_dir).get("written_by") == "samestep.trace":
                rec.on_close = lambda rec, segment=len(segments): _closed(rec, segment, lock)
            elif lock is not None:
                rec.on_close = lambda rec: lock.release()
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return rec


def _describe_run(
    run_dir: Path, level: str, steps: set[int] | None, ranks: set[int] | None, layout: dict[str, Any]
) -> None:
    """Gives a run directory that a user's own loop traces the ``run.json`` that ``samestep diff`` and
    ``samestep trace certify`` read (docs/formats.md): the trace selection as its config, the environment
    fingerprint, the layout, and the report of the ``samestep.enable()`` in force (null if none)."""
    report = active_report()
    selection = {
        "level": level,
        "steps": "all" if steps is None else format_selection(steps),
        "ranks": "all" if ranks is None else format_selection(ranks),
    }
    write_run(
        run_dir,
        new_run(
            {"trace": selection}, layout, report.to_dict() if report is not None else None, written_by="samestep.trace"
        ),
    )


def _record_resume(run_dir: Path, segment: int, layout: dict[str, Any], step: int | None) -> None:
    """A resume of the user's own loop, in run.json's ``resumes`` (as ``samestep train`` records its own):
    the stream segment it starts, the step it continues after (where known), its layout, and what differs
    from the run's start (environment fields, deterministic mode)."""
    doc = read_run(run_dir)
    if doc.get("written_by") != "samestep.trace":
        return  # samestep train's run.json: its loop records its own resumes
    report = active_report()
    record_resume(
        run_dir,
        {
            "written_by": "samestep.trace",
            "segment": segment,
            **layout,
            **({"step": step} if step is not None else {}),
            "env_diff": sorted(compare_environments(doc.get("environment", {}), environment())),
            "determinism_diff": sorted(
                determinism_diff(doc.get("determinism"), report.to_dict() if report is not None else None)
            ),
        },
    )


def _closed(rec: Recorder, segment: int, lock: RunLock | None) -> None:
    """Rank 0's recorder closed: run.json records it (and a knob of deterministic mode that stopped
    holding), so that certify can tell a finished trace from a killed or failed one; the run is free."""
    try:
        record_close(
            rec.run_dir,
            {"segment": segment, "failed_step": rec.failed_step, "records": rec.records},
            rec.numerics_changed,
        )
    finally:
        if lock is not None:
            lock.release()

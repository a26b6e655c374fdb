"""``samestep.trace``: start recording this rank's trace stream in a loop of the user's own."""

from __future__ import annotations

from pathlib import Path

from samestep.mode import active_report
from samestep.rundir import new_run, write_run
from samestep.tracing.perturb import Perturb
from samestep.tracing.recorder import Recorder
from samestep.tracing.selection import format_selection, parse_selection

__all__ = ["trace"]


def trace(run_dir: str | Path, *, level: str = "op", steps: set[int] | str | None = None,
          ranks: set[int] | str | None = None, rank: int | None = None, perturb: Perturb | None = None,
          copy: bool = False, worker: str = "auto") -> Recorder:
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
        worker: where digests are computed: ``"process"`` (a child process that reads this process's
            memory; CPU tensors only), ``"thread"`` (any device), or ``"auto"`` (process on Linux
            without CUDA, else thread). Both write the same stream.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if distributed else 0
    if isinstance(steps, str):
        steps = parse_selection(steps, "steps")
    if isinstance(ranks, str):
        ranks = parse_selection(ranks, "ranks")
    rec = Recorder(run_dir, level=level, steps=steps, ranks=ranks, rank=rank, perturb=perturb, copy=copy,
                   worker=worker)
    if rank == 0 and level != "off":
        _describe_run(Path(run_dir), level, steps, ranks, dist.get_world_size() if distributed else 1)
    return rec


def _describe_run(run_dir: Path, level: str, steps: set[int] | None, ranks: set[int] | None, world: int) -> None:
    """Gives a run directory that a user's own loop traces the ``run.json`` that ``samestep diff`` and
    ``samestep trace certify`` read (docs/formats.md): the trace selection as its config, the environment
    fingerprint, the world size, and the report of the ``samestep.enable()`` in force (null if none). A
    run.json already there (``samestep train`` writes its own first) is left as it is."""
    if (run_dir / "run.json").exists():
        return
    report = active_report()
    selection = {"level": level, "steps": "all" if steps is None else format_selection(steps),
                 "ranks": "all" if ranks is None else format_selection(ranks)}
    write_run(run_dir, new_run({"trace": selection}, {"world_size": world},
                               report.to_dict() if report is not None else None, written_by="samestep.trace"))

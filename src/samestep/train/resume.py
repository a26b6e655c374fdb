"""Resuming the reference run: the newest intact checkpoint restored under the run's own config (or step 0
of a run killed before its first), and every file the resume will change checked before any is, so a
resume that cannot go on changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from samestep.checkpoint import LoadedCheckpoint, load_checkpoint
from samestep.hashing.state import dotted
from samestep.loop.protocol import RunProtocol
from samestep.records.metrics import truncate_metrics
from samestep.records.rundir import NUMERICS_NEUTRAL, checkpoints_dir, holds_run, metrics_path, read_run, run_writer
from samestep.train.config import Config

__all__ = ["check_resume_config", "check_run_files", "restore_run"]


def check_resume_config(saved: dict[str, Any] | None, current: Config) -> None:
    """Refuses a resume under a config that would change the run's bits (rundir's NUMERICS_NEUTRAL fields
    may change)."""
    now = dotted(current.to_dict())
    then = dotted(saved or {})
    changed = {k for k in set(now) | set(then) if now.get(k) != then.get(k)} - NUMERICS_NEUTRAL
    if changed:
        fields = ", ".join(f"{k}: {then.get(k)!r} -> {now.get(k)!r}" for k in sorted(changed))
        raise ValueError(
            f"--resume with a different config would change the run's bits ({fields}); resume with "
            "the original config, or start a new --run-dir"
        )


def restore_run(
    trainer: Any, run_dir: Path, resume: bool, world: int, say: Callable[[str], None]
) -> tuple[int, LoadedCheckpoint | None]:
    """Restores the newest intact checkpoint into ``trainer`` (the loop's ``Trainer``; with ``resume``): model,
    optimizer, schedule, data cursor and RNG; returns the step to start from and the checkpoint loaded (None
    if none). A run killed before its first checkpoint goes on from step 0 under its own config; a run
    directory that holds a run is refused without ``resume``."""
    ckpt_root = checkpoints_dir(run_dir)
    if holds_run(run_dir):
        writer = run_writer(read_run(run_dir))
        if not writer.startswith("samestep train"):  # its checkpoints and config are not a reference run's
            raise ValueError(
                f"--run-dir {run_dir} holds {writer}, not a samestep train run, which samestep train "
                "neither continues nor overwrites. Fix: choose a new --run-dir"
            )
    if resume and any(ckpt_root.glob("step_*")):
        model, optimizer = trainer.loadable()
        loaded = load_checkpoint(
            ckpt_root,
            model=model,
            optimizer=optimizer,
            scheduler=trainer.schedule,
            data_cursor=trainer.cursor,
            fallback=True,
            # Training randomness is counter-keyed, so another world size needs no per-rank RNG state.
            restore_rng="same_world_size",
            check_config=lambda saved: check_resume_config(saved, trainer.cfg),
        )
        for path, why in loaded.skipped:
            say(f"skipped corrupt checkpoint {path.name}: {why}")
        say(f"resumed from {loaded.path.name} (step {loaded.step}, {loaded.world_size} -> {world} processes)")
        return loaded.step, loaded
    if resume and holds_run(run_dir):  # killed before its first checkpoint: again from step 0
        check_resume_config(read_run(run_dir).get("config"), trainer.cfg)
        say("resumed from step 0 (the run holds no checkpoint)")
        return 0, None
    if not resume and (holds_run(run_dir) or metrics_path(run_dir).exists()):
        raise ValueError(
            f"--run-dir {run_dir} already holds a run; pass --resume to continue it (from its newest "
            "checkpoint, or from step 0 where it holds none), or choose a new --run-dir (nothing was "
            "overwritten)"
        )
    return 0, None


def check_run_files(
    proto: RunProtocol,
    start: int,
    rank: int,
    state: Callable[[], Any] | None,
    checkpoint: LoadedCheckpoint | None = None,
    same_layout: bool = True,
) -> None:
    """What a resume from ``start`` will change, checked before anything is: rank 0's metrics.jsonl, then the
    receipts (``RunProtocol.check_receipts``: where this rank keeps them, ``state`` makes the state tree they
    checksum; the restored state against them, on the layout that wrote ``checkpoint``, ``same_layout``
    (``train.layout``), or another).

    Raises:
        RunDirError, ReceiptError, CheckpointError: names the file and what is wrong.
    """
    if rank == 0:
        truncate_metrics(proto.run_dir, start, check_only=True)
    proto.check_receipts(rank, start, state, checkpoint=checkpoint, same_layout=same_layout)

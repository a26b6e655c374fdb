"""``save_checkpoint``: complete training state, written and committed atomically."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from samestep.checkpoint._format import (
    FORMAT,
    LATEST,
    MANIFEST,
    SUPERSEDED,
    VERSION,
    CheckpointError,
    committed_steps,
    manifest_digest,
    rank_names,
    step_dir_name,
    write_json,
)
from samestep.checkpoint.files import file_entry, skeletons, unique_tensors, write_tensors
from samestep.checkpoint.save_shards import ENTRIES, sharded_version, write_sharded
from samestep.determinism import rng as _rng
from samestep.determinism.env import environment
from samestep.distributed.group import group_up, rank_and_world
from samestep.records.durable import fsync_dir, replace_atomic

__all__ = ["save_checkpoint"]


def _dist() -> tuple[int, int, Any]:
    import torch.distributed as dist

    rank, world = rank_and_world()
    return rank, world, dist.barrier if group_up() else (lambda: None)


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    data_cursor: Any = None,
    config: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    generators: dict[str, torch.Generator] | None = None,
    keep: int | None = None,
    sharded: bool = False,
) -> Path:
    """Saves a checkpoint of everything a bit-exact resume needs, and commits it atomically.

    Every rank of a process group calls it together (model and optimizer are written by rank 0;
    each rank writes its own RNG state). The checkpoint becomes visible under ``ROOT/step_NNNNNN``
    only once complete, then ``ROOT/latest`` is updated. Checkpoints of later steps (from a line of
    training the run left by loading an earlier one) are moved to ``ROOT/superseded/``, so the newest
    committed step, which loaders take, is always the newest save.

    Args:
        root: the checkpoints directory (``RUN/checkpoints``).
        step: the number of optimizer steps completed.
        model: its ``state_dict()`` is saved.
        optimizer: its ``state_dict()``, non-tensor entries (step counts, betas) exactly.
        scheduler: any object with ``state_dict()``/``load_state_dict()`` (an LR scheduler).
        data_cursor: any object with ``state_dict()``/``load_state_dict()`` (where the data stands).
        config: the run's configuration, stored for comparison on load.
        extra: any further JSON-able or tensor state of the user's loop.
        generators: named ``torch.Generator`` s to capture besides the registered ones.
        keep: keep only this many newest checkpoints (``None`` keeps all).
        sharded: the model and optimizer hold DTensors (FSDP2's shards): every rank writes its own shards
            in parallel (``model.rank_R.safetensors``, ``optimizer.rank_R.safetensors``), nothing is
            gathered, and the checkpoint loads into any world size (version 2, docs/formats.md).

    Returns:
        The committed checkpoint directory.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"save_checkpoint(step={step!r}): step must be a non-negative integer")
    rank, world, barrier = _dist()
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".{final.name}.tmp"
    with _guarded(final, tmp, root, committed=False):
        if rank == 0:
            _check_layout(root, final)
            _fresh_dir(root, tmp)
    barrier()
    with _guarded(final, tmp, root, committed=False):
        # Every rank writes its own RNG state: ranks' streams differ and are never deduplicated.
        meta, rng_tensors = _rng.capture_rng(generators)
        t_name, j_name = rank_names(rank)
        write_tensors(tmp / t_name, rng_tensors)
        write_json(tmp / j_name, meta)
        stateful = {"scheduler": scheduler, "data_cursor": data_cursor}
        if sharded:
            files, shards = write_sharded(tmp, step, rank, world, model, optimizer, stateful, extra, config)
        elif rank == 0:
            files = _write_state(tmp, step, model, optimizer, stateful, extra, config)
    barrier()
    if rank == 0:
        with _guarded(final, tmp, root, committed=False):
            for r in range(world):
                for name in rank_names(r):
                    files[name] = file_entry((tmp / name).read_bytes())
                if sharded and r < shards:  # each writer's shard entries, digested by it: no shard is read here
                    entries = tmp / ENTRIES.format(r)
                    files.update(json.loads(entries.read_bytes()))
                    entries.unlink()
            _supersede(root, step)
            old = _commit(
                root,
                tmp,
                final,
                {
                    "format": FORMAT,
                    "version": sharded_version(tmp) if sharded else VERSION,
                    "step": step,
                    "world_size": world,
                    "files": dict(sorted(files.items())),
                },
            )
        with _guarded(final, tmp, root, committed=True):
            replace_atomic(root / LATEST, (final.name + "\n").encode())
            if old is not None:
                shutil.rmtree(old)
            if keep is not None:
                for _, path in committed_steps(root)[max(keep, 1) :]:
                    _prune(root, path)
    barrier()
    return final


@contextlib.contextmanager
def _guarded(final: Path, tmp: Path, root: Path, committed: bool) -> Iterator[None]:
    """A failed write anywhere in a save (a full disk, say) removes what it left and says what holds: the
    previous checkpoints stay, or, after the commit's rename, this one is committed."""
    try:
        yield
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        what = f"writing {e.filename or root} failed ({e.strerror or e})"
        if committed:
            raise CheckpointError(
                f"{final}: saved, but {what} after its commit; {root / LATEST} may still name the "
                "previous checkpoint (loaders take the newest committed one)"
            ) from None
        raise CheckpointError(
            f"{final}: not saved: {what}; its temporary files were removed, and the previous checkpoints stay"
        ) from None


def _check_layout(root: Path, final: Path) -> None:
    """What the save will write over must be what a save wrote: refused before anything is written."""
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"{root}: is a file, where checkpoints go; move it away")
    latest = root / LATEST
    if latest.is_symlink() or (latest.exists() and not latest.is_file()):
        raise CheckpointError(
            f"{latest}: is not a file (samestep writes the newest checkpoint's name there); move it away"
        )
    if (final.exists() or final.is_symlink()) and not (final.is_dir() and not final.is_symlink()):
        raise CheckpointError(f"{final}: is not a checkpoint directory, and this save would replace it; move it away")


def _fresh_dir(root: Path, tmp: Path) -> None:
    """An empty directory to write the checkpoint into, under a name no loader reads; what a crash left
    (a temporary or a half-pruned directory: never named ``step_*``) goes first."""
    root.mkdir(parents=True, exist_ok=True)
    for left in [tmp, *root.glob(".step_*.prune")]:
        if left.exists():
            shutil.rmtree(left)
    tmp.mkdir()


def _prune(root: Path, path: Path) -> None:
    """Removes an old checkpoint so that a crash at any instant leaves it whole or unnamed: renamed out of
    the ``step_*`` names first. A symbolic link is removed as a name only: what it points at is not
    this root's to delete."""
    if path.is_symlink():
        path.unlink()
        fsync_dir(root)
        return
    gone = root / f".{path.name}.prune"
    os.replace(path, gone)
    fsync_dir(root)
    shutil.rmtree(gone)


def _supersede(root: Path, step: int) -> None:
    """Moves checkpoints of later steps than the one being saved to ``ROOT/superseded/``: they belong to a
    line of training this save abandons (the run went back to an earlier checkpoint), and loaders take
    the newest committed step. Nothing is deleted."""
    later = [p for s, p in committed_steps(root) if s > step]
    if not later:
        return
    aside = root / SUPERSEDED
    aside.mkdir(exist_ok=True)
    for path in later:
        target = aside / path.name
        n = 1
        while target.exists() or target.is_symlink():
            target, n = aside / f"{path.name}.{n}", n + 1
        os.replace(path, target)
        warnings.warn(
            f"{path}: a later step than the checkpoint being saved ({step}), from a line of training "
            f"the run left; moved to {target}",
            RuntimeWarning,
            stacklevel=4,
        )
    fsync_dir(root)


def _write_state(
    tmp: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    stateful: dict[str, Any],
    extra: dict[str, Any] | None,
    config: dict[str, Any] | None,
) -> dict[str, Any]:
    """Writes the model, the optimizer and every other state (``stateful``'s objects with a
    ``state_dict()``, ``extra``) into ``tmp``; returns the files' manifest entries."""
    files: dict[str, Any] = {}
    model_tensors, aliases = unique_tensors(model.state_dict())
    files["model.safetensors"] = write_tensors(tmp / "model.safetensors", model_tensors)
    state: dict[str, Any] = {"step": step, "model_aliases": aliases, "config": config, "environment": environment()}
    opt_tensors: dict[str, torch.Tensor] = {}
    state.update(skeletons(optimizer, stateful, extra, opt_tensors))
    files["optimizer.safetensors"] = write_tensors(tmp / "optimizer.safetensors", opt_tensors)
    files["state.json"] = file_entry(write_json(tmp / "state.json", state))
    return files


def _commit(root: Path, tmp: Path, final: Path, manifest: dict[str, Any]) -> Path | None:
    """Writes the manifest, then names the checkpoint: the rename of ``tmp`` to ``final`` is the commit
    point. Returns the checkpoint of the same step it replaced, renamed aside, for the caller to remove once
    ``latest`` follows."""
    manifest["manifest_sha256"] = manifest_digest(manifest)
    write_json(tmp / MANIFEST, manifest)
    fsync_dir(tmp)
    old = None
    if final.exists():  # re-saving a step after a resume from an earlier one
        old = root / f".{final.name}.old"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)  # the commit point
    fsync_dir(root)
    return old

"""``save_checkpoint``: complete training state, written and committed atomically."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from samestep import rng as _rng
from samestep._state import flatten, sha256_tensor
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
    sha256_bytes,
    step_dir_name,
    write_json,
)
from samestep.durable import fsync_dir, replace_atomic, write_durable
from samestep.env import environment

__all__ = ["save_checkpoint"]


def _dist() -> tuple[int, int, Any]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dist.barrier
    return 0, 1, lambda: None


def _unique_tensors(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Stores each tensor once: safetensors refuses shared storage (e.g. tied embeddings)."""
    seen: dict[tuple, str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        t = t.detach()
        ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and ident in seen:
            aliases[name] = seen[ident]
            continue
        seen[ident] = name
        unique[name] = t.to("cpu").contiguous()
    return unique, aliases


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    data = safetensors_bytes(tensors, metadata={"format": FORMAT, "version": str(VERSION)})
    write_durable(path, data)
    return {"size": len(data), "sha256": sha256_bytes(data),
            "tensors": {k: sha256_tensor(v) for k, v in sorted(tensors.items())}}


def _file_entry(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": sha256_bytes(data)}


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

    Returns:
        The committed checkpoint directory.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"save_checkpoint(step={step!r}): step must be a non-negative integer")
    rank, world, barrier = _dist()
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".{final.name}.tmp"
    if rank == 0:
        _fresh_dir(root, tmp)
    barrier()
    try:
        # Every rank writes its own RNG state: ranks' streams differ and are never deduplicated.
        meta, rng_tensors = _rng.capture_rng(generators)
        t_name, j_name = rank_names(rank)
        _write_tensors(tmp / t_name, rng_tensors)
        write_json(tmp / j_name, meta)
        if rank == 0:
            files = _write_state(tmp, step, model, optimizer, {"scheduler": scheduler, "data_cursor": data_cursor},
                                 extra, config)
    except OSError as e:  # a full disk, say: the space goes back, and the previous checkpoint stays latest
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{final}: not saved: writing {e.filename or tmp} failed ({e.strerror or e}); its "
                              f"temporary directory was removed, and {root / LATEST} still names the previous "
                              "checkpoint") from None
    barrier()
    if rank == 0:
        for r in range(world):
            for name in rank_names(r):
                files[name] = _file_entry((tmp / name).read_bytes())
        _supersede(root, step)
        _commit(root, tmp, final, {"format": FORMAT, "version": VERSION, "step": step, "world_size": world,
                                   "files": dict(sorted(files.items()))})
        if keep is not None:
            for _, path in committed_steps(root)[max(keep, 1):]:
                _prune(root, path)
    barrier()
    return final


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
        warnings.warn(f"{path}: a later step than the checkpoint being saved ({step}), from a line of training "
                      f"the run left; moved to {target}", RuntimeWarning, stacklevel=4)
    fsync_dir(root)


def _write_state(tmp: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 stateful: dict[str, Any], extra: dict[str, Any] | None,
                 config: dict[str, Any] | None) -> dict[str, Any]:
    """Writes the model, the optimizer and every other state (``stateful``'s objects with a
    ``state_dict()``, ``extra``) into ``tmp``; returns the files' manifest entries."""
    files: dict[str, Any] = {}
    model_tensors, aliases = _unique_tensors(model.state_dict())
    files["model.safetensors"] = _write_tensors(tmp / "model.safetensors", model_tensors)
    state: dict[str, Any] = {"step": step, "model_aliases": aliases, "config": config, "environment": environment()}
    opt_tensors: dict[str, torch.Tensor] = {}
    if optimizer is not None:
        state["optimizer"] = flatten(optimizer.state_dict(), "optimizer", opt_tensors)
    for name, obj in stateful.items():
        if obj is not None:
            state[name] = flatten(obj.state_dict(), name, opt_tensors)
    if extra is not None:
        state["extra"] = flatten(extra, "extra", opt_tensors)
    files["optimizer.safetensors"] = _write_tensors(tmp / "optimizer.safetensors", opt_tensors)
    files["state.json"] = _file_entry(write_json(tmp / "state.json", state))
    return files


def _commit(root: Path, tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Writes the manifest, then names the checkpoint: the rename of ``tmp`` to ``final`` is the commit
    point; ``latest`` follows."""
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
    replace_atomic(root / LATEST, (final.name + "\n").encode())
    if old is not None:
        shutil.rmtree(old)

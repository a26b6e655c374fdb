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
from safetensors.torch import save as safetensors_bytes

from samestep.checkpoint._format import (
    FORMAT,
    GRID_VERSION,
    LATEST,
    MANIFEST,
    SHARDED_VERSION,
    SPLIT_VERSION,
    SUPERSEDED,
    VERSION,
    CheckpointError,
    committed_steps,
    manifest_digest,
    rank_names,
    sha256_bytes,
    shard_names,
    step_dir_name,
    write_json,
)
from samestep.determinism import rng as _rng
from samestep.determinism.env import environment
from samestep.distributed.fsdp import shard_rows
from samestep.distributed.group import group_up, rank_and_world
from samestep.hashing.state import flatten, sha256_tensor
from samestep.records.durable import fsync_dir, replace_atomic, write_durable

__all__ = ["save_checkpoint"]


def _dist() -> tuple[int, int, Any]:
    import torch.distributed as dist

    rank, world = rank_and_world()
    return rank, world, dist.barrier if group_up() else (lambda: None)


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
        _write_tensors(tmp / t_name, rng_tensors)
        write_json(tmp / j_name, meta)
        stateful = {"scheduler": scheduler, "data_cursor": data_cursor}
        if sharded:
            files, shards = _write_sharded(tmp, step, rank, world, model, optimizer, stateful, extra, config)
        elif rank == 0:
            files = _write_state(tmp, step, model, optimizer, stateful, extra, config)
    barrier()
    if rank == 0:
        with _guarded(final, tmp, root, committed=False):
            for r in range(world):
                for name in rank_names(r):
                    files[name] = _file_entry((tmp / name).read_bytes())
                if sharded and r < shards:  # each writer's shard entries, digested by it: no shard is read here
                    entries = tmp / _ENTRIES.format(r)
                    files.update(json.loads(entries.read_bytes()))
                    entries.unlink()
            _supersede(root, step)
            old = _commit(root, tmp, final, {"format": FORMAT, "version": _version(tmp) if sharded else VERSION,
                                             "step": step, "world_size": world, "files": dict(sorted(files.items()))})
        with _guarded(final, tmp, root, committed=True):
            replace_atomic(root / LATEST, (final.name + "\n").encode())
            if old is not None:
                shutil.rmtree(old)
            if keep is not None:
                for _, path in committed_steps(root)[max(keep, 1):]:
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
            raise CheckpointError(f"{final}: saved, but {what} after its commit; {root / LATEST} may still name the "
                                  "previous checkpoint (loaders take the newest committed one)") from None
        raise CheckpointError(f"{final}: not saved: {what}; its temporary files were removed, and the previous "
                              "checkpoints stay") from None


def _check_layout(root: Path, final: Path) -> None:
    """What the save will write over must be what a save wrote: refused before anything is written."""
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"{root}: is a file, where checkpoints go; move it away")
    latest = root / LATEST
    if latest.is_symlink() or (latest.exists() and not latest.is_file()):
        raise CheckpointError(f"{latest}: is not a file (samestep writes the newest checkpoint's name there); move it "
                              "away")
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
        warnings.warn(f"{path}: a later step than the checkpoint being saved ({step}), from a line of training "
                      f"the run left; moved to {target}", RuntimeWarning, stacklevel=4)
    fsync_dir(root)


def _skeletons(optimizer: torch.optim.Optimizer | None, stateful: dict[str, Any], extra: dict[str, Any] | None,
               tensors: dict[str, Any]) -> dict[str, Any]:
    """The JSON skeletons of the optimizer, ``stateful``'s objects and ``extra``, their tensors put in
    ``tensors`` by name."""
    out: dict[str, Any] = {}
    if optimizer is not None:
        out["optimizer"] = flatten(optimizer.state_dict(), "optimizer", tensors)
    for name, obj in stateful.items():
        if obj is not None:
            out[name] = flatten(obj.state_dict(), name, tensors)
    if extra is not None:
        out["extra"] = flatten(extra, "extra", tensors)
    return out


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
    state.update(_skeletons(optimizer, stateful, extra, opt_tensors))
    files["optimizer.safetensors"] = _write_tensors(tmp / "optimizer.safetensors", opt_tensors)
    files["state.json"] = _file_entry(write_json(tmp / "state.json", state))
    return files


_ENTRIES = ".entries.rank_{:05d}.json"  # a rank's shard files' manifest entries, until the commit


def _grid_layout(name: str, t: Any) -> dict[str, Any]:
    """The layout entry of a DTensor of FSDP2 over tensor parallelism (version 4): a 2-D one (data ranks x
    tensor ranks), or one on the data ranks alone (a norm's, whole on every tensor rank). "rows" and "dim"
    or "parts" split it over the tensor ranks as version 3 does (absent: each holds it whole); "data" cuts
    each tensor rank's part into rows of dim 0 over the data ranks, as FSDP2 does (``torch.chunk``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = t.device_mesh
    outer, inner = (t.placements[0], Replicate()) if mesh.ndim == 1 else t.placements
    data, tensor = mesh.size(0), 1 if mesh.ndim == 1 else mesh.size(1)
    if type(outer) not in (Shard, _StridedShard) or outer.dim % t.dim() or type(inner) not in (
            Shard, _StridedShard, Replicate):
        raise CheckpointError(f"sharded checkpoint: {name!r} is placed {t.placements} on the mesh "
                              f"{mesh.mesh_dim_names}; FSDP2 over tensor parallelism is stored as FSDP2's rows of dim "
                              "0 of a Shard or Replicate tensor-parallel part. Save its full_tensor() instead")
    entry: dict[str, Any] = {"shape": list(t.shape)}
    part = list(t.shape)
    if not isinstance(inner, Replicate):
        dim, parts = inner.dim % t.dim(), getattr(inner, "split_factor", 1)
        if t.shape[dim] % (parts * tensor):
            raise CheckpointError(f"sharded checkpoint: {name!r} (shape {list(t.shape)}) is not split evenly by "
                                  f"{inner} over {tensor} tensor ranks; save its full_tensor() instead")
        entry |= {"rows": shard_rows(t.shape[dim] // parts, tensor), **({"dim": dim} if dim else {}),
                  **({"parts": parts} if parts > 1 else {})}
        part[dim] //= tensor
    entry["data"] = shard_rows(part[0], data)
    a, b = entry["data"][mesh.get_local_rank(0)]
    if t.to_local().shape[0] != b - a:
        raise CheckpointError(f"sharded checkpoint: {name!r} holds {t.to_local().shape[0]} rows on data rank "
                              f"{mesh.get_local_rank(0)}, not the {b - a} of FSDP2's split")
    return entry


def _split(tensors: dict[str, Any], world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                                         dict[str, Any], dict[str, str]]:
    """Plain tensors, this rank's local shards of the DTensors, the DTensors' layout (global shape and each
    rank's rows), and the names that are another name's DTensor (a tied weight): one shard each."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    plain: dict[str, torch.Tensor] = {}
    local: dict[str, torch.Tensor] = {}
    layout: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    grid = _grid(tensors)
    for name, t in tensors.items():
        if not isinstance(t, DTensor):
            plain[name] = t
            continue
        if id(t) in first:
            aliases[name] = first[id(t)]
            continue
        first[id(t)] = name
        if all(p == Replicate() for p in t.placements):  # every rank holds it whole: stored once, as a plain tensor
            plain[name] = t.to_local().detach()
            continue
        if grid is not None and t.device_mesh.mesh_dim_names in (grid, grid[:1]):  # FSDP2 over TP: every rank's own
            layout[name] = _grid_layout(name, t)
            local[name] = t.to_local().detach()
            continue
        placed = t.placements[0]
        parts = getattr(placed, "split_factor", 1)  # _StridedShard: fused parts, each split alike
        if (len(t.placements) != 1 or type(placed) not in (Shard, _StridedShard) or t.device_mesh.size() != world
                or t.shape[placed.dim % t.dim()] % parts):
            raise CheckpointError(f"sharded checkpoint: {name!r} is placed {t.placements} on a mesh of "
                                  f"{t.device_mesh.size()} ranks, but only one Shard (FSDP2's Shard(0), tensor "
                                  f"parallelism's) or Replicate over the {world} ranks that shard the others is "
                                  "stored; save its full_tensor() instead")
        dim = placed.dim % t.dim()
        rows = shard_rows(t.shape[dim] // parts, world)
        shard = t.to_local().detach()
        r = t.device_mesh.get_local_rank()
        if shard.shape[dim] != parts * (rows[r][1] - rows[r][0]):
            raise CheckpointError(f"sharded checkpoint: {name!r} holds {shard.shape[dim]} rows on rank {r}, not "
                                  f"the {parts * (rows[r][1] - rows[r][0])} of an even {placed} split")
        local[name] = shard
        layout[name] = {"shape": list(t.shape), "rows": rows, **({"dim": dim} if dim else {}),
                        **({"parts": parts} if parts > 1 else {})}
    return plain, local, layout, aliases


def _grid(tensors: dict[str, Any]) -> tuple[str, ...] | None:
    """The dimension names of the 2-D mesh (data ranks, tensor ranks) that FSDP2 over tensor parallelism
    places some of ``tensors`` on, or None."""
    from torch.distributed.tensor import DTensor

    return next((t.device_mesh.mesh_dim_names for t in tensors.values()
                 if isinstance(t, DTensor) and t.device_mesh.ndim == 2), None)


def _version(tmp: Path) -> int:
    """A sharded checkpoint's version: 4 if a tensor is cut over data ranks within tensor ranks (FSDP2 over
    tensor parallelism), 3 if one is split along a dimension other than 0 or in fused parts, else 2."""
    shards = json.loads((tmp / "state.json").read_bytes())["shards"]
    infos = [info for part in ("model", "optimizer") for info in shards[part].values()]
    if any("data" in info for info in infos):
        return GRID_VERSION
    return SPLIT_VERSION if any("dim" in info or "parts" in info for info in infos) else SHARDED_VERSION


def _shard_mesh(tensors: dict[str, Any], rank: int, world: int) -> tuple[int, int, bool]:
    """(how many ranks the DTensors are split over, this rank's index among them, whether it writes them).
    A mesh over every rank: each writes its own. A mesh of a subset (the tensor ranks of one data rank, a
    tensor-parallel mesh inside data parallelism): the replicas of the subset that holds rank 0 write, the
    others hold the same shards."""
    from torch.distributed.tensor import DTensor, Replicate

    if _grid(tensors) is not None:  # FSDP2 over tensor parallelism: every rank holds shards of its own
        return world, rank, True
    for t in tensors.values():
        if isinstance(t, DTensor) and not all(p == Replicate() for p in t.placements):
            mesh = t.device_mesh
            if mesh.size() == world:
                return world, rank, True
            return mesh.size(), mesh.get_local_rank(), 0 in mesh.mesh.flatten().tolist()
    return world, rank, True


def _write_sharded(tmp: Path, step: int, rank: int, world: int, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer | None, stateful: dict[str, Any], extra: dict[str, Any] | None,
                   config: dict[str, Any] | None) -> tuple[dict[str, Any], int]:
    """Every rank that writes shards (``_shard_mesh``) writes its shards of the model and optimizer state and
    their manifest entries; rank 0 also the plain tensors and state.json (with the shards' layout). Returns
    rank 0's entries and the number of shard files of each kind."""
    own = model.state_dict(keep_vars=True)
    shards, index, writes = _shard_mesh(own, rank, world)
    model_plain, model_local, model_layout, tied = _split(own, shards)
    opt_tensors: dict[str, Any] = {}
    state: dict[str, Any] = {"step": step, "config": config, "environment": environment(),
                             **_skeletons(optimizer, stateful, extra, opt_tensors)}
    opt_plain, opt_local, opt_layout, _ = _split(opt_tensors, shards)
    if writes:
        m_name, o_name = shard_names(index)
        mine = {m_name: _write_tensors(tmp / m_name, model_local), o_name: _write_tensors(tmp / o_name, opt_local)}
        write_json(tmp / _ENTRIES.format(index), mine)
    if rank != 0:
        return {}, shards
    files: dict[str, Any] = {}
    unique, aliases = _unique_tensors(model_plain)
    files["model.safetensors"] = _write_tensors(tmp / "model.safetensors", unique)
    files["optimizer.safetensors"] = _write_tensors(tmp / "optimizer.safetensors", opt_plain)
    state["model_aliases"] = {**aliases, **tied}
    state["shards"] = {"world_size": shards, "model": model_layout, "optimizer": opt_layout}
    files["state.json"] = _file_entry(write_json(tmp / "state.json", state))
    return files, shards


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

"""Each rank's shards of a sharded model's checkpoint: which ranks write (a grid of FSDP2 over tensor parallelism, or
the data ranks), what each writes (its shards of the model and optimizer state, with the layout that places them
back), and the entries each hands the commit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from samestep.checkpoint._format import (
    GRID_VERSION,
    SHARDED_VERSION,
    SPLIT_VERSION,
    CheckpointError,
    shard_names,
    write_json,
)
from samestep.checkpoint.files import file_entry, skeletons, unique_tensors, write_tensors
from samestep.determinism.env import environment
from samestep.distributed.fsdp import shard_rows

__all__ = ["ENTRIES", "sharded_version", "write_sharded"]


ENTRIES = ".entries.rank_{:05d}.json"  # a rank's shard files' manifest entries, until the commit


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
    if (
        type(outer) not in (Shard, _StridedShard)
        or outer.dim % t.dim()
        or type(inner) not in (Shard, _StridedShard, Replicate)
    ):
        raise CheckpointError(
            f"sharded checkpoint: {name!r} is placed {t.placements} on the mesh "
            f"{mesh.mesh_dim_names}; FSDP2 over tensor parallelism is stored as FSDP2's rows of dim "
            "0 of a Shard or Replicate tensor-parallel part. Save its full_tensor() instead"
        )
    entry: dict[str, Any] = {"shape": list(t.shape)}
    part = list(t.shape)
    if not isinstance(inner, Replicate):
        dim, parts = inner.dim % t.dim(), getattr(inner, "split_factor", 1)
        if t.shape[dim] % (parts * tensor):
            raise CheckpointError(
                f"sharded checkpoint: {name!r} (shape {list(t.shape)}) is not split evenly by "
                f"{inner} over {tensor} tensor ranks; save its full_tensor() instead"
            )
        entry |= {
            "rows": shard_rows(t.shape[dim] // parts, tensor),
            **({"dim": dim} if dim else {}),
            **({"parts": parts} if parts > 1 else {}),
        }
        part[dim] //= tensor
    entry["data"] = shard_rows(part[0], data)
    a, b = entry["data"][mesh.get_local_rank(0)]
    if t.to_local().shape[0] != b - a:
        raise CheckpointError(
            f"sharded checkpoint: {name!r} holds {t.to_local().shape[0]} rows on data rank "
            f"{mesh.get_local_rank(0)}, not the {b - a} of FSDP2's split"
        )
    return entry


def _split(
    tensors: dict[str, Any], world: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any], dict[str, str]]:
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
        if (
            len(t.placements) != 1
            or type(placed) not in (Shard, _StridedShard)
            or t.device_mesh.size() != world
            or t.shape[placed.dim % t.dim()] % parts
        ):
            raise CheckpointError(
                f"sharded checkpoint: {name!r} is placed {t.placements} on a mesh of "
                f"{t.device_mesh.size()} ranks, but only one Shard (FSDP2's Shard(0), tensor "
                f"parallelism's) or Replicate over the {world} ranks that shard the others is "
                "stored; save its full_tensor() instead"
            )
        dim = placed.dim % t.dim()
        rows = shard_rows(t.shape[dim] // parts, world)
        shard = t.to_local().detach()
        r = t.device_mesh.get_local_rank()
        if shard.shape[dim] != parts * (rows[r][1] - rows[r][0]):
            raise CheckpointError(
                f"sharded checkpoint: {name!r} holds {shard.shape[dim]} rows on rank {r}, not "
                f"the {parts * (rows[r][1] - rows[r][0])} of an even {placed} split"
            )
        local[name] = shard
        layout[name] = {
            "shape": list(t.shape),
            "rows": rows,
            **({"dim": dim} if dim else {}),
            **({"parts": parts} if parts > 1 else {}),
        }
    return plain, local, layout, aliases


def _grid(tensors: dict[str, Any]) -> tuple[str, ...] | None:
    """The dimension names of the 2-D mesh (data ranks, tensor ranks) that FSDP2 over tensor parallelism
    places some of ``tensors`` on, or None."""
    from torch.distributed.tensor import DTensor

    return next(
        (t.device_mesh.mesh_dim_names for t in tensors.values() if isinstance(t, DTensor) and t.device_mesh.ndim == 2),
        None,
    )


def sharded_version(tmp: Path) -> int:
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


def write_sharded(
    tmp: Path,
    step: int,
    rank: int,
    world: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    stateful: dict[str, Any],
    extra: dict[str, Any] | None,
    config: dict[str, Any] | None,
) -> tuple[dict[str, Any], int]:
    """Every rank that writes shards (``_shard_mesh``) writes its shards of the model and optimizer state and
    their manifest entries; rank 0 also the plain tensors and state.json (with the shards' layout). Returns
    rank 0's entries and the number of shard files of each kind."""
    own = model.state_dict(keep_vars=True)
    shards, index, writes = _shard_mesh(own, rank, world)
    model_plain, model_local, model_layout, tied = _split(own, shards)
    opt_tensors: dict[str, Any] = {}
    state: dict[str, Any] = {
        "step": step,
        "config": config,
        "environment": environment(),
        **skeletons(optimizer, stateful, extra, opt_tensors),
    }
    opt_plain, opt_local, opt_layout, _ = _split(opt_tensors, shards)
    if writes:
        m_name, o_name = shard_names(index)
        mine = {m_name: write_tensors(tmp / m_name, model_local), o_name: write_tensors(tmp / o_name, opt_local)}
        write_json(tmp / ENTRIES.format(index), mine)
    if rank != 0:
        return {}, shards
    files: dict[str, Any] = {}
    unique, aliases = unique_tensors(model_plain)
    files["model.safetensors"] = write_tensors(tmp / "model.safetensors", unique)
    files["optimizer.safetensors"] = write_tensors(tmp / "optimizer.safetensors", opt_plain)
    state["model_aliases"] = {**aliases, **tied}
    state["shards"] = {"world_size": shards, "model": model_layout, "optimizer": opt_layout}
    files["state.json"] = file_entry(write_json(tmp / "state.json", state))
    return files, shards

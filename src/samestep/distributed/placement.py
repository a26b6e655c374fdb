"""The layout of a model as a loop of one's own built it, read from the model itself: whether FSDP2 shards it,
the device meshes its DTensor parameters live on (dimension names, sizes, the ranks at each coordinate) and
every parameter's placements. What ``samestep.Run`` and the framework callbacks record in run.json's
``layout`` (and each resume's), so that ``samestep diff`` pairs trace records only between runs whose ranks
hold the same pieces of the same tensors, and names a rank by its place on the mesh (docs/formats.md)."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import torch

__all__ = ["mesh_coordinates", "model_layout"]


def _mesh(mesh: Any) -> dict[str, Any]:
    names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else [f"dim{i}" for i in range(mesh.ndim)]
    return {"names": names, "shape": list(mesh.mesh.shape), "ranks": mesh.mesh.tolist()}


def model_layout(model: torch.nn.Module) -> dict[str, Any]:
    """``{"sharded": "fsdp2" or None, "ddp": wrapped in DDP, "meshes": [...], "placements": digest or None, "placed": {placements:
    count}}`` of ``model``: ``meshes`` the distinct meshes its DTensor parameters live on (largest first), each
    ``{"names", "shape", "ranks"}``; ``placements`` a digest of every parameter's name, mesh and placements (two
    runs whose ranks hold the same pieces have the same one); ``placed`` how many parameters have each
    placement (``"Replicate"`` for a plain tensor). Empty meshes and a None digest where no parameter is a
    DTensor (a plain, or DDP-wrapped, model)."""
    import torch.distributed as dist

    sharded, ddp = None, isinstance(model, torch.nn.parallel.DistributedDataParallel)
    meshes: list[dict[str, Any]] = []
    rows: list[list[Any]] = []
    placed: dict[str, int] = {}
    if dist.is_available() and dist.is_initialized():
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        sharded = "fsdp2" if any(isinstance(m, FSDPModule) for m in model.modules()) else None
        for name, p in model.named_parameters():
            if not isinstance(p, DTensor):
                placed["Replicate"] = placed.get("Replicate", 0) + 1
                continue
            mesh = _mesh(p.device_mesh)
            if mesh not in meshes:
                meshes.append(mesh)
            where = ", ".join(str(pl) for pl in p.placements)
            placed[where] = placed.get(where, 0) + 1
            rows.append([name, meshes.index(mesh), where])
    if not rows:
        return {"sharded": sharded, "ddp": ddp, "meshes": [], "placements": None, "placed": {}}
    order = sorted(range(len(meshes)), key=lambda i: -math.prod(meshes[i]["shape"]))
    rows = [[name, order.index(i), where] for name, i, where in rows]
    digest = hashlib.sha256(json.dumps([[meshes[i] for i in order], rows]).encode()).hexdigest()[:32]
    return {"sharded": sharded, "ddp": ddp, "meshes": [meshes[i] for i in order], "placements": digest,
            "placed": dict(sorted(placed.items()))}


def mesh_coordinates(mesh: dict[str, Any], rank: int) -> str | None:
    """Where ``rank`` sits on a recorded mesh (``model_layout``'s), as ``"tp 1"`` or ``"dp 0, tp 1"`` by its
    dimension names; None where the mesh does not hold it."""
    def find(ranks: Any, at: list[int]) -> list[int] | None:
        if not isinstance(ranks, list):
            return at if ranks == rank else None
        for i, sub in enumerate(ranks):
            hit = find(sub, at + [i])
            if hit is not None:
                return hit
        return None

    where = find(mesh.get("ranks"), [])
    if where is None:
        return None
    return ", ".join(f"{name} {i}" for name, i in zip(mesh["names"], where))

"""The layout of a model as a loop of one's own built it, read from the model itself: whether FSDP2 shards it,
the device meshes its DTensor parameters live on (dimension names, sizes, the ranks at each coordinate) and
every parameter's placements. What ``samestep.Run`` and the framework callbacks record in run.json's
``layout`` (and each resume's), so that ``samestep diff`` pairs trace records only between runs whose ranks
hold the same pieces of the same tensors, and names a rank by its place on the mesh (docs/formats.md). And a
split that the model's attention cannot compute: a rank holding part of a head (``refuse_split_heads``)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch

from samestep.distributed.group import group_up
from samestep.exit_codes import Refusal
from samestep.hashing.state import state_digest

__all__ = ["is_sharded", "mesh_coordinates", "model_layout", "refuse_split_heads"]


def _mesh(mesh: Any) -> dict[str, Any]:
    names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else [f"dim{i}" for i in range(mesh.ndim)]
    return {"names": names, "shape": list(mesh.mesh.shape), "ranks": mesh.mesh.tolist()}


def model_layout(model: torch.nn.Module) -> dict[str, Any]:
    """``{"sharded": "fsdp2" or None, "ddp": wrapped in DDP, "meshes", "placements", "placed"}`` of ``model``:
    ``meshes`` the distinct meshes its DTensor parameters live on (largest first), each ``{"names", "shape",
    "ranks"}``; ``placements`` a digest of every parameter's name, mesh and placements (two runs whose ranks
    hold the same pieces have the same one); ``placed`` how many parameters have each placement
    (``"Replicate"`` for a plain tensor). No meshes and a None digest where no parameter is a DTensor (a plain,
    or DDP-wrapped, model)."""

    sharded, ddp = None, isinstance(model, torch.nn.parallel.DistributedDataParallel)
    rows: list[list[Any]] = []  # [name, mesh, placements] of each DTensor parameter
    placed: Counter[str] = Counter()
    if group_up():
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        sharded = "fsdp2" if any(isinstance(m, FSDPModule) for m in model.modules()) else None
        for name, p in model.named_parameters():
            where = ", ".join(str(pl) for pl in p.placements) if isinstance(p, DTensor) else "Replicate"
            placed[where] += 1
            if isinstance(p, DTensor):
                rows.append([name, _mesh(p.device_mesh), where])
    if not rows:
        return {"sharded": sharded, "ddp": ddp, "meshes": [], "placements": None, "placed": {}}
    meshes = sorted({repr(m): m for _, m, _ in rows}.values(), key=lambda m: -math.prod(m["shape"]))
    return {
        "sharded": sharded,
        "ddp": ddp,
        "meshes": meshes,
        "placements": state_digest(rows)[:32],
        "placed": dict(sorted(placed.items())),
    }


def mesh_coordinates(mesh: dict[str, Any], rank: int) -> str | None:
    """Where ``rank`` sits on a recorded mesh (``model_layout``'s), as ``"tp 1"`` or ``"dp 0, tp 1"`` by its
    dimension names; None where the mesh does not hold it."""
    hit = (torch.tensor(mesh["ranks"]) == rank).nonzero()
    if not len(hit):
        return None
    return ", ".join(f"{name} {i}" for name, i in zip(mesh["names"], hit[0].tolist()))


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 shards the model: its parameters are DTensors."""
    if not group_up():
        return False  # DTensors need a process group
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def refuse_split_heads(model: torch.nn.Module) -> None:
    """Refuses a tensor-parallel split that gives a rank part of an attention head: a module with an integer
    ``head_dim`` (transformers' attention) whose projection the canonical styles split (their
    ``samestep_tp_split``) over a degree that does not divide that projection's heads (2 kv heads at TP 4),
    which the attention cannot reshape by whole heads.

    Raises:
        Refusal: names the projection, its heads, the degree and the fix.
    """
    for name, module in model.named_modules():
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
            continue
        for child, layer in module.named_children():
            split = getattr(layer, "samestep_tp_split", None)
            if split is None:
                continue
            degree, dim, parts = split
            width = layer.weight.shape[dim] // parts
            if width % head_dim == 0 and (width // head_dim) % degree:
                heads = width // head_dim
                raise Refusal(
                    f"{name}.{child}: {heads} heads of {head_dim} split over tensor-parallel degree {degree}: a "
                    f"rank would hold part of a head, which the attention cannot reshape. Fix: a tensor-parallel "
                    f"degree that divides {heads}, or a model with a multiple of {degree} heads there"
                )

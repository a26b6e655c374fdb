"""The gradient norm of a step, the same bits on any number of processes, sharded or not.

A norm sums every element's square, and the bits of that sum depend on its bracketing. The usual
total norm (a norm per tensor, then the norm of those) brackets by tensor, which a sharded tensor (FSDP2
holds a slice of dim 0 of each on each rank) cannot reproduce. Here the bracketing follows rows: each
dim-0 row of each gradient is summed alone (a row never straddles two shards), and the row sums, in
parameter and row order, are summed as one vector: the same vector, the same sum, whatever the sharding.
A DTensor sharded along another dimension (a tensor-parallel ``Shard(1)``) is bracketed by slices along
that dimension, so its placement, the same at every degree (a mesh of one process included), picks the
bracketing; a replicated one is summed from this rank's copy alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from samestep.distributed.shards import local_shard, placed, spec_of

__all__ = ["canonical_grad_norm", "clip_grad_norm_", "gather_rows", "row_squares"]


def row_squares(g: torch.Tensor) -> torch.Tensor:
    """The sum of squares of each dim-0 row of ``g`` (a scalar is one row), in ``g``'s dtype."""
    rows = g.reshape(1, 1) if g.dim() == 0 else g.reshape(g.shape[0], math.prod(g.shape[1:]))
    return (rows * rows).sum(dim=1)


def gather_rows(local: list[torch.Tensor], group: object = None) -> list[torch.Tensor]:
    """Each parameter's row sums over all ranks of ``group`` (its shards' rows, in rank order): every rank
    the same."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:  # the rows are this rank's alone: no collective to wait on
        return list(local)
    device = local[0].device
    counts = torch.tensor([t.numel() for t in local], dtype=torch.int64, device=device)
    all_counts = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(all_counts, counts, group=group)
    flat = torch.cat(local)
    longest = max(int(c.sum()) for c in all_counts)
    padded = torch.zeros(longest, dtype=flat.dtype, device=device)
    padded[: flat.numel()] = flat
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    per_rank = [list(g[: int(c.sum())].split(c.tolist())) for g, c in zip(gathered, all_counts)]
    return [torch.cat([per_rank[r][i] for r in range(world)]) for i in range(len(local))]


def _sharded_along(g: object) -> tuple[int | None, int, object]:
    """(the dimension a DTensor is sharded along or None if replicated, its fused parts, its mesh); refuses
    what the bracketing cannot follow."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = tuple(g.placements)  # type: ignore[attr-defined]
    if len(placements) != 1 or type(placements[0]) not in (Shard, _StridedShard, Replicate):
        raise ValueError(
            f"canonical_grad_norm: a gradient placed {placements} on a {len(placements)}-D mesh; "
            "it brackets one Shard or Replicate placement. Fix: pass full_tensor() of that gradient"
        )
    p = placements[0]
    if isinstance(p, Replicate):
        return None, 1, g.device_mesh  # type: ignore[attr-defined]
    return p.dim % g.dim(), getattr(p, "split_factor", 1), g.device_mesh  # type: ignore[attr-defined]


def _part_by_part(rows: torch.Tensor, world: int, fused: int) -> torch.Tensor:
    """Row sums gathered in rank order (each rank's rows of every fused part) in the whole tensor's order."""
    return rows if fused == 1 else rows.view(world, fused, -1).transpose(0, 1).reshape(-1)


def _rows_over_data(g: object) -> tuple[torch.Tensor, object, int, object] | None:
    """Of a gradient of FSDP2 over tensor parallelism split by rows on both (a column-parallel weight, whose
    dim-0 rows each lie whole on one rank): this rank's row sums, the data ranks' group, the fused parts and the
    tensor ranks' mesh. None for any other tensor."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = getattr(g, "device_mesh", None)
    if mesh is None or mesh.ndim != 2 or mesh.mesh_dim_names is None:
        return None
    outer, inner = g.placements  # type: ignore[attr-defined]
    if not all(type(p) in (Shard, _StridedShard) and p.dim % g.dim() == 0 for p in (outer, inner)):  # type: ignore
        return None
    return (
        row_squares(g.to_local()),
        mesh.get_group(0),
        getattr(inner, "split_factor", 1),  # type: ignore
        mesh[mesh.mesh_dim_names[1]],
    )


def canonical_grad_norm(
    grads: Iterable[torch.Tensor], over: object = None, lead: Iterable[torch.Tensor] = ()
) -> torch.Tensor:
    """The 2-norm of all ``grads`` together, bracketed by rows (see the module docstring). DTensor
    gradients (sharded) are gathered as row sums only, a few bytes per row: a collective over each of their
    meshes then, which every rank of it calls with its shards of the same parameters. A gradient of FSDP2
    over tensor parallelism (a 2-D mesh) is bracketed as the tensor ranks alone would hold it: split by rows
    on both, its row sums are gathered over the data ranks (FSDP2's rows of a tensor rank's part, in order);
    any other is gathered whole across its data ranks first (``tensor_ranks_part``: its bytes, one gradient
    at a time), since its slices straddle them.

    ``over``: a process group whose ranks hold the other parameters (pipeline stages, each the next run of
    the model's parameters, in rank order): the row sums of all of them, gathered in rank order, are the
    vector one process sums (each stage's bracketed as above first). ``lead``: gradients of this rank whose
    rows come before every rank's ``grads`` (a weight the last stage holds that the model uses first: the
    GPT's tied embedding)."""
    from samestep.distributed.fsdp import tensor_ranks_part

    lead = list(lead)
    grads = lead + list(grads)
    split = {i: r for i, r in enumerate(map(_rows_over_data, grads)) if r is not None}
    if split:  # one gather over the data ranks, in parameter order on every rank
        whole = iter(gather_rows([local for local, _, _, _ in split.values()], next(iter(split.values()))[1]))
        split = {i: (next(whole), group, fused, mesh) for i, (_, group, fused, mesh) in split.items()}
    grads = [g if i in split else tensor_ranks_part(g) for i, g in enumerate(grads)]
    if not any(type(g).__name__ == "DTensor" for g in grads):
        rows = [row_squares(g) for g in grads]
        if over is not None:
            rows = _over(rows, len(lead), over)
        return torch.cat(rows).sum().sqrt() if rows else torch.zeros(())
    parts: list[tuple[int, object, torch.Tensor]] = []  # (fused parts, the mesh gathered over or None, row sums)
    for i, g in enumerate(grads):
        if i in split:  # the tensor rank's row sums, gathered over the tensor ranks below
            rows, _, fused, mesh = split[i]
            parts.append((fused, mesh, rows))
            continue
        if type(g).__name__ != "DTensor":
            parts.append((1, None, row_squares(g)))
            continue
        dim, fused, mesh = _sharded_along(g)
        local = g.to_local()  # type: ignore[attr-defined]
        # a slice contiguous: a strided reduction's order follows the shard's width
        slices = local if not dim else local.movedim(dim, 0).contiguous()
        parts.append((fused, None if dim is None else mesh, row_squares(slices)))
    # FSDP2's data ranks (a norm's weight) and the tensor ranks: one gather each, in the same order on every rank
    for mesh in dict.fromkeys(m for _, m, _ in parts if m is not None):
        gathered = iter(gather_rows([r for _, m, r in parts if m == mesh], mesh.get_group()))  # type: ignore
        # rank order holds each rank's rows of every fused part; the whole tensor's order is part by part
        parts = [
            (fused, m, r if m != mesh else _part_by_part(next(gathered), mesh.size(), fused))  # type: ignore
            for fused, m, r in parts
        ]
    rows = [r for _, _, r in parts]
    if over is not None:
        rows = _over(rows, len(lead), over)
    return torch.cat(rows).sum().sqrt()


def _over(rows: list[torch.Tensor], lead: int, group: object) -> list[torch.Tensor]:
    """Every rank's row sums of ``group`` in the whole model's order: the ``lead`` first rows of each rank first,
    then the rest, each in rank order (one gather)."""

    def cat(part: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(part) if part else torch.zeros(0, dtype=rows[0].dtype if rows else torch.float32)

    return gather_rows([cat(rows[:lead]), cat(rows[lead:])], group)


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    *,
    out_of_place: bool = False,
    over: object = None,
    norm: torch.Tensor | None = None,
    lead: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` by the canonical norm: the same scale (``max_norm / (norm + 1e-6)``,
    at most 1) on the same bits of the norm on any number of processes, sharded (DTensor gradients: every
    rank calls it with its shards of the same parameters) or not. Returns the norm before clipping.

    ``out_of_place``: each ``p.grad`` becomes a new tensor, leaving the old one as it was (a recorder that
    kept the reduced gradients sees them unclipped); otherwise the gradients are scaled in place. ``over``:
    the pipeline stages' group and ``lead``: parameters whose rows lead (``canonical_grad_norm``), clipped too;
    ``norm``: the norm, made already (of parameters that other ranks hold some of: expert parallelism's).
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    lead = [p for p in lead if p.grad is not None]
    total_norm = (
        norm
        if norm is not None
        else canonical_grad_norm([p.grad for p in params if p.grad is not None], over, [p.grad for p in lead])
    )
    params = lead + params
    coef = float(torch.clamp(max_norm / (total_norm + 1e-6), max=1.0))  # an fp32 value: the same products
    for p in params:
        if p.grad is not None:
            p.grad = _scaled(p.grad, coef, out_of_place)
    return total_norm


def _scaled(grad: torch.Tensor, coef: float, out_of_place: bool) -> torch.Tensor:
    """``grad * coef`` (``out_of_place``) or ``grad.mul_(coef)``. A DTensor's shard is scaled as it lies: an
    elementwise product by one scalar is the same on every placement, without DTensor's dispatch a gradient."""
    spec = spec_of(grad)
    if spec is None:
        return grad * coef if out_of_place else grad.mul_(coef)
    if not out_of_place:
        local_shard(grad).mul_(coef)
        return grad
    return placed(local_shard(grad) * coef, spec)

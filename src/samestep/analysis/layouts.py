"""Which steps of two runs pair up record by record: those both wrote on one layout. A rank of a sharded run
records its own rows of each tensor, and a run on more processes records its collectives, so records of
other layouts have no partner; ``diff`` compares such steps by what both layouts hold (loss and grad-norm
bits, the final state)."""

from __future__ import annotations

from typing import Any

from samestep.distributed.placement import mesh_coordinates
from samestep.records.rundir import layout_at
from samestep.tracing.selection import format_selection

__all__ = ["rank_coordinates", "steps_on_other_layouts"]


def _mesh_words(layout: dict[str, Any]) -> str:
    """A loop of one's own's layout, by the meshes its parameters live on (``placement.model_layout``)."""
    n = layout["world_size"]
    meshes = "; ".join(
        " x ".join(f"{name}={size}" for name, size in zip(m["names"], m["shape"])) for m in layout["meshes"]
    )
    fsdp = ", FSDP2 sharding them" if layout.get("sharded") else ""
    return (
        f"{n} process{'es' if n > 1 else ''} with parameters placed on the device mesh {meshes}{fsdp} (rank r "
        "records its own pieces of them)"
    )


def _layout_words(layout: dict[str, Any]) -> str:
    n = layout["world_size"]
    if layout.get("meshes"):
        return _mesh_words(layout)
    tp, pp = layout.get("tensor_parallel", 1), layout.get("pipeline_parallel", 1)
    if layout.get("expert_parallel", 1) > 1:
        ep = layout["expert_parallel"]
        return (
            f"{n} processes spreading every MoE layer's experts over groups of {ep} (rank r records the "
            "parameters, gradients and optimizer state of its own experts and of the rest)"
        )
    if pp > 1:
        return (
            f"{n} processes, {n // pp} data ranks of {pp} pipeline stages (rank r records its stage's "
            "parameters, gradients and optimizer state)"
        )
    if tp > 1 and layout.get("sharded"):
        return (
            f"{n} processes, {n // tp} data ranks holding FSDP2 shards of each of {tp} tensor ranks' slices (rank "
            "r records its rows of its tensor rank's slice of every parameter, gradient and optimizer state)"
        )
    if tp > 1:
        return (
            f"{n} processes splitting every decoder layer over {tp} tensor ranks (rank r "
            "records its slice of each split parameter)"
        )
    if layout.get("sharded"):
        return (
            f"{n} process{'es' if n > 1 else ''} holding FSDP2 shards (rank r records its dim-0 rows of every "
            "parameter, gradient and optimizer state)"
        )
    if n > 1 and layout.get("ddp"):
        return f"{n} processes holding whole tensors (DDP)"
    return "1 process" if n == 1 else f"{n} processes holding whole tensors (data parallel, with collectives)"


def rank_coordinates(layout: dict[str, Any], rank: int) -> str | None:
    """Where ``rank`` sits in ``layout`` (``layout_at``'s): its data rank, pipeline stage, tensor rank and place
    among the expert ranks, of the dimensions over one (a data rank's stages consecutive, a stage's tensor ranks
    consecutive; expert groups of consecutive data ranks); of a loop of one's own, its coordinates on the mesh
    its parameters live on, by the mesh's dimension names; None where there is one dimension (the rank is its
    data rank)."""
    if layout.get("meshes"):  # a loop of one's own: by the names its mesh gives its dimensions
        return next(
            (
                f"{where} of the mesh {' x '.join(f'{n}={s}' for n, s in zip(m['names'], m['shape']))}"
                for m in layout["meshes"]
                if (where := mesh_coordinates(m, rank)) is not None
            ),
            None,
        )
    tp, pp, ep = (layout.get(k, 1) for k in ("tensor_parallel", "pipeline_parallel", "expert_parallel"))
    if tp == pp == ep == 1:
        return None
    data, rest = divmod(rank, pp * tp)
    stage, tensor = divmod(rest, tp)
    words = (
        [f"data rank {data}"]
        + ([f"pipeline stage {stage}"] if pp > 1 else [])
        + ([f"tensor rank {tensor}"] if tp > 1 else [])
        + ([f"expert rank {data % ep} of group {data // ep}"] if ep > 1 else [])
    )
    return ", ".join(words)


def steps_on_other_layouts(doc_a: dict, doc_b: dict, steps: set[int], notes: list[str], final: bool = True) -> set[int]:
    """The steps of ``steps`` that the runs (their run.json: ``doc_a``, ``doc_b``) wrote on other layouts,
    where trace records do not pair up one to one; a note names both layouts and what is compared there
    instead: the loss and grad-norm bits, the receipts and, where ``final`` (both wrote one), the final state
    digest."""
    other = sorted(s for s in steps if layout_at(doc_a, s) != layout_at(doc_b, s))
    if other:
        first = other[0]
        notes.append(
            f"the runs wrote step(s) {format_selection(other)} on other layouts (A: "
            f"{_layout_words(layout_at(doc_a, first))}; B: {_layout_words(layout_at(doc_b, first))}"
            f"{' at step ' + str(first) if len(other) < len(steps) else ''}): trace records are "
            "compared only at steps both wrote on one layout; at these, the loss and grad-norm bits "
            "(metrics and receipts)"
            + (
                " and the final state digest are compared"
                if final
                else " are compared, and no final state (final.json: not both "
                "runs wrote one), so a difference in the state alone is not seen"
            )
        )
    return set(other)

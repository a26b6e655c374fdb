"""FSDP2 (``fully_shard``) with the canonical reduction: sharded parameters, gradients and optimizer
state, and the bits of the unsharded data-parallel run on any number of processes.

FSDP2 reduce-scatters each group's gradients after every backward, summing in whatever order the
collective picks and adding each microbatch into the sharded gradient as it arrives. Here each group's
reduce-scatter is ``CanonicalReduceScatter`` (FSDP2's ``set_custom_reduce_scatter``): it keeps this
process's microbatch gradients (FSDP2's flat layout, one chunk per rank) and folds them along the
canonical tree as they come (``BinaryCounter``, as ``CanonicalGradients`` does); at the process's last
microbatch it hands rank j the j-th chunk of that local sum (an all-to-all: the bytes of a ring
reduce-scatter) and rank j sums the chunks in rank order along the same tree. Every element is then the
same sum, bracketed the same way, as in ``CanonicalGradients`` on one process (docs/layouts.md).
The reduce-scatters of earlier microbatches hand FSDP2 zeros, and ``FsdpGradients.accumulate`` drops
them, so FSDP2 adds nothing: the sharded gradient is the canonical shard itself.

``full_state`` gathers the unsharded state (the final digest is of it); a checkpoint holds each rank's
shards (``save_checkpoint(sharded=True)``) and loads as whole tensors, which ``ShardedModel`` and
``ShardedOptimizer`` cut into this layout's shards: a run moves between 4, 2 and 1 processes, sharded
or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from samestep.distributed.reduce import combine_across_ranks
from samestep.distributed.tree import BinaryCounter, validate_layout

__all__ = [
    "CanonicalReduceScatter",
    "FsdpDefaultGradients",
    "FsdpGradients",
    "Held",
    "ShardedModel",
    "ShardedOptimizer",
    "full_state",
    "shard_model",
    "shard_rows",
    "tensor_ranks_part",
    "whole_tensor",
]


def shard_model(model: torch.nn.Module, world_size: int, mesh: Any = None, blocks: Any = None) -> torch.nn.Module:
    """Applies FSDP2 over the default process group (or ``mesh``: the data ranks of a tensor-parallel
    model's 2-D mesh): each block is a group, and the root holds the rest (embeddings, the tied head, the
    final norm). ``blocks``: the blocks' module class (or a tuple of classes), e.g. transformers'
    ``LlamaDecoderLayer``; by default the modules whose class is named ``Block`` (samestep's models)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if blocks is None:
        found = [m for m in model.modules() if m is not model and type(m).__name__ == "Block"]
    elif isinstance(blocks, type) or (isinstance(blocks, tuple) and all(isinstance(b, type) for b in blocks)):
        found = [m for m in model.modules() if m is not model and isinstance(m, blocks)]
        if not found:
            raise ValueError(
                f"shard_model(blocks={blocks!r}): the model holds no such module; pass the class of "
                f"its blocks (its module classes: {sorted({type(m).__name__ for m in model.modules()})})"
            )
    else:
        raise TypeError(
            f"shard_model(blocks={blocks!r}): a module class or a tuple of them (the class of the "
            "model's decoder blocks, e.g. LlamaDecoderLayer)"
        )
    device = next(model.parameters()).device
    mesh = mesh if mesh is not None else init_device_mesh(device.type, (world_size,))
    for module in found:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class CanonicalReduceScatter:
    """FSDP2's reduce-scatter interface (``allocate`` and the call) for one FSDP group, reducing along the
    canonical tree over global microbatches (see the module docstring). ``owner``: the ``FsdpGradients`` whose
    microbatch is running. A group may reduce more than once per backward (torchtitan's chunked loss takes the
    head's gradient apart from its norm's): each call keeps a tree of its own, by its place among the calls of
    its microbatch (``next_microbatch`` starts the count again), and the calls of the owner's last microbatch
    reduce them."""

    def __init__(self, owner: FsdpGradients) -> None:
        self.owner = owner
        self._counters: dict[int, BinaryCounter] = {}  # by the call's place in its microbatch
        self._place = 0

    @property
    def pending(self) -> bool:
        """Gradients pushed whose microbatches' last one has not reduced them."""
        return bool(self._counters)

    def next_microbatch(self) -> None:
        """The owner's microbatch ended: the next one's calls count from the first place."""
        self._place = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> None:
        import torch.distributed as dist

        place, self._place = self._place, self._place + 1
        self._counters.setdefault(place, BinaryCounter()).push(input_tensor.detach().clone())
        if self.owner.current_microbatch != self.owner.microbatches.stop - 1:
            output_tensor.zero_()  # dropped by FsdpGradients.accumulate: FSDP2 adds nothing of it
            return None
        local = self._counters.pop(place).result()
        world = dist.get_world_size(group)
        received = torch.empty_like(local)
        dist.all_to_all_single(received, local, group=group)  # row r: rank r's sum of my chunk
        rows = BinaryCounter()
        for row in received.view(world, -1):
            rows.push(row.clone())
        output_tensor.copy_(rows.result())
        self.owner.bytes_sent += (world - 1) * (local.numel() // world) * local.element_size()
        if self.owner.observer is not None:
            self.owner.observer("canonical_reduce_scatter", local, output_tensor)
        return None


class FsdpGradients:
    """``CanonicalGradients``' interface for a model that ``shard_model`` sharded: after each microbatch's
    ``backward()`` call ``accumulate(i)``; ``reduce()`` returns the canonical sum of the extras (the loss),
    the gradients being already reduced, each rank holding its shard (DTensor ``p.grad``)."""

    canonical = True  # each group's reduce-scatter is a CanonicalReduceScatter

    def __init__(
        self, model: torch.nn.Module, *, microbatches_per_process: int, world_size: int, rank: int, group: Any = None
    ) -> None:
        from torch.distributed.fsdp import FSDPModule

        validate_layout(world_size, microbatches_per_process)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.k, self.world_size, self.rank, self.group = microbatches_per_process, world_size, rank, group
        self.bytes_sent = 0
        self.observer: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None
        self.comms = []
        states: set[int] = set()
        for module in model.modules() if self.canonical else ():
            # one comm per FSDP group: modules sharded together (a list to fully_shard) share one state, and a
            # root whose parameters all went to the groups below it has none to reduce
            if isinstance(module, FSDPModule) and id(state := module._get_fsdp_state()) not in states:
                states.add(id(state))
                if state._fsdp_param_groups:
                    comm = CanonicalReduceScatter(self)
                    module.set_custom_reduce_scatter(comm)
                    self.comms.append(comm)
        self._extra = BinaryCounter()
        self._next = rank * self.k

    @property
    def microbatches(self) -> range:
        """The global microbatch indices this process owns."""
        return range(self.rank * self.k, (self.rank + 1) * self.k)

    @property
    def current_microbatch(self) -> int:
        """The global index of the microbatch whose backward is running (the next to ``accumulate``)."""
        return self._next

    def accumulate(self, microbatch: int, extra: torch.Tensor | None = None) -> None:
        """Microbatch ``microbatch`` (global index, the next of this process's range) is done: its extra
        joins the tree, and before the last one the zeros FSDP2 was handed are dropped."""
        if microbatch != self._next or microbatch not in self.microbatches:
            raise ValueError(
                f"accumulate(microbatch={microbatch}): rank {self.rank} expects global index "
                f"{self._next} next (it owns {self.microbatches.start}..{self.microbatches.stop - 1})"
            )
        self._next += 1
        for comm in self.comms:
            comm.next_microbatch()
        dtype = self.params[0].dtype
        self._extra.push(
            extra.detach().reshape(-1).to(dtype).clone() if extra is not None else torch.zeros(0, dtype=dtype)
        )
        if self._next < self.microbatches.stop:
            for p in self.params:
                p.grad = None

    def reduce(self) -> torch.Tensor:
        """The canonical sum of the extras over all microbatches of all processes (same on every rank)."""
        if self._next != self.microbatches.stop:
            raise RuntimeError(f"reduce() after {self._next - self.microbatches.start} of {self.k} microbatches")
        if any(c.pending for c in self.comms):
            raise RuntimeError(
                "an FSDP group's reduce-scatter ran fewer times than the microbatches: a group "
                "whose parameters got no gradient in some microbatch"
            )
        self._next = self.microbatches.start
        total, sent = combine_across_ranks(self._extra.result(), self.world_size, self.group)
        self.bytes_sent += sent
        return total


class FsdpDefaultGradients(FsdpGradients):
    """FSDP2's own reduction, for comparison (deterministic mode off): every microbatch's gradients are
    reduce-scattered by the collective's own order and added into the shard as they arrive, so the bits
    depend on the process count. FSDP2 averages over the processes; the loss is summed, so the
    gradients are scaled back by the world size."""

    canonical = False  # FSDP2's own reduce-scatter

    def accumulate(self, microbatch: int, extra: torch.Tensor | None = None) -> None:
        self._next += 1
        dtype = self.params[0].dtype
        self._extra.push(
            extra.detach().reshape(-1).to(dtype).clone() if extra is not None else torch.zeros(0, dtype=dtype)
        )

    def reduce(self) -> torch.Tensor:
        for p in self.params:
            if p.grad is not None:
                p.grad = p.grad * float(self.world_size)
        return super().reduce()


def whole_tensor(t: Any) -> Any:
    """A DTensor gathered whole (a collective over its mesh: every rank calls it), any other tensor detached,
    anything else itself."""
    from torch.distributed.tensor import DTensor

    # a 2-D one through its tensor ranks' part: DTensor's full_tensor misplaces doubly strided rows
    return (
        tensor_ranks_part(t).full_tensor()
        if isinstance(t, DTensor)
        else t.detach()
        if isinstance(t, torch.Tensor)
        else t
    )


def full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The unsharded ``state_dict()`` of a sharded model (tied entries stay one tensor) and of its
    optimizer: what the unsharded run would hold, bit for bit. A collective: every rank calls it."""
    seen: dict[int, torch.Tensor] = {}
    model_sd = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) not in seen:
            seen[id(value)] = whole_tensor(value)
        model_sd[key] = seen[id(value)]
    if optimizer is None:
        return model_sd, None
    sd = optimizer.state_dict()
    sd["state"] = {i: {k: whole_tensor(v) for k, v in s.items()} for i, s in sd["state"].items()}
    return model_sd, sd


class Held:
    """A state already taken (``full_state``), offered as ``state_dict()`` to a checkpoint writer that
    asks rank 0 alone for it."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def state_dict(self) -> Any:
        return self._state


def shard_rows(rows: int, world: int) -> list[list[int]]:
    """The rows [start, end) along the split dimension each of ``world`` ranks holds of a tensor of ``rows``
    rows there, as DTensor's Shard and FSDP2 split it (``torch.chunk``: ceil-sized pieces, the last ones short
    or empty)."""
    size = -(-rows // world) if rows else 0
    return [[min(r * size, rows), min((r + 1) * size, rows)] for r in range(world)]


def _sizes(rows: int, world: int) -> list[int]:
    return [b - a for a, b in shard_rows(rows, world)]


def tensor_ranks_part(t: Any) -> Any:
    """A DTensor of FSDP2 over tensor parallelism (a 2-D mesh: data ranks x tensor ranks) as the tensor ranks
    alone hold it, placed as the tensor-parallel style placed it: FSDP2 cuts each tensor rank's part into
    ``torch.chunk`` pieces over the data ranks, so an all-gather over them (the part's bytes) and a
    concatenation restore it; any other tensor as it is. A collective over the data ranks.

    DTensor's own redistribute is not used: it misplaces rows where both placements are strided (a fused
    projection's ``_StridedShard`` under FSDP2's)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor) or t.device_mesh.ndim == 1:
        return t
    import torch.distributed as dist

    mesh = t.device_mesh
    if mesh.ndim != 2 or mesh.mesh_dim_names is None:
        raise ValueError(
            f"a DTensor placed {t.placements} on a {mesh.ndim}-D mesh with dimension names "
            f"{mesh.mesh_dim_names}: FSDP2 over tensor parallelism is a 2-D mesh of named dimensions "
            "(data ranks, tensor ranks). Fix: pass full_tensor() of it, or name the mesh's dimensions"
        )
    outer, inner = t.placements
    tensor_ranks = mesh[mesh.mesh_dim_names[1]]
    local = t.to_local()
    if not isinstance(outer, Replicate):
        dim, world = outer.dim % t.dim(), mesh.size(0)
        whole = list(t.shape)
        if not isinstance(inner, Replicate):
            whole[inner.dim % t.dim()] //= tensor_ranks.size()
        sizes = _sizes(whole[dim], world)
        padded = list(local.shape)
        padded[dim] = max(sizes)
        mine = torch.zeros(padded, dtype=local.dtype, device=local.device)
        mine.narrow(dim, 0, local.shape[dim]).copy_(local)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=mesh.get_group(0))
        local = torch.cat([g.narrow(dim, 0, n) for g, n in zip(gathered, sizes)], dim)
    return DTensor.from_local(local, tensor_ranks, [inner], run_check=False, shape=t.shape, stride=t.stride())


def _shard_like(full: torch.Tensor, like: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    if not isinstance(like, DTensor):
        return full
    # every rank holds the whole tensor (each read the checkpoint): its own chunk, without communication
    mesh = like.device_mesh
    if mesh.ndim == 1:
        return distribute_tensor(full.to(like.device), mesh, like.placements, src_data_rank=None)
    # FSDP2 over tensor parallelism: the tensor rank's part, then the data rank's chunk of it (tensor_ranks_part)
    outer, inner = like.placements
    local = distribute_tensor(
        full.to(like.device), mesh[mesh.mesh_dim_names[1]], [inner], src_data_rank=None
    ).to_local()
    if not isinstance(outer, Replicate):
        dim, world = outer.dim % like.dim(), mesh.size(0)
        sizes = _sizes(local.shape[dim], world)
        r = mesh.get_local_rank(0)
        local = local.narrow(dim, sum(sizes[:r]), sizes[r]).contiguous()
    return DTensor.from_local(local, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())


class ShardedModel:
    """``load_state_dict`` of an unsharded state into a sharded model (each rank keeps its shard): each whole
    tensor becomes a DTensor placed as the model's own ``state_dict`` places that entry, and the model's own
    ``load_state_dict`` takes them, so its state-dict hooks run (a fused weight split on save is fused again).
    Both ``state_dict`` and ``load_state_dict`` may run collectives in those hooks: every rank calls this."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        own = self.model.state_dict(keep_vars=True)
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if strict and (missing or unexpected):
            raise RuntimeError(f"sharded model state: missing keys {missing}, unexpected keys {unexpected}")
        self.model.load_state_dict(
            {key: _shard_like(value, own[key]) if key in own else value for key, value in state.items()}, strict=strict
        )


class ShardedOptimizer:
    """``load_state_dict`` of an unsharded optimizer state into the optimizer of a sharded model: each
    tensor shaped like its parameter becomes the parameter's shard."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
        for p, s in self.optimizer.state.items():
            for k, v in list(s.items()):
                if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0:
                    s[k] = _shard_like(v, p)

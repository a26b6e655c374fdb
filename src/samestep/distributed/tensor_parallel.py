"""Tensor-parallel linear layers whose bits do not depend on the tensor-parallel degree
(docs/layouts.md, "Tensor parallelism").

A linear layer ``y = x W^T + b`` split over T ranks sums over the split dimension somewhere: a row-parallel
layer (W split along K) in its forward, a column-parallel one (W split along N) in its input gradient.
PyTorch's parallel styles leave that sum to an all-reduce whose order the collective picks, and each rank
calls one matmul over its whole shard, whose blocking (and so its bits) follows the shard's width.

Here the split dimension is cut into ``chunks`` fixed chunks whatever the degree (T must divide ``chunks``,
both powers of two), and every matmul runs chunk by chunk, so each has the same shapes unsplit and on any
number of ranks. The chunks that a reduction sums are summed along the canonical tree over chunk index
(``tree.BinaryCounter``): a rank holds an aligned run of ``chunks / T`` chunks, a subtree, sums it, and the
ranks combine their subtree sums in rank order with ``reduce.combine_across_ranks``, the bytes of a ring
all-reduce. Unsplit (no group) the same function runs the whole tree in one process.

The parameters are sharded by PyTorch's own styles (``ColwiseParallel``: weight and bias ``Shard(0)``;
``RowwiseParallel``: weight ``Shard(1)``, bias ``Replicate``), so state dicts, FSDP2 and checkpoints see
ordinary DTensors; only the layer's forward and backward are samestep's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from samestep.distributed.reduce import tree_across_ranks
from samestep.distributed.sequence_parallel import SequenceShard, all_gather_blocks, tree_to_block
from samestep.distributed.vocab_parallel import vocab_parallel_embedding

__all__ = ["CanonicalColwiseParallel", "CanonicalRowwiseParallel", "CanonicalVocabEmbedding", "column_linear",
           "row_linear", "sequence_shard", "validate_tp"]


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def validate_tp(degree: int, chunks: int, dims: dict[str, int]) -> None:
    """Refuses a tensor-parallel degree that does not cut every split dimension into whole chunks.

    ``dims`` names each split dimension (e.g. ``{"n_embd": 64, "n_head": 4}``); each must be divisible by
    ``chunks``, except head counts, which only ``degree`` must divide.

    Raises:
        ValueError: names the value and the degrees or chunk counts that would do.
    """
    if not _is_pow2(chunks):
        raise ValueError(f"parallel.tp_chunks={chunks} is not a power of two. Fix: 1, 2, 4, 8 or 16")
    if not _is_pow2(degree) or chunks % degree:
        ok = ", ".join(str(1 << i) for i in range(chunks.bit_length()))
        raise ValueError(f"parallel.tp={degree} does not divide parallel.tp_chunks={chunks} into a power of two "
                         f"chunks per rank. Fix: parallel.tp in {ok}, or a larger parallel.tp_chunks")
    for name, size in dims.items():
        need, key = (degree, "parallel.tp") if "head" in name else (chunks, "parallel.tp_chunks")
        if size % need:
            raise ValueError(f"{name}={size} is not divisible by {key}={need}: tensor parallelism cuts it into "
                             f"whole pieces. Fix: a multiple of {need}")


def _degree(group: Any) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _dtypes(x: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(the dtype the layer computes in: autocast's where it is on, else the input's; the dtype its products
    accumulate in: float32 for a half type). A chunk's product rounds its operands to the first and
    accumulates in the second, as a half-precision matmul does; the sums over chunks run in the first, the
    bytes of a half-precision all-reduce."""
    kind = x.device.type
    cd = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    return cd, torch.float32 if cd in (torch.float16, torch.bfloat16) else cd


def _as(t: torch.Tensor | None, cd: torch.dtype, acc: torch.dtype) -> torch.Tensor | None:
    """``t`` rounded to ``cd``, held in ``acc`` (both no-ops in float32)."""
    return None if t is None else t.to(cd).to(acc)


class _Column(torch.autograd.Function):
    """y = x W^T + b with W this rank's rows: ``parts`` fused projections (q, k, v), each this rank's
    ``local_chunks`` chunks of its rows, part after part; y laid out the same way."""

    @staticmethod
    def forward(ctx, x, weight, bias, local_chunks, parts, group, sequence):
        if sequence is not None:  # x is this rank's block of the sequence: the layer takes the whole
            x = all_gather_blocks(x, sequence)
        cd, acc = _dtypes(x)
        with torch.autocast(x.device.type, enabled=False):
            x2 = _as(_rows(x), cd, acc)
            ws = _as(weight, cd, acc).chunk(parts * local_chunks, 0)  # part p's chunk c at p * local_chunks + c
            bs = _as(bias, cd, acc).chunk(parts * local_chunks, 0) if bias is not None else [None] * len(ws)
            y = torch.cat([nn.functional.linear(x2, w, b) for w, b in zip(ws, bs)], dim=1).to(cd)
        ctx.save_for_backward(x, weight)
        ctx.local_chunks, ctx.parts, ctx.group, ctx.has_bias = local_chunks, parts, group, bias is not None
        ctx.dtypes, ctx.sequence = (cd, acc), sequence
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        k, parts, (cd, acc) = ctx.local_chunks, ctx.parts, ctx.dtypes
        x2, g2 = _as(_rows(x), cd, acc), _as(_rows(grad_y), cd, acc)
        ws = _as(weight, cd, acc).chunk(parts * k, 0)
        gs = [g.contiguous() for g in g2.chunk(parts * k, 1)]  # a chunk's matmuls: one shape anywhere
        leaves = []  # chunk c: its parts' products summed in part order, all on the rank that holds chunk c
        for c in range(k):
            leaf = gs[c] @ ws[c]
            for p in range(1, parts):
                leaf.add_(gs[p * k + c] @ ws[p * k + c])
            leaves.append(leaf.to(cd))
        if ctx.sequence is None:
            grad_x = tree_across_ranks(leaves, ctx.group).view(x.shape).to(x.dtype)
        else:  # the input's gradient of this rank's block only
            grad_x = tree_to_block([leaf.view(x.shape) for leaf in leaves], ctx.sequence).to(x.dtype)
        grad_w = torch.cat([g.t() @ x2 for g in gs], dim=0).to(cd).to(weight.dtype)
        grad_b = torch.cat([g.sum(0) for g in gs]).to(cd).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None, None


class _Row(torch.autograd.Function):
    """y = sum over K chunks of x_c W_c^T, + b once: x this rank's ``local_chunks`` chunks of the input's last
    dimension, W the matching columns; y whole (and the same bits) on every rank, or with ``sequence`` this
    rank's block of it."""

    @staticmethod
    def forward(ctx, x, weight, bias, local_chunks, group, sequence):
        cd, acc = _dtypes(x)
        shape = (*x.shape[:-1], weight.shape[0])
        with torch.autocast(x.device.type, enabled=False):
            x2 = _as(_rows(x), cd, acc)
            xs = [c.contiguous() for c in x2.chunk(local_chunks, 1)]
            ws = [c.contiguous() for c in _as(weight, cd, acc).chunk(local_chunks, 1)]
            leaves = [(xc @ wc.t()).to(cd) for xc, wc in zip(xs, ws)]
            if sequence is None:
                y = tree_across_ranks(leaves, group).view(shape)
            else:  # this rank's block of the sum only
                y = tree_to_block([leaf.view(shape) for leaf in leaves], sequence)
            if bias is not None:
                y = y + bias.to(cd)
        ctx.save_for_backward(x, weight)
        ctx.local_chunks, ctx.has_bias, ctx.dtypes, ctx.sequence = local_chunks, bias is not None, (cd, acc), sequence
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        cd, acc = ctx.dtypes
        if ctx.sequence is not None:  # this rank's block of the output's gradient: the layer needs the whole
            grad_y = all_gather_blocks(grad_y, ctx.sequence)
        x2, g2 = _as(_rows(x), cd, acc), _as(_rows(grad_y), cd, acc).contiguous()
        xs = [c.contiguous() for c in x2.chunk(ctx.local_chunks, 1)]
        ws = [c.contiguous() for c in _as(weight, cd, acc).chunk(ctx.local_chunks, 1)]
        grad_x = torch.cat([g2 @ wc for wc in ws], dim=1).view(x.shape).to(cd).to(x.dtype)
        grad_w = torch.cat([g2.t() @ xc for xc in xs], dim=1).to(cd).to(weight.dtype)
        grad_b = g2.sum(0).to(cd).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunks: int,
                  group: Any = None, parts: int = 1, sequence: SequenceShard | None = None) -> torch.Tensor:
    """Column-parallel ``x W^T + b``: ``x`` whole on every rank (with ``sequence``: this rank's block of the
    sequence, gathered whole first), ``weight``/``bias`` this rank's rows (or DTensors sharded ``Shard(0)``;
    of ``parts`` fused projections, this rank's rows of each, part after part), the output this rank's slice
    of the last dimension (of each part). The input's gradient sums the ``chunks`` chunks along the canonical
    tree across the group, a chunk's parts in part order (with ``sequence``: this rank's block of it)."""
    local_chunks = chunks // _degree(group)
    return _Column.apply(x, _local(weight), _local(bias), local_chunks, parts, group, sequence)


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunks: int,
               group: Any = None, sequence: SequenceShard | None = None) -> torch.Tensor:
    """Row-parallel ``x W^T + b``: ``x`` this rank's slice of the last dimension, ``weight`` the matching
    columns (or a DTensor sharded ``Shard(1)``), ``bias`` whole; the output whole on every rank (with
    ``sequence``: this rank's block of the sequence), the ``chunks`` partial products summed along the
    canonical tree across the group."""
    local_chunks = chunks // _degree(group)
    return _Row.apply(x, _local(weight), _local(bias), local_chunks, group, sequence)


def _strided_partition(parts: int) -> Any:
    """A partition that gives each rank its rows of each of ``parts`` fused projections, part after part
    (DTensor's ``_StridedShard``: the whole tensor keeps its unsplit layout, so state dicts and checkpoints
    do not depend on the degree)."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    def partition(name: str, module: nn.Module, device_mesh: Any) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placed = distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=parts)])
            module.register_parameter(pname, nn.Parameter(placed, requires_grad=param.requires_grad))

    return partition


def _placed(module: nn.Module, device_mesh: Any, rows: bool) -> bool:
    """Whether ``module``'s parameters are already sharded, as a weight tied to a vocabulary-parallel
    embedding is (wrapping it again would make a second parameter and untie it): True only where every one
    is a DTensor on ``device_mesh`` sharded by rows and ``rows`` (the style shards rows) says that is right.

    Raises:
        ValueError: some are placed and some not, or placed otherwise than the style would.
    """
    from torch.distributed.tensor import DTensor, Shard

    params = list(module.named_parameters(recurse=False))
    placed = [name for name, p in params if isinstance(p, DTensor)]
    if not placed:
        return False
    wrong = [name for name, p in params if not (isinstance(p, DTensor) and rows and p.device_mesh == device_mesh
                                                 and tuple(p.placements) == (Shard(0),))]
    if wrong:
        raise ValueError(f"{type(module).__name__}.{wrong[0]} is not placed as this style shards it (Shard(0) on "
                         "its mesh) while another parameter of the layer already is a DTensor. Fix: tie only a "
                         "column-parallel layer without bias to a vocabulary-parallel embedding")
    return True


def sequence_shard(device_mesh: Any) -> SequenceShard:
    """This rank's place among the ranks of a one-dimensional ``device_mesh`` that split sequences."""
    size = device_mesh.size()
    return SequenceShard(device_mesh.get_local_rank(), size, device_mesh.get_group() if size > 1 else None)


def _style_apply(stock: Any, module: nn.Module, device_mesh: Any, fn: Any, chunks: int, parts: int = 1,
                 sequence_dim: int | None = None) -> nn.Module:
    """Shards ``module``'s parameters with the stock style's own partition (of ``parts`` fused projections:
    each part split alike), then routes its forward through ``fn`` (local tensors in and out; with
    ``sequence_dim``, the layer's side that is not split by features is this rank's block of the sequence)."""
    from torch.distributed.tensor import distribute_module

    if not isinstance(module, nn.Linear):
        raise NotImplementedError(f"{type(stock).__name__} shards nn.Linear only, got {type(module).__name__}")
    if module.out_features % parts:
        raise ValueError(f"{type(stock).__name__}(parts={parts}): out_features={module.out_features} is not "
                         f"{parts} equal projections. Fix: parts must divide it")
    split = ({"in_features": module.in_features} if fn is row_linear
             else {"out_features / parts": module.out_features // parts})
    validate_tp(device_mesh.size(), chunks, split)
    if not _placed(module, device_mesh, fn is column_linear and parts == 1):
        distribute_module(module, device_mesh,
                          stock._partition_linear_fn if parts == 1 else _strided_partition(parts))
    group = device_mesh.get_group() if device_mesh.size() > 1 else None
    sequence = sequence_shard(device_mesh) if sequence_dim is not None else None
    if sequence_dim not in (None, 1):
        raise ValueError(f"{type(stock).__name__}: sequence_dim={sequence_dim}; the sequence is dimension 1 "
                         "(batch, positions, features)")

    def forward(x: torch.Tensor) -> torch.Tensor:
        if fn is row_linear:
            return fn(x, module.weight, module.bias, chunks, group, sequence)
        return fn(x, module.weight, module.bias, chunks, group, parts, sequence)

    module.forward = forward
    return module


try:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
except ImportError:  # a torch built without distributed
    ColwiseParallel = RowwiseParallel = object  # type: ignore[misc,assignment]


class CanonicalColwiseParallel(ColwiseParallel):  # type: ignore[misc,valid-type]
    """``ColwiseParallel`` (weight and bias ``Shard(0)``) whose forward and backward are ``column_linear``:
    input and output are local tensors, the input whole, the output this rank's slice of the last
    dimension. ``chunks``: the fixed chunk count (parallel.tp_chunks) that every degree used divides.
    ``parts``: the layer is that many fused projections of equal width (a fused q, k, v: 3), each split
    alike, so a rank holds whole heads of each; its output is this rank's slice of each, part after part.
    ``sequence_dim`` (1; sequence parallelism): the input is this rank's block of the sequence, gathered whole,
    and its gradient comes back as that block (``sequence_parallel.tree_to_block``)."""

    def __init__(self, chunks: int = 8, parts: int = 1, sequence_dim: int | None = None) -> None:
        super().__init__()
        self.chunks, self.parts, self.sequence_dim = chunks, parts, sequence_dim

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return _style_apply(self, module, device_mesh, column_linear, self.chunks, self.parts, self.sequence_dim)


class CanonicalRowwiseParallel(RowwiseParallel):  # type: ignore[misc,valid-type]
    """``RowwiseParallel`` (weight ``Shard(1)``, bias ``Replicate``) whose forward and backward are
    ``row_linear``: the input this rank's slice of the last dimension, the output whole on every rank
    with the same bits at every degree. ``sequence_dim`` (1; sequence parallelism): the output is this rank's
    block of the sequence instead, its sum reduced to that block (``sequence_parallel.tree_to_block``), and
    the output's gradient blocks are gathered whole."""

    def __init__(self, chunks: int = 8, sequence_dim: int | None = None) -> None:
        super().__init__()
        self.chunks, self.sequence_dim = chunks, sequence_dim

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return _style_apply(self, module, device_mesh, row_linear, self.chunks, sequence_dim=self.sequence_dim)


class CanonicalVocabEmbedding(RowwiseParallel):  # type: ignore[misc,valid-type]
    """``RowwiseParallel`` for an ``nn.Embedding`` (weight ``Shard(0)``: rows split by vocabulary) whose
    forward and backward are ``vocab_parallel_embedding``: the token ids whole on every rank, the output whole
    with the unsplit lookup's bits at every degree. ``chunks`` (parallel.tp_chunks) only checks the degree:
    the vocabulary must split into whole chunks for the head tied to it or paired with it
    (``CanonicalColwiseParallel``)."""

    def __init__(self, chunks: int = 8) -> None:
        super().__init__()
        self.chunks = chunks

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        if not isinstance(module, nn.Embedding):
            raise NotImplementedError(f"CanonicalVocabEmbedding shards nn.Embedding only, got {type(module).__name__}")
        if module.padding_idx is not None or module.max_norm is not None or module.sparse:
            raise NotImplementedError("CanonicalVocabEmbedding does not support padding_idx, max_norm or sparse "
                                      "gradients. Fix: an nn.Embedding without them")
        validate_tp(device_mesh.size(), self.chunks, {"num_embeddings": module.num_embeddings})
        distribute_module(module, device_mesh, self._partition_embedding_fn)
        group = device_mesh.get_group() if device_mesh.size() > 1 else None

        def forward(idx: torch.Tensor) -> torch.Tensor:
            return vocab_parallel_embedding(idx, module.weight, group)

        module.forward = forward
        return module

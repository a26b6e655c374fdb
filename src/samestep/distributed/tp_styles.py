"""PyTorch's parallel styles for ``parallelize_module``, routed through the canonical tensor-parallel layers
(``tensor_parallel.column_linear``, ``row_linear``) and the vocabulary-parallel embedding: the same bits at every
degree (docs/layouts.md, "Tensor parallelism"). Each shards a module's parameters with the stock style's own
partition, then replaces its forward; a fused layer declares the layout of its rows, and PyTorch's layout
keyword arguments are taken where they keep the bits, refused by name where they cannot."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from samestep.distributed.tensor_parallel import column_linear, row_linear, sequence_shard, validate_tp
from samestep.distributed.vocab_parallel import vocab_parallel_embedding

__all__ = ["CanonicalColwiseParallel", "CanonicalRowwiseParallel", "CanonicalVocabEmbedding"]


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
    wrong = [
        name
        for name, p in params
        if not (isinstance(p, DTensor) and rows and p.device_mesh == device_mesh and tuple(p.placements) == (Shard(0),))
    ]
    if wrong:
        raise ValueError(
            f"{type(module).__name__}.{wrong[0]} is not placed as this style shards it (Shard(0) on "
            "its mesh) while another parameter of the layer already is a DTensor. Fix: tie only a "
            "column-parallel layer without bias to a vocabulary-parallel embedding"
        )
    return True


def _style_apply(
    stock: Any,
    module: nn.Module,
    device_mesh: Any,
    fn: Any,
    chunks: int,
    parts: int = 1,
    sequence_dim: int | None = None,
) -> nn.Module:
    """Shards ``module``'s parameters with the stock style's own partition (of ``parts`` fused projections:
    each part split alike), then routes its forward through ``fn`` (local tensors in and out; with
    ``sequence_dim``, the layer's side that is not split by features is this rank's block of the sequence)."""
    from torch.distributed.tensor import distribute_module

    if not isinstance(module, nn.Linear):
        raise NotImplementedError(f"{type(stock).__name__} shards nn.Linear only, got {type(module).__name__}")
    if module.out_features % parts:
        raise ValueError(
            f"{type(stock).__name__}(parts={parts}): out_features={module.out_features} is not "
            f"{parts} equal projections. Fix: parts must divide it"
        )
    split = (
        {"in_features": module.in_features}
        if fn is row_linear
        else {"out_features / parts": module.out_features // parts}
    )
    validate_tp(device_mesh.size(), chunks, split)
    # how the layer is split, read where its heads are known (placement.refuse_split_heads): (degree, the
    # weight's split dimension, the fused projections that dimension holds)
    module.samestep_tp_split = (device_mesh.size(), 1 if fn is row_linear else 0, parts)
    if not _placed(module, device_mesh, fn is column_linear and parts == 1):
        distribute_module(module, device_mesh, stock._partition_linear_fn if parts == 1 else _strided_partition(parts))
    group = device_mesh.get_group() if device_mesh.size() > 1 else None
    sequence = sequence_shard(device_mesh) if sequence_dim is not None else None
    if sequence_dim not in (None, 1):
        raise ValueError(
            f"{type(stock).__name__}: sequence_dim={sequence_dim}; the sequence is dimension 1 "
            "(batch, positions, features)"
        )

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

    A fused layer is declared with the layout of its rows (``fused``), which the weight alone does not show:
    ``fused="stacked"`` with ``parts=k``: k projections of equal width one after another, each whole (GPT-2's
    ``c_attn``: q, k, v), each split alike, so a rank holds whole heads of each and its output is its slice of
    each, part after part; ``fused="grouped"`` with ``groups=g``: g equal groups one after another (a q, k, v
    fused by kv head, as torchtitan's ``FusedQKVLinear`` lays out ``wqkv``: each group its q heads, then k, then
    v), of which each rank takes whole groups (the degree must divide g). ``parts`` > 1 without
    ``fused="stacked"`` is refused: read as stacked, a grouped layout would train another model at TP > 1.

    ``sequence_dim`` (1; sequence parallelism): the input is this rank's block of the sequence, gathered whole,
    and its gradient comes back as that block (``sequence_parallel.tree_to_block``). PyTorch's keyword
    arguments: ``input_layouts`` ``Replicate()`` (the default) or ``Shard(1)`` (as ``sequence_dim=1``);
    ``output_layouts`` ``Shard(-1)`` (the default) or ``Replicate()`` (the slices gathered whole, in rank
    order: an all-gather changes no bit; of an unfused layer); ``use_local_output=True``. Others are refused by
    name."""

    def __init__(
        self,
        chunks: int = 8,
        parts: int = 1,
        sequence_dim: int | None = None,
        *,
        fused: str | None = None,
        groups: int | None = None,
        input_layouts: Any = None,
        output_layouts: Any = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.chunks, self.parts, self.groups = chunks, *_fused_rows(parts, fused, groups)
        self.sequence_dim, self.gather_output = _column_layouts(
            input_layouts, output_layouts, use_local_output, sequence_dim, self.parts
        )

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if self.groups is not None and (self.groups % device_mesh.size() or module.out_features % self.groups):
            raise ValueError(
                f"CanonicalColwiseParallel(fused='grouped', groups={self.groups}): at TP "
                f"{device_mesh.size()} over out_features={module.out_features} a rank would not hold "
                "whole groups. Fix: a degree that divides the groups, and groups that divide the rows"
            )
        _style_apply(self, module, device_mesh, column_linear, self.chunks, self.parts, self.sequence_dim)
        if self.gather_output and device_mesh.size() > 1:
            sliced, group = module.forward, device_mesh.get_group()
            module.forward = lambda x: _GatherFeatures.apply(sliced(x), group)
        return module


def _fused_rows(parts: int, fused: str | None, groups: int | None) -> tuple[int, int | None]:
    """(parts, groups) of a column-parallel layer's declared fused layout (``CanonicalColwiseParallel``).

    Raises:
        ValueError: an undeclared or inconsistent layout, naming the fix.
    """
    if fused is None and parts == 1 and groups is None:
        return 1, None
    if fused == "stacked" and parts >= 2 and groups is None:
        return parts, None
    if fused == "grouped" and parts == 1 and isinstance(groups, int) and groups >= 1:
        return 1, groups
    raise ValueError(
        f"CanonicalColwiseParallel(parts={parts}, fused={fused!r}, groups={groups!r}): a fused layer "
        "says how its rows lie. Fix: fused='stacked' with parts=k for k projections one after another "
        "(q, then k, then v, each whole: GPT-2's c_attn), or fused='grouped' with groups=g for g groups "
        "one after another (a q, k, v fused by kv head: torchtitan's wqkv, groups=n_kv_heads)"
    )


def _placement_words(p: Any) -> str:
    return f"{type(p).__name__}({getattr(p, 'dim', '')})" if p is not None else "None"


def _is(p: Any, kind: str, dim: int | None = None) -> bool:
    return type(p).__name__ == kind and (dim is None or getattr(p, "dim", None) == dim)


def _column_layouts(
    input_layouts: Any, output_layouts: Any, use_local_output: bool, sequence_dim: int | None, parts: int
) -> tuple[int | None, bool]:
    """(sequence_dim, gather the output) from PyTorch's ``ColwiseParallel`` keyword arguments.

    Raises:
        ValueError: one that would change the bits or that the style does not run, naming it and the fix.
    """
    if input_layouts is not None and not _is(input_layouts, "Replicate"):
        if not _is(input_layouts, "Shard", 1) or sequence_dim not in (None, 1):
            raise ValueError(
                f"CanonicalColwiseParallel(input_layouts={_placement_words(input_layouts)}): takes "
                "Replicate() (the input whole) or Shard(1) (this rank's block of the sequence)"
            )
        sequence_dim = 1
    gather = output_layouts is not None and _is(output_layouts, "Replicate")
    if (output_layouts is not None and not gather and not _is(output_layouts, "Shard", -1)) or (gather and parts > 1):
        raise ValueError(
            f"CanonicalColwiseParallel(output_layouts={_placement_words(output_layouts)}"
            f"{', parts=' + str(parts) if parts > 1 else ''}): gives Shard(-1) (this rank's slice) or, "
            "of an unfused layer, Replicate() (the slices gathered)"
        )
    if not use_local_output:
        raise ValueError(
            "CanonicalColwiseParallel(use_local_output=False): its output is a local tensor; a DTensor "
            "output would hand the next op's sums to DTensor's own order. Fix: use_local_output=True"
        )
    return sequence_dim, gather


def _row_layouts(
    input_layouts: Any, output_layouts: Any, use_local_output: bool, sequence_dim: int | None
) -> int | None:
    """``sequence_dim`` from PyTorch's ``RowwiseParallel`` keyword arguments.

    Raises:
        ValueError: one that would change the bits or that the style does not run, naming it and the fix.
    """
    if input_layouts is not None and not _is(input_layouts, "Shard", -1):
        raise ValueError(
            f"CanonicalRowwiseParallel(input_layouts={_placement_words(input_layouts)}): takes "
            "Shard(-1) (this rank's slice of the features, a column-parallel layer's output)"
        )
    if output_layouts is not None and not _is(output_layouts, "Replicate"):
        if not _is(output_layouts, "Shard", 1) or sequence_dim not in (None, 1):
            raise ValueError(
                f"CanonicalRowwiseParallel(output_layouts={_placement_words(output_layouts)}): gives "
                "Replicate() (the output whole) or Shard(1) (this rank's block of the sequence)"
            )
        sequence_dim = 1
    if not use_local_output:
        raise ValueError(
            "CanonicalRowwiseParallel(use_local_output=False): its output is a local tensor; a DTensor "
            "output would hand the next op's sums to DTensor's own order. Fix: use_local_output=True"
        )
    return sequence_dim


class _GatherFeatures(torch.autograd.Function):
    """Every rank's slice of the last dimension, whole, in rank order (an all-gather: no arithmetic); the
    gradient back is this rank's slice of the whole one."""

    @staticmethod
    def forward(ctx, y, group):
        import torch.distributed as dist

        world = dist.get_world_size(group)
        parts = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(parts, y.contiguous(), group=group)
        ctx.rank, ctx.world = dist.get_rank(group), world
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.world, dim=-1)[ctx.rank].contiguous(), None


class CanonicalRowwiseParallel(RowwiseParallel):  # type: ignore[misc,valid-type]
    """``RowwiseParallel`` (weight ``Shard(1)``, bias ``Replicate``) whose forward and backward are
    ``row_linear``: the input this rank's slice of the last dimension, the output whole on every rank
    with the same bits at every degree. ``sequence_dim`` (1; sequence parallelism): the output is this rank's
    block of the sequence instead, its sum reduced to that block (``sequence_parallel.tree_to_block``), and
    the output's gradient blocks are gathered whole. PyTorch's keyword arguments: ``input_layouts``
    ``Shard(-1)`` (the default), ``output_layouts`` ``Replicate()`` (the default) or ``Shard(1)`` (as
    ``sequence_dim=1``), ``use_local_output=True``; others are refused by name."""

    def __init__(
        self,
        chunks: int = 8,
        sequence_dim: int | None = None,
        *,
        input_layouts: Any = None,
        output_layouts: Any = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.chunks = chunks
        self.sequence_dim = _row_layouts(input_layouts, output_layouts, use_local_output, sequence_dim)

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
            raise NotImplementedError(
                "CanonicalVocabEmbedding does not support padding_idx, max_norm or sparse "
                "gradients. Fix: an nn.Embedding without them"
            )
        validate_tp(device_mesh.size(), self.chunks, {"num_embeddings": module.num_embeddings})
        distribute_module(module, device_mesh, self._partition_embedding_fn)
        group = device_mesh.get_group() if device_mesh.size() > 1 else None

        def forward(idx: torch.Tensor) -> torch.Tensor:
            return vocab_parallel_embedding(idx, module.weight, group)

        module.forward = forward
        return module

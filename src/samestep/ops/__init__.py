"""Deterministic scatter-type kernels, registered with ``torch.library`` (visible to the dispatcher,
to samestep traces and to ``torch.compile``), with autograd.

Each has the signature of the torch function it replaces, so swapping one in is a one-word change::

    out = samestep.ops.index_add(x, 0, idx, src)        # was torch.index_add(x, 0, idx, src)

Definition (docs/kernels.md): every output element is its input value followed by its contributions
added one by one in ascending source order. ``samestep.enable(kernels=True)`` routes PyTorch's own
ops to these (see ``samestep.ops.routing``).
"""

from __future__ import annotations

import torch
from torch.types import Number

from samestep.ops import _impl, _indexing

__all__ = [
    "KERNELS",
    "bincount",
    "embedding_backward",
    "index_add",
    "index_put",
    "moe_combine",
    "scatter_add",
    "scatter_reduce",
    "segment_sum",
]

_T = torch.Tensor


# -- index_add ---------------------------------------------------------------------------------------
@torch.library.custom_op("samestep::index_add", mutates_args=())
def _index_add(input: _T, dim: int, index: _T, source: _T, alpha: Number) -> _T:
    return _impl.index_add(input, dim, index, source, alpha)


@_index_add.register_fake
def _(input, dim, index, source, alpha):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def _index_add_setup(ctx, inputs, output):
    _, ctx.dim, index, source, ctx.alpha = inputs
    ctx.source_shape = source.shape
    ctx.save_for_backward(index)


def _index_add_bwd(ctx, grad):
    (index,) = ctx.saved_tensors
    g_source = (grad.index_select(ctx.dim, index) if grad.dim() else grad).reshape(ctx.source_shape)
    return grad, None, None, g_source * ctx.alpha if ctx.alpha != 1 else g_source, None


_index_add.register_autograd(_index_add_bwd, setup_context=_index_add_setup)


def index_add(input: _T, dim: int, index: _T, source: _T, *, alpha: Number = 1) -> _T:
    """Deterministic ``torch.index_add``."""
    return _index_add(input, dim, index, source, alpha)


# -- scatter_add / scatter_reduce ----------------------------------------------------------------------
@torch.library.custom_op("samestep::scatter_add", mutates_args=())
def _scatter_add(input: _T, dim: int, index: _T, src: _T) -> _T:
    return _impl.scatter_add(input, dim, index, src)


@_scatter_add.register_fake
def _(input, dim, index, src):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def _scatter_setup(ctx, inputs, output):
    _, ctx.dim, index, src = inputs
    ctx.src_shape = src.shape
    ctx.save_for_backward(index)


def _scatter_add_bwd(ctx, grad):
    (index,) = ctx.saved_tensors
    g = grad.gather(ctx.dim, index)
    if tuple(g.shape) != tuple(ctx.src_shape):  # src larger than index: the rest received no gradient
        full = g.new_zeros(ctx.src_shape)
        full[tuple(slice(0, s) for s in g.shape)] = g
        g = full
    return grad, None, None, g


_scatter_add.register_autograd(_scatter_add_bwd, setup_context=_scatter_setup)


def scatter_add(input: _T, dim: int, index: _T, src: _T) -> _T:
    """Deterministic ``torch.scatter_add``."""
    return _scatter_add(input, dim, index, src)


def scatter_reduce(input: _T, dim: int, index: _T, src: _T, reduce: str, *, include_self: bool = True) -> _T:
    """Deterministic ``torch.scatter_reduce`` for ``reduce`` in ("sum", "mean"); differentiable through
    ``scatter_add`` and elementwise ops. An integral "mean" floor-divides, as PyTorch's."""
    return _impl.scatter_reduce(input, dim, index, src, reduce, include_self, add=scatter_add)


# -- index_put (accumulate) ------------------------------------------------------------------------------
@torch.library.custom_op("samestep::index_put", mutates_args=())
def _index_put(input: _T, indices: list[_T | None], values: _T, accumulate: bool) -> _T:
    return _indexing.index_put(input, indices, values, accumulate)


@_index_put.register_fake
def _(input, indices, values, accumulate):
    return torch.empty_like(input)


def _index_put_setup(ctx, inputs, output):
    _, indices, values, ctx.accumulate = inputs
    ctx.values_shape = values.shape
    ctx.holes = [i is None for i in indices]
    ctx.save_for_backward(*[i for i in indices if i is not None])


def _index_put_bwd(ctx, grad):
    tensors = iter(ctx.saved_tensors)
    key = tuple(slice(None) if hole else next(tensors) for hole in ctx.holes)
    g_values = grad[key].sum_to_size(ctx.values_shape)  # values were broadcast to the indexing result
    no_grads = [None] * len(ctx.holes)  # indices take none
    if ctx.accumulate:
        return grad, no_grads, g_values, None
    g_input = grad.clone()
    g_input[key] = 0  # overwritten positions take no gradient
    return g_input, no_grads, g_values, None


_index_put.register_autograd(_index_put_bwd, setup_context=_index_put_setup)


def index_put(input: _T, indices: tuple[_T | None, ...] | list[_T | None], values: _T, accumulate: bool = False) -> _T:
    """Deterministic ``torch.index_put`` (the ``accumulate=True`` form is the backward of ``x[idx]``);
    ``indices`` as PyTorch takes them: a tensor or None per leading dimension."""
    return _index_put(input, list(indices), values, accumulate)


# -- embedding backward, bincount, segment sum, MoE combine ------------------------------------------
@torch.library.custom_op("samestep::embedding_backward", mutates_args=())
def _embedding_backward(grad_output: _T, indices: _T, num_weights: int, padding_idx: int) -> _T:
    return _impl.embedding_backward(grad_output, indices, num_weights, padding_idx)


@_embedding_backward.register_fake
def _(grad_output, indices, num_weights, padding_idx):
    return grad_output.new_empty(num_weights, grad_output.shape[-1])


def embedding_backward(grad_output: _T, indices: _T, num_weights: int, padding_idx: int = -1) -> _T:
    """Deterministic ``torch.ops.aten.embedding_dense_backward``."""
    return _embedding_backward(grad_output, indices, num_weights, padding_idx)


@torch.library.custom_op("samestep::segment_sum", mutates_args=())
def _segment_sum(data: _T, segment_ids: _T, num_segments: int) -> _T:
    return _impl.segment_sum(data, segment_ids, num_segments)


@_segment_sum.register_fake
def _(data, segment_ids, num_segments):
    return data.new_empty(num_segments, *data.shape[1:])


def _segment_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


_segment_sum.register_autograd(
    lambda ctx, g: (g.index_select(0, ctx.saved_tensors[0]), None, None), setup_context=_segment_setup
)


def segment_sum(data: _T, segment_ids: _T, num_segments: int) -> _T:
    """Rows of ``data`` summed by ``segment_ids`` into ``num_segments`` rows, in row order."""
    return _segment_sum(data, segment_ids, num_segments)


def bincount(input: _T, weights: _T | None = None, minlength: int = 0) -> _T:
    """Deterministic ``torch.bincount`` (weighted bins summed in input order; differentiable in weights)."""
    if weights is None:
        return torch.bincount(input, minlength=minlength)  # integer counts: exact in any order
    return _impl.bincount(input, weights, minlength, sum_rows=segment_sum)


@torch.library.custom_op("samestep::moe_combine", mutates_args=())
def _moe_combine(expert_out: _T, token_index: _T, weights: _T, num_tokens: int) -> _T:
    return _impl.moe_combine(expert_out, token_index, weights, num_tokens)


@_moe_combine.register_fake
def _(expert_out, token_index, weights, num_tokens):
    return expert_out.new_empty(num_tokens, expert_out.shape[-1])


def _moe_setup(ctx, inputs, output):
    expert_out, token_index, weights, _ = inputs
    ctx.save_for_backward(expert_out, token_index, weights)


def _moe_bwd(ctx, grad):
    expert_out, token_index, weights = ctx.saved_tensors
    g_rows = grad.index_select(0, token_index)  # (R, D)
    return g_rows * weights.to(g_rows.dtype).unsqueeze(-1), None, (g_rows * expert_out).sum(-1).to(weights.dtype), None


_moe_combine.register_autograd(_moe_bwd, setup_context=_moe_setup)


def moe_combine(expert_out: _T, token_index: _T, weights: _T, num_tokens: int) -> _T:
    """Top-k expert outputs (R, D), weighted and summed back into token order (num_tokens, D).

    ``token_index[r]`` is the token of routed row ``r``; rows are combined in ascending ``r``.
    """
    return _moe_combine(expert_out, token_index, weights, num_tokens)


# Every op and the byte-for-byte tests that guard it (tests/kernels); a test fails when one has none.
_CASE = {"scatter_reduce": "scatter_reduce_mean"}
KERNELS: dict[str, tuple[str, ...]] = {
    op: (
        f"tests/kernels/test_ops.py::test_replays_bit_exact[{_CASE.get(op, op)}]",
        f"tests/kernels/test_ops.py::test_golden_digests[{_CASE.get(op, op)}]",
        f"tests/kernels/test_triton.py::test_triton_matches_cpu_bit_for_bit[{_CASE.get(op, op)}]",
    )
    + {
        "index_add": (
            "tests/kernels/test_ops.py::test_matches_left_fold_reference[index_add]",
            "tests/kernels/test_ops.py::test_more_sources_than_a_tile_follow_the_tile_tree[slots]",
            "tests/kernels/test_ops.py::test_more_sources_than_a_tile_follow_the_tile_tree[compact]",
            "tests/kernels/test_triton.py::test_both_strategies_past_one_tile[slots]",
            "tests/kernels/test_triton.py::test_both_strategies_past_one_tile[sorted]",
        ),
        "scatter_add": ("tests/kernels/test_ops.py::test_matches_left_fold_reference[scatter_add]",),
        "index_put": ("tests/kernels/test_ops.py::test_index_put_is_the_backward_of_indexing",),
        "moe_combine": ("tests/kernels/test_ops.py::test_moe_combine_gradients",),
    }.get(op, ())
    for op in (
        "index_add",
        "scatter_add",
        "scatter_reduce",
        "index_put",
        "embedding_backward",
        "bincount",
        "segment_sum",
        "moe_combine",
    )
}

"""Tensor parallelism in torchtitan's trainer with samestep's canonical styles: torchtitan's own parallelize function
(``ModelSpec.parallelize_fn``: activation checkpointing, compile, its FSDP2 helper) runs as it is, with its
tensor-parallel step (``Module.parallelize``, the model's sharding configs: one matmul a rank and an all-reduce
of the row-parallel partial sums) replaced by PyTorch's ``parallelize_module`` with ``CanonicalColwiseParallel``
and ``CanonicalRowwiseParallel`` over the mesh's ``tp`` dimension (docs/layouts.md, "Tensor parallelism").

The plan, for torchtitan's dense decoders (Llama 3 and its like: ``layers.N.attention`` with a fused ``wqkv``
grouped by kv head or ``wq``/``wk``/``wv``, ``wo``; ``feed_forward.w1``/``w3``/``w2``): the projections in and
the MLP's first layers column-parallel, ``wo`` and ``w2`` row-parallel, each cut into ``chunks`` on every layout,
one process included (the path every degree keeps); the embedding, the norms and the output head stay whole on
each tensor rank, so their gradients are each rank's own whole ones. Activations stay whole between the layers
(no sequence parallelism). A decoder without these modules is refused by name before anything is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["canonical_parallelize_fn", "tensor_parallel_plan", "with_canonical_tp"]


def tensor_parallel_plan(block: nn.Module, chunks: int) -> dict[str, Any]:
    """The canonical styles for one of torchtitan's decoder blocks, by submodule name.

    Raises:
        ValueError: the block lacks the attention or feed-forward projections this plan splits.
    """
    from samestep.distributed import CanonicalColwiseParallel, CanonicalRowwiseParallel

    col, row = CanonicalColwiseParallel(chunks), CanonicalRowwiseParallel(chunks)
    names = dict(block.named_modules())
    plan: dict[str, Any] = {"attention.wo": row, "feed_forward.w1": col, "feed_forward.w3": col, "feed_forward.w2": row}
    fused = names.get("attention.qkv_linear")
    if fused is not None and "attention.qkv_linear.wqkv" in names:
        # torchtitan's FusedQKVLinear: n_kv_heads groups, each its q heads, then k, then v
        groups = fused.wqkv.out_features // (fused.r_dim * fused.head_dim)
        plan["attention.qkv_linear.wqkv"] = CanonicalColwiseParallel(chunks, fused="grouped", groups=groups)
    else:
        plan |= {f"attention.qkv_linear.{w}": col for w in ("wq", "wk", "wv")}
    missing = [name for name in plan if not isinstance(names.get(name), nn.Linear)]
    if missing:
        raise ValueError(
            f"SamestepTrainer: parallelism.tensor_parallel_degree with samestep.tp_chunks splits the "
            f"dense decoders of torchtitan (Llama 3's layout); {type(block).__name__} has no linear "
            f"{missing[0]!r}. Fix: run this model without tensor parallelism"
        )
    return plan


def canonical_parallelize_fn(parallelize_fn: Callable[..., nn.Module], chunks: int) -> Callable[..., nn.Module]:
    """``parallelize_fn`` (torchtitan's, for a model spec) with the canonical plan applied first over the
    ``tp`` mesh (of one rank where tensor parallelism is off) and the model's own tensor-parallel step made a
    no-op, so that torchtitan's function goes on to its activation checkpointing, compile and FSDP2."""
    from torch.distributed.tensor.parallel import parallelize_module

    def parallelize(model: nn.Module, *, parallel_dims: Any, **kwargs: Any) -> nn.Module:
        mesh = parallel_dims.get_optional_mesh("tp", include_singleton_axes=True)
        for block in model.layers.values():
            parallelize_module(block, mesh, tensor_parallel_plan(block, chunks))
        model.parallelize = lambda dims: None  # the sharding configs' TP step: done above, in the canonical styles
        return parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)

    return parallelize


def with_canonical_tp(model_spec: Any, chunks: int) -> Any:
    """``model_spec`` (torchtitan's ``ModelSpec``) whose parallelize function applies the canonical plan."""
    return dataclasses.replace(model_spec, parallelize_fn=canonical_parallelize_fn(model_spec.parallelize_fn, chunks))

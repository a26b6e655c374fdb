"""AdamW whose update runs on each DTensor parameter's local shard: the ops ``torch.optim.AdamW`` runs on a
DTensor, each of which DTensor hands to the shard as it is (an elementwise update, no collective), called on the
shards directly, so the bits are AdamW's and the per-op dispatch through DTensor is gone (about 5 ms of a 120 ms
reference step with ``parallel.tp_chunks=8``, docs/performance.md). The state stays AdamW's, DTensors shaped as
their parameters, so state dicts and checkpoints do not change. It is AdamW's single-tensor update only: the
options that take another (foreach, fused, capturable, differentiable, amsgrad, maximize) are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adam import adam

from samestep.distributed.shards import local_shard

__all__ = ["ShardAdamW"]

# The options under which AdamW's update is its single-tensor loop of elementwise ops on each parameter.
_PLAIN = {
    "foreach": (False, None),
    "fused": (None, False),
    "capturable": (False,),
    "differentiable": (False,),
    "amsgrad": (False,),
    "maximize": (False,),
}


def _refuse_other_updates(options: dict[str, Any], where: str) -> None:
    """Raises ValueError naming the first option in ``options`` that takes another update than AdamW's
    single-tensor one."""
    other = {k: options[k] for k, allowed in _PLAIN.items() if k in options and options[k] not in allowed}
    if other:
        name, value = next(iter(other.items()))
        raise ValueError(
            f"{where}: {name}={value!r} takes another update than AdamW's single-tensor one, which "
            f"ShardAdamW runs. Fix: torch.optim.AdamW for that option"
        )


class ShardAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(..., foreach=False)`` with its update on DTensor parameters' shards (the module's
    docstring): the same arguments, state and bits; a plain tensor parameter is updated as it is."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        _refuse_other_updates(kwargs, "ShardAdamW")
        super().__init__(params, **{**kwargs, "foreach": False})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("ShardAdamW.step(closure): a closure is not taken. Fix: compute the loss before step()")
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for i, group in enumerate(self.param_groups):
            _refuse_other_updates(group, f"ShardAdamW param group {i}")  # one added after construction too
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if not state:  # as AdamW's first step makes it
                    state["step"] = torch.tensor(0.0, dtype=scalar, device="cpu")
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            adam(
                [local_shard(p) for p in params],
                [local_shard(p.grad) for p in params],
                [local_shard(s["exp_avg"]) for s in states],
                [local_shard(s["exp_avg_sq"]) for s in states],
                [],
                [s["step"] for s in states],
                foreach=False,
                capturable=False,
                differentiable=False,
                fused=None,
                grad_scale=None,
                found_inf=None,
                has_complex=any(torch.is_complex(p) for p in params),
                decoupled_weight_decay=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
        return None

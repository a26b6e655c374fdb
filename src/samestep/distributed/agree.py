"""Agreement across ranks: a flag that one rank raised (a stop signal that reached it first) becomes every
rank's, so all of them take the same branch and reach the same collectives."""

from __future__ import annotations

import torch

__all__ = ["any_rank"]


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """Whether ``flag`` is true on any rank of the default process group; every rank gets the same answer.
    ``device``: where the one-element all-reduce runs (default: the current CUDA device under NCCL, else
    the CPU). Without a process group, or with one rank, ``flag`` itself."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
            else torch.device("cpu")
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())

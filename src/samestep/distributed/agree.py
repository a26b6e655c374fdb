"""Agreement across ranks: a flag that one rank raised (a stop signal that reached it first) becomes every
rank's, so all of them take the same branch and reach the same collectives; a digest that should be alike on
every rank is checked so, every rank learning the same answer."""

from __future__ import annotations

import torch

from samestep.distributed.group import rank_and_world

__all__ = ["any_rank", "most_of", "ranks_unlike_rank_0"]


def _device(device: torch.device | None) -> torch.device:
    """Where a small collective of the default process group runs: ``device``, or the current CUDA device under
    NCCL, else the CPU."""
    import torch.distributed as dist

    if device is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def ranks_unlike_rank_0(digest: str, device: torch.device | None = None) -> list[int]:
    """The ranks of the default process group whose ``digest`` (a hex string, the same length on every rank)
    is not rank 0's; every rank gets the same list. Without a process group, or with one rank, none."""
    import torch.distributed as dist

    if rank_and_world()[1] == 1:
        return []
    mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8, device=_device(device))
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [r for r, d in enumerate(every) if not torch.equal(d, every[0])]


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """Whether ``flag`` is true on any rank of the default process group; every rank gets the same answer.
    ``device``: where the one-element all-reduce runs (default: the current CUDA device under NCCL, else
    the CPU). Without a process group, or with one rank, ``flag`` itself."""
    import torch.distributed as dist

    if rank_and_world()[1] == 1:
        return flag
    t = torch.tensor([int(flag)], device=_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def most_of(value: int, device: torch.device | None = None) -> int:
    """The largest ``value`` of any rank of the default process group; every rank gets the same answer (as
    ``any_rank``, of an integer). Without a process group, or with one rank, ``value`` itself."""
    import torch.distributed as dist

    if rank_and_world()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())

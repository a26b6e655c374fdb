"""Whether this process is one of a torch.distributed job, and which: the one place that asks (a process
without a process group is rank 0 of 1)."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["group_up", "rank_and_world"]


def group_up() -> bool:
    """Whether torch.distributed is built in and its default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the default group's size; ``(0, 1)`` without a process group."""
    if group_up():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1

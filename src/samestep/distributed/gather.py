"""Gathering what ranks hold, as bytes, never pickled objects: only when the ranks do not already agree (one
all-gather of a 32-byte digest a rank settles the usual case, and only a disagreement moves the bytes
themselves, so that every rank can name it, reach the same verdict and take the same branch); and named
tensors that each rank of a group holds others of (a model's parts: pipeline stages, experts)."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import torch

from samestep.distributed.group import rank_and_world

__all__ = ["all_gather_bytes", "gather_if_different", "gather_named"]


def all_gather_bytes(data: bytes, world: int, device: torch.device, group: object = None) -> list[bytes]:
    """Every rank's ``data`` (of ``world`` ranks of ``group``), by rank: lengths, then the bytes padded to the
    longest, as uint8 tensors on ``device``. A collective over ``group``."""
    import torch.distributed as dist

    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    mine = torch.zeros(max(int(s.item()) for s in sizes), dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [bytes(o.cpu().numpy()[: int(s.item())]) for o, s in zip(out, sizes)]


def gather_if_different(key: bytes, payload: bytes, device: torch.device | None = None) -> list[bytes] | None:
    """Every rank's ``payload``, by rank, if any rank's ``key`` differs from another's; None when all keys
    are equal, or without a process group of more than one rank. A collective: every rank of the default
    group calls it. ``device``: where the all-gathers run (default: the current CUDA device under NCCL,
    else the CPU)."""
    import torch.distributed as dist

    if rank_and_world()[1] == 1:
        return None
    world = dist.get_world_size()
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        )
    if len(set(all_gather_bytes(hashlib.sha256(key).digest(), world, device))) == 1:
        return None
    return all_gather_bytes(payload, world, device)


def gather_named(local: dict[str, torch.Tensor], group: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """Every rank's ``local`` tensors (each rank of ``group`` holds other names) on every rank, by rank order
    then each rank's own order: its names, dtypes and shapes as JSON, then its tensors' bytes in one buffer
    (never pickled). A collective over ``group``."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    tensors = {k: v.detach().contiguous() for k, v in local.items()}
    meta = json.dumps([[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in tensors.items()]).encode()
    metas = all_gather_bytes(meta, len(ranks), device, group)
    out: dict[str, torch.Tensor] = {}
    for src, blob in zip(ranks, metas):
        entries = json.loads(blob)
        if src == me:
            flat = (
                torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])
                if tensors
                else torch.zeros(0, dtype=torch.uint8, device=device)
            )
        else:
            total = sum(_nbytes(dtype, shape) for _, dtype, shape in entries)
            flat = torch.empty(total, dtype=torch.uint8, device=device)
        if flat.numel():
            dist.broadcast(flat, src=src, group=group)
        offset = 0
        for name, dtype, shape in entries:
            n = _nbytes(dtype, shape)
            out[name] = flat[offset : offset + n].view(_dtype(dtype)).reshape(shape).clone()
            offset += n
    return out


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"gather_named: {name!r} is not a torch dtype")
    return dtype


def _nbytes(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * _dtype(dtype).itemsize

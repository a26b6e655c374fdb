"""The final.json ``samestep.Run`` writes when its loop finishes: the digest of its whole state as one process
holds and names it, the same on any layout, and the state checksum its last receipt holds."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from samestep.distributed.fsdp import whole_tensor
from samestep.distributed.group import rank_and_world
from samestep.hashing.state import persistent_buffers, sha256_tensor, tree_digest
from samestep.records.final import final_doc, write_final
from samestep.records.receipt_state import state_tree

__all__ = ["write_whole_final"]


def write_whole_final(
    run_dir: Path,
    step: int,
    loss: float,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    data_cursor: Any,
    receipts: Any,
    sharded: bool,
) -> None:
    """final.json of the finished run: the digest of its whole state as one process holds and names it (each
    sharded tensor gathered whole in turn, a collective every rank joins; a DDP wrapper's names unwrapped),
    so that runs on any two layouts compare by it (``samestep diff``); with receipts of the whole state, its
    checksum as the last receipt holds it (``samestep receipts verify`` compares the two)."""
    from torch.nn.parallel import DistributedDataParallel

    model = model.module if isinstance(model, DistributedDataParallel) else model
    tree = state_tree(
        step, model, optimizer, buffers=persistent_buffers(model), scheduler=scheduler, data_cursor=data_cursor
    )
    digest = tree_digest(tree, lambda tensors: [sha256_tensor(whole_tensor(t)) for t in tensors], hashlib.sha256)
    rank, world = rank_and_world()
    if rank == 0:
        checksum = None
        if receipts is not None and receipts.path and not sharded:  # the whole state's: its last receipt's
            receipts.wait()
            if receipts.last_step == step and receipts.last_state is not None:
                checksum = {receipts.hash: receipts.last_state}
        write_final(run_dir, final_doc(step, digest, loss, world, checksum, whole=True))

"""The cross-process canonical combine over gloo: same bits as one process, whatever the world size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from samestep.distributed import canonical_sum, combine_across_ranks, ring_allreduce_bytes

pytestmark = pytest.mark.slow
N_MICRO, SIZE = 8, 10_001  # SIZE is not a multiple of any world size: exercises the padding


def _leaves() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(SIZE, generator=g) * torch.exp(torch.randn(SIZE, generator=g) * 6) for _ in range(N_MICRO)]


def _worker(rank: int, world: int, init_file: str, out_dir: str, bucket: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        k = N_MICRO // world
        local = canonical_sum(_leaves()[rank * k:(rank + 1) * k])
        combined, sent = combine_across_ranks(local, world, bucket_elements=bucket)
        plain = local.clone()
        dist.all_reduce(plain)  # PyTorch's path, for the negative control
        np.save(f"{out_dir}/canonical_{rank}.npy", combined.numpy())
        np.save(f"{out_dir}/allreduce_{rank}.npy", plain.numpy())
        np.save(f"{out_dir}/sent_{rank}.npy", np.array([sent]))
    finally:
        dist.destroy_process_group()


def _run(world: int, tmp_path, bucket: int) -> dict[str, list[np.ndarray]]:
    out = tmp_path / f"w{world}"
    out.mkdir()
    mp.spawn(_worker, args=(world, str(tmp_path / f"init{world}"), str(out), bucket), nprocs=world, join=True)
    kinds = ("canonical", "allreduce", "sent")
    return {kind: [np.load(out / f"{kind}_{r}.npy") for r in range(world)] for kind in kinds}


def test_combine_matches_one_process_on_2_and_4_ranks_and_allreduce_does_not(tmp_path):
    """2 and 4 gloo ranks give the 1-process bits on every rank (small buckets: pipelined); plain all-reduce
    gives other bits at 2 vs 4 ranks (negative control). Bytes sent equal a ring all-reduce's, within padding."""
    reference = canonical_sum(_leaves()).numpy().view(np.int32)
    plain = {}
    for world in (2, 4):
        res = _run(world, tmp_path, bucket=3_000)
        for r in range(world):
            assert np.array_equal(res["canonical"][r].view(np.int32), reference), (world, r)
        plain[world] = res["allreduce"][0].view(np.int32)
        ring = ring_allreduce_bytes(SIZE, 4, world)
        assert ring <= int(res["sent"][0][0]) <= ring * 1.05
    assert not np.array_equal(plain[2], plain[4])

"""The canonical combine started during the last microbatch's backward (GradientBuckets), over gloo."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from samestep.distributed import CanonicalGradients
from samestep.distributed.buckets import GradientBuckets
from samestep.distributed.reduce import AllReduceGradients
from tests.support import spawn

pytestmark = pytest.mark.slow
N_MICRO = 8
# Small buckets: the model's 8 parameters fall into several, so buckets start while the backward runs.
BUCKETS = {"first_bucket_elements": 300, "bucket_elements": 700}


class _Net(torch.nn.Module):
    """Three layers and a parameter that only even microbatches use (no gradient in the last one). It comes
    first, so it lies in the last bucket, which waits for the backward's end anyway (for the loss)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.side = torch.nn.Parameter(torch.randn(5, 8, generator=g))
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 24)
        self.c = torch.nn.Linear(24, 8)
        # Only the step's last microbatch uses it: on the last rank it is in that rank's last backward, on the
        # others in none. The last parameter, it lies in the first bucket, which it holds back there.
        self.late = torch.nn.Linear(8, 3, bias=False)
        with torch.no_grad():
            for p in (*self.a.parameters(), *self.b.parameters(), *self.c.parameters(), self.late.weight):
                p.copy_(torch.randn(p.shape, generator=g))

    def loss(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 + i)
        # A wide dynamic range: every bracketing of the microbatch sum gives other bits somewhere.
        x = torch.randn(4, 16, generator=g) * torch.exp(torch.randn(4, 16, generator=g) * 4)
        y = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        loss = y.square().mean()
        if i % 2 == 0:
            loss = loss + (self.side.sum(0) * y.mean(0)).sum()
        if i == N_MICRO - 1:
            loss = loss + self.late(y).mean()
        return loss


def _step(world: int, rank: int, kind: str) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
    """One step's reduced gradients, reduced loss, and the buckets started when each backward returned."""
    net = _Net()
    k = N_MICRO // world
    if kind == "plain":
        grads = AllReduceGradients(net.parameters(), microbatches_per_process=k, world_size=world, rank=rank)
    else:
        grads = CanonicalGradients(
            net.parameters(),
            microbatches_per_process=k,
            world_size=world,
            rank=rank,
            overlap=kind == "overlap",
            **BUCKETS,
        )
    started = []
    for i in grads.microbatches:
        loss = net.loss(i)
        loss.backward()
        started.append(grads.buckets.started if getattr(grads, "buckets", None) is not None else -1)
        if world > 1:  # a collective of the loop's own between backward and accumulate (the recompute check's)
            dist.all_reduce(torch.ones(1))
        grads.accumulate(i, extra=loss.detach())
    extra = grads.reduce()
    return [p.grad.clone() for p in net.parameters()], extra, started


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    report = {}
    for kind in ("overlap", "after", "plain"):
        grads, extra, started = _step(world, rank, kind)
        np.save(f"{out_dir}/{kind}_{rank}.npy", torch.cat([*(g.reshape(-1) for g in grads), extra]).numpy())
        report[kind] = started
    report["buckets"] = len(GradientBuckets(list(_Net().parameters()), world_size=world, **BUCKETS).buckets)
    Path(out_dir, f"started_{rank}.json").write_text(json.dumps(report))


def _run(world: int, tmp_path) -> tuple[dict[str, list[np.ndarray]], list[dict]]:
    out = tmp_path / f"w{world}"
    out.mkdir()
    spawn(_worker, (world, str(tmp_path / f"init{world}"), str(out)), world)
    bits = {
        kind: [np.load(out / f"{kind}_{r}.npy").view(np.int32) for r in range(world)]
        for kind in ("overlap", "after", "plain")
    }
    return bits, [json.loads((out / f"started_{r}.json").read_text()) for r in range(world)]


def test_buckets_started_in_the_backward_give_the_one_process_bits(tmp_path):
    """2 x 4 and 4 x 2 processes x microbatches: on the last rank every bucket but the one that carries the
    loss starts before the last backward returns; on the others a parameter without a gradient there holds
    the first bucket, and so all, back to the backward's end, while the loop runs a collective of its own in
    between. Every rank's gradients and loss have the bits of one process, as they do when the combine
    waits for the backward. Negative control: plain accumulation and all-reduce (DDP's path) on the same
    data give other bits at 2 and 4 processes."""
    grads, extra, _ = _step(1, 0, "after")
    reference = torch.cat([*(g.reshape(-1) for g in grads), extra]).numpy().view(np.int32)
    plain = {}
    for world in (2, 4):
        bits, reports = _run(world, tmp_path)
        for r in range(world):
            assert np.array_equal(bits["overlap"][r], reference), (world, r)
            assert np.array_equal(bits["after"][r], reference), (world, r)
        buckets = reports[0]["buckets"]
        assert buckets >= 3
        k = N_MICRO // world
        assert reports[-1]["overlap"] == [0] * (k - 1) + [buckets - 1]  # started during the last backward
        assert all(rep["overlap"] == [0] * k for rep in reports[:-1])  # held back by the parameter without one
        assert all(rep["after"] == [0] * k for rep in reports)
        plain[world] = bits["plain"][0]
    assert not np.array_equal(plain[2], plain[4])


def _twice_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    for overlap in (False, True):
        net = _Net()
        grads = CanonicalGradients(
            net.parameters(), microbatches_per_process=1, world_size=world, rank=rank, overlap=overlap, **BUCKETS
        )
        try:  # the last (only) microbatch runs backward twice through every parameter
            net.loss(N_MICRO - 1).backward()
            net.loss(N_MICRO - 1).backward()
            grads.accumulate(rank, extra=torch.zeros(1))
            grads.reduce()
            outcome = "reduced"
        except RuntimeError as e:
            outcome = str(e)
        Path(out_dir, f"twice_{overlap}_{rank}.txt").write_text(outcome)


def test_a_second_backward_after_a_bucket_was_sent_is_refused(tmp_path):
    """A loop that runs backward twice through a parameter in its last microbatch would have sent the first
    half of its gradient: with the overlap that is an error naming the parameter and the fix; without it
    (overlap=False) the step reduces."""
    spawn(_twice_worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    for rank in (0, 1):
        assert (tmp_path / f"twice_False_{rank}.txt").read_text() == "reduced"
        message = (tmp_path / f"twice_True_{rank}.txt").read_text()
        assert "accumulated again after its bucket was sent" in message and "overlap=False" in message, message

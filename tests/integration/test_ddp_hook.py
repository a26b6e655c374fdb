"""DDP kept, its reduction canonical (``samestep.distributed.CanonicalDdpHook``): a loop of one's own gives the
bits of one process on 2 and 4 processes, gradient clipping by the canonical norm included."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import samestep
from tests.support import spawn

pytestmark = pytest.mark.slow
MICROBATCHES, STEPS = 8, 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _batch(step: int, i: int) -> torch.Tensor:
    g = samestep.rng.generator(0, step, i, "data")
    return torch.randn(5, 16, generator=g) * torch.exp(torch.randn(5, 16, generator=g) * 3)  # wide range: order shows


def _worker(rank: int, world: int, init: str, out: str, how: str) -> None:
    """STEPS steps of MICROBATCHES global microbatches: ``how`` is "hook" (DDP with the canonical hook, every
    backward reaching it), "paired" (the same, the first of each pair under no_sync(): CanonicalDdpState.
    microbatch), "one" (one process, ``CanonicalGradients``) or "ddp" (DDP's own all-reduce of autograd's
    accumulation)."""
    from torch.nn.parallel import DistributedDataParallel

    from samestep.distributed import CanonicalDdpState, CanonicalGradients, canonical_ddp_hook, clip_grad_norm_

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    with samestep.enable(threads=1):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
        k = MICROBATCHES // world
        if how == "one":
            net, grads = model, CanonicalGradients(model.parameters(), microbatches_per_process=k, world_size=1, rank=0)
            mine = grads.microbatches
        else:
            net = DistributedDataParallel(model)
            if how in ("hook", "paired"):
                state = CanonicalDdpState(microbatches_per_process=k)
                net.register_comm_hook(state, canonical_ddp_hook)
                state.watch(opt)
            mine = range(rank * k, (rank + 1) * k)
        for step in range(STEPS):
            for i in mine:
                with state.microbatch(net, i) if how == "paired" else contextlib.nullcontext():
                    loss = net(_batch(step, i)).square().mean() / MICROBATCHES
                    if how == "ddp":
                        loss = loss * world  # DDP averages over the processes
                    loss.backward()
                if how == "one":
                    grads.accumulate(i)
            if how == "one":
                grads.reduce()
            norm = clip_grad_norm_(list(model.parameters()), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if rank == 0:
            bits = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().view(np.int32)
            np.save(Path(out) / f"{how}_{world}.npy", bits)
            np.save(Path(out) / f"{how}_{world}_norm.npy", norm.reshape(1).numpy().view(np.int32))


def test_ddp_with_the_canonical_hook_gives_one_process_bits_on_2_and_4_processes(tmp_path):
    """DDP with canonical_ddp_hook, the gradients clipped by samestep's canonical norm, on 2 and 4 gloo
    processes, every backward reaching the hook or the first of each pair under no_sync()
    (CanonicalDdpState.microbatch): the parameters and the last gradient norm are one process's
    (CanonicalGradients) to the bit.
    Negative control: DDP's own all-reduce of autograd's accumulation, on 2 processes, gives other bits."""
    for world, how in ((1, "one"), (2, "hook"), (4, "hook"), (2, "paired"), (4, "paired"), (2, "ddp")):
        spawn(_worker, (world, str(tmp_path / f"init_{how}{world}"), str(tmp_path), how), world)
    one = np.load(tmp_path / "one_1.npy")
    for world in (2, 4):
        for how in ("hook", "paired"):
            assert np.array_equal(np.load(tmp_path / f"{how}_{world}.npy"), one), (how, world)
            assert np.array_equal(np.load(tmp_path / f"{how}_{world}_norm.npy"), np.load(tmp_path / "one_1_norm.npy"))
    assert not np.array_equal(np.load(tmp_path / "ddp_2.npy"), one)


def test_the_hook_refuses_a_layout_it_cannot_make_invariant_and_an_update_before_the_last_microbatch():
    """3 microbatches per process over 2 processes is not an aligned layout: refused by name, before any
    training. Over 4 microbatches the state hands the first of each pair back as it is (the next backward
    adds into it), negative zeros after the second, and the canonical sum ((g0 + g1) + (g2 + g3)) at the
    last; an optimizer step before the last microbatch (its gradients would be those zeros) is refused."""
    from samestep.distributed import CanonicalDdpState

    with pytest.raises(ValueError, match="microbatches"):
        CanonicalDdpState(3, world_size=2, rank=0)
    state = CanonicalDdpState(4, world_size=1, rank=0)
    assert list(state.microbatches) == [0, 1, 2, 3]
    w = torch.nn.Parameter(torch.zeros(3))
    g = [
        torch.tensor([1.0, -0.0, 2.0**-30]),
        torch.tensor([1e8, -0.0, 1.0]),
        torch.tensor([-1e8, -0.0, 3.0]),
        torch.tensor([0.5, -0.0, -1.0]),
    ]

    def backward(grad: torch.Tensor) -> torch.Tensor:  # the gradient a view of the bucket's buffer, as in DDP
        buffer = grad.clone()
        return state.reduce_bucket([w], [buffer.view(3)], buffer).wait()

    kept = backward(g[0])
    assert torch.equal(kept.view(torch.int32), g[0].view(torch.int32))  # the first of a pair, as it was
    zeros = backward(kept + g[1])  # what autograd's add leaves in p.grad
    assert torch.equal(zeros.view(torch.int32), torch.full((3,), -0.0).view(torch.int32))
    kept = backward(zeros + g[2])
    assert torch.equal(kept.view(torch.int32), g[2].view(torch.int32))  # -0.0 + x is x, -0.0 kept
    total = backward(kept + g[3])
    want = (g[0] + g[1]) + (g[2] + g[3])
    assert torch.equal(total.view(torch.int32), want.view(torch.int32))
    assert not torch.equal(total, ((g[0] + g[1]) + g[2]) + g[3])  # control: plain accumulation's bits differ
    opt = torch.optim.SGD([w], lr=0.1)
    state.watch(opt)
    w.grad = torch.zeros(3)
    opt.step()  # between steps: nothing pending
    backward(g[0])
    with pytest.raises(RuntimeError, match="stepped after 1 of the 4 microbatches"):
        opt.step()

    # the first of a pair run under no_sync() (CanonicalDdpState.microbatch): an update right after it is refused
    class NoSync:
        def no_sync(self) -> contextlib.AbstractContextManager:
            return contextlib.nullcontext()

    paired = CanonicalDdpState(2, world_size=1, rank=0)
    opt = torch.optim.SGD([w], lr=0.1)
    paired.watch(opt)
    with paired.microbatch(NoSync(), 0):
        pass
    with pytest.raises(RuntimeError, match="stepped after 1 of the 2 microbatches"):
        opt.step()
    with pytest.raises(ValueError, match="owns 0..1"), paired.microbatch(NoSync(), 2):
        pass

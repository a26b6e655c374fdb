"""A loop of one's own on any number of processes, with DDP or FSDP2, and the same bits on each (docs/api.md):

    python examples/parallel_loop.py runs/one                                               # 1 process
    torchrun --standalone --nproc_per_node 2 examples/parallel_loop.py runs/ddp --layout ddp
    torchrun --standalone --nproc_per_node 2 examples/parallel_loop.py runs/fsdp --layout fsdp

Each prints the digest of the final parameters: the same line for all three. DDP keeps its wrapper and
reduces through samestep's communication hook; FSDP2 reduce-scatters through samestep's; both clip by the
canonical norm, and samestep.Run checkpoints (each FSDP2 rank its own shards), traces and resumes.
"""

import argparse
import contextlib
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import samestep
from samestep.distributed import (
    CanonicalDdpState,
    FsdpGradients,
    canonical_ddp_hook,
    clip_grad_norm_,
    full_state,
)

MICROBATCHES, STEPS = 8, 6  # global microbatches a step: each process takes MICROBATCHES / processes of them


def batch(step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pure function of where the run stands: any process draws any microbatch's data."""
    g = samestep.rng.generator(0, step, microbatch, "data")
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def main(run_dir: Path, layout: str) -> str:
    world, rank = dist.get_world_size(), dist.get_rank()
    k = MICROBATCHES // world
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        grads = FsdpGradients(model, microbatches_per_process=k, world_size=world, rank=rank)
        net = model
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
        ddp = CanonicalDdpState(microbatches_per_process=k)
        net.register_comm_hook(ddp, canonical_ddp_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if layout == "ddp":
        ddp.watch(optimizer)  # an update before this process's last microbatch is refused
    mine = range(rank * k, (rank + 1) * k)  # this process's global microbatch indices
    with samestep.Run(run_dir, model=net, optimizer=optimizer) as run:
        for step in run.steps(STEPS):
            for i in mine:
                # DDP: the first of each microbatch pair under no_sync(), which changes no bit and saves its copies
                with run.microbatch(i), ddp.microbatch(net, i) if layout == "ddp" else contextlib.nullcontext():
                    x, y = batch(step, i)
                    # a sum over the global batch, normalised by its size: no process count in it
                    loss = torch.nn.functional.mse_loss(net(x), y) / MICROBATCHES
                    loss.backward()
                if layout == "fsdp":
                    grads.accumulate(i, extra=loss.detach())
            if layout == "fsdp":
                run.metric("loss", grads.reduce()[0])
            clip_grad_norm_(list(model.parameters()), 1.0)  # the canonical norm: the same on any layout
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    params = full_state(model)[0]  # every process: a sharded model's parameters gathered
    return samestep.digest(torch.cat([t.reshape(-1) for t in params.values()]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--layout", choices=("ddp", "fsdp"), default="ddp")
    args = parser.parse_args()
    if "RANK" in os.environ:  # torchrun's processes
        dist.init_process_group("gloo")
    else:  # one process, without a launcher
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    try:
        digest = main(args.run_dir, args.layout)
        if dist.get_rank() == 0:
            print(digest)
    finally:
        dist.destroy_process_group()

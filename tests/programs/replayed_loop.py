"""A training loop of one's own through samestep.Run, run as a program (python or torchrun) by the replay tests:
a token lookup by indexing (its backward an index_put with accumulation, which races at 2 threads once a
microbatch has 32k gradient elements) and a linear head, 2 global microbatches a step.

    python replayed_loop.py RUN_DIR [--steps N] [--nondeterministic] [--perturb SPEC --trace-steps S]
        [--plant-step S] [--sleep SECONDS]
    torchrun --standalone --nproc_per_node 2 replayed_loop.py RUN_DIR ...   # DDP, the canonical reduction

It prints the final parameters' digest (rank 0 alone: two ranks writing one pipe can interleave their lines).
"""

import argparse
import contextlib
import os
import time

import torch
import torch.nn.functional as F

import samestep
from samestep.distributed import CanonicalGradients

VOCAB, WIDTH, TOKENS = 512, 64, 1024  # a microbatch: 1024 tokens x 64 = 65,536 lookup gradient elements


class Lookup(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(VOCAB, WIDTH) * 0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.weight[idx]  # (tokens, WIDTH); backward: index_put_(accumulate=True)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Lookup()
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.embed(idx[:-1])), idx[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nondeterministic", action="store_true", help="PyTorch's defaults, 2 threads: the lookup races")
    ap.add_argument("--perturb", help="Run(perturb=...): one ULP planted in an op's output")
    ap.add_argument("--trace-steps", help="the steps traced at op level (where --perturb plants)")
    ap.add_argument("--plant-step", type=int, help="one ULP added to a head weight after that step's update")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds each step waits (a replay that is still running)")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    if args.nondeterministic:
        torch.set_num_threads(2)
    torch.manual_seed(0)
    model = Model()
    grads = CanonicalGradients(model.parameters(), microbatches_per_process=2 // world, world_size=world, rank=rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrapped = DistributedDataParallel(model) if world > 1 else model  # its own all-reduce left out: no_sync
    traced = {"level": "op", "trace_steps": args.trace_steps} if args.trace_steps else {}
    with samestep.Run(
        args.run_dir,
        model=wrapped,
        optimizer=opt,
        deterministic=not args.nondeterministic,
        threads=1,
        perturb=args.perturb,
        **traced,
    ) as run:
        for step in run.steps(args.steps):
            time.sleep(args.sleep)
            for i in grads.microbatches:
                with run.microbatch(i), wrapped.no_sync() if world > 1 else contextlib.nullcontext():
                    idx = torch.randint(0, VOCAB, (TOKENS + 1,), generator=samestep.rng.generator(0, step, i, "data"))
                    loss = wrapped(idx) / 2
                    loss.backward()
                grads.accumulate(i, extra=loss.detach())
            run.metric("loss", grads.reduce()[0])
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == args.plant_step:
                with torch.no_grad():
                    model.head.weight.view(-1).view(torch.int32)[0] += 1
    if rank == 0:
        print(samestep.digest(torch.cat([p.detach().reshape(-1) for p in model.parameters()])))


if __name__ == "__main__":
    main()

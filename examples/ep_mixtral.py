"""A model samestep did not write (a transformers Mixtral built from its config, 4 experts, top 2), its experts
spread over the data ranks by ``samestep.distributed.parallelize_experts``, in a loop of one's own under
``samestep.Run``: the bits of the model's own call on 1 process at EP 2 and EP 4, and a run killed at one
degree resumed at another (docs/layouts.md, "Expert parallelism in a loop of one's own"):

    python examples/ep_mixtral.py runs/ep1                                             # 1 process
    torchrun --standalone --nproc_per_node 2 examples/ep_mixtral.py runs/ep2           # EP 2: the same digest
    torchrun --standalone --nproc_per_node 2 examples/ep_mixtral.py runs/k --kill-after 2
    python examples/ep_mixtral.py runs/k                                               # resumed on 1: the same
    samestep diff runs/ep1 runs/k                                                      # identical

Each prints the digest of the final parameters, gathered whole. Every rank trains its own microbatches of the
step; an expert's owner runs it on each rank's rows apart and sums its gradient over the ranks' microbatches
in one process's order, and ``CanonicalGradients`` sums the other parameters' in the same order. ``--plain``
is the usual way instead, the control: autograd adds each expert's gradient over the ranks' rows as they come,
and the other gradients are summed as DDP sums them (each rank's microbatches in turn, then an all-reduce):
another digest than on 1 process. ``--experts eager``: transformers' eager experts loop instead of its default
grouped_mm one, whose order the spread experts keep as well. Every random draw here is keyed by step
and microbatch, so the run declares ``rng="keyed"`` and resumes on any number of processes.
"""

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import samestep

STEPS, MICROBATCHES = 4, 8


def batch(step: int, microbatch: int) -> torch.Tensor:
    """Token ids, a pure function of where the run stands."""
    return torch.randint(0, 256, (1, 32), generator=samestep.rng.generator(0, step, microbatch, "data"))


def build(plain: bool, implementation: str) -> tuple[torch.nn.Module, object]:
    """The Mixtral, its experts run by transformers' ``implementation``; on several processes its experts
    spread over them (the spread, or None on one)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from samestep.distributed import parallelize_experts

    torch.manual_seed(0)
    model = MixtralForCausalLM(
        MixtralConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            experts_implementation=implementation,
        )
    )
    world = dist.get_world_size()
    if world == 1:
        return model, None
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    return model, parallelize_experts(
        model, MixtralExperts, mesh, microbatches_per_process=MICROBATCHES // world, canonical=not plain
    )


def train(
    run_dir: Path,
    plain: bool = False,
    implementation: str = "grouped_mm",
    kill_after: int | None = None,
    **run_options: object,
) -> str:
    """The loop; the digest of the final parameters. ``kill_after``: every process dies (as a preempted job
    would) as the step after this one begins, its checkpoint committed."""
    from samestep.distributed import CanonicalGradients, clip_grad_norm_, full_state

    model, experts = build(plain, implementation)
    world, rank = dist.get_world_size(), dist.get_rank()
    k = MICROBATCHES // world
    others = experts.other_parameters(model) if experts is not None else list(model.parameters())
    grads = None if plain else CanonicalGradients(others, microbatches_per_process=k, world_size=world, rank=rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    with samestep.Run(run_dir, model=model, optimizer=optimizer, **run_options) as run:
        for step in run.steps(STEPS):
            if step == (kill_after or -1) + 1:
                os._exit(9)
            losses = []
            for i in range(rank * k, (rank + 1) * k):
                with run.microbatch(i):
                    ids = batch(step, i)
                    loss = model(input_ids=ids, labels=ids).loss / MICROBATCHES
                    loss.backward()
                if experts is not None:
                    experts.accumulate()
                if grads is not None:
                    grads.accumulate(i, extra=loss.detach())
                losses.append(loss.detach())
            if experts is not None:
                experts.reduce()
            if grads is not None:  # the step's loss, summed over every microbatch of every rank in one order
                run.metric("loss", grads.reduce()[0])
            else:  # DDP's: each rank's microbatches in turn, then an all-reduce
                total = torch.stack(losses).sum()
                for t in [total] + [p.grad for p in others if p.grad is not None]:
                    dist.all_reduce(t)
                run.metric("loss", total)
            if not plain:
                run.metric("grad_norm", clip_grad_norm_(list(model.parameters()), 1.0))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    params = full_state(model)[0]  # every process: the spread experts gathered whole
    return samestep.digest(torch.cat([t.reshape(-1) for t in params.values()]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--plain", action="store_true", help="the usual sums, the control")
    parser.add_argument(
        "--experts",
        choices=("grouped_mm", "eager"),
        default="grouped_mm",
        help="transformers' experts implementation (its default: grouped_mm)",
    )
    parser.add_argument("--kill-after", type=int, metavar="STEP", help="die as the step after STEP begins")
    args = parser.parse_args()
    if "RANK" in os.environ:  # torchrun's processes
        dist.init_process_group("gloo")
    else:  # one process, without a launcher
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    try:
        digest = train(args.run_dir, args.plain, args.experts, args.kill_after, rng="keyed")
        if dist.get_rank() == 0:
            print(digest)
    finally:
        dist.destroy_process_group()

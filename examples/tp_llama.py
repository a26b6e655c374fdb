"""A model samestep did not write (a transformers Llama built from its config), tensor-parallel through PyTorch's
own ``parallelize_module`` with samestep's canonical styles, in a loop of one's own under ``samestep.Run``: the
same bits on 1 process and at TP 2 or 4, a run killed at one degree resumed at another (docs/layouts.md):

    python examples/tp_llama.py runs/tp1                                               # 1 process
    torchrun --standalone --nproc_per_node 2 examples/tp_llama.py runs/tp2             # TP 2: the same digest
    torchrun --standalone --nproc_per_node 2 examples/tp_llama.py runs/k --kill-after 2
    torchrun --standalone --nproc_per_node 4 examples/tp_llama.py runs/k               # resumed at TP 4: the same
    samestep diff runs/tp1 runs/k                                                      # identical

Each prints the digest of the final parameters, gathered whole. ``--styles pytorch`` takes PyTorch's own
ColwiseParallel and RowwiseParallel instead (each rank one matmul over its shard, the row-parallel sum an
all-reduce): another digest at TP 2 than on 1 process. Every random draw here is keyed by step and microbatch
(``samestep.rng.generator``), so the run declares ``rng="keyed"`` and resumes on any number of processes.
"""

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import samestep

STEPS, MICROBATCHES, CHUNKS = 4, 2, 8  # CHUNKS: the fixed cut of every split dimension, which each degree divides


def batch(step: int, microbatch: int) -> torch.Tensor:
    """Token ids, a pure function of where the run stands."""
    return torch.randint(0, 256, (2, 32), generator=samestep.rng.generator(0, step, microbatch, "data"))


def build(styles: str) -> torch.nn.Module:
    """The Llama, its attention and MLP projections split over every process (one tensor-parallel group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    from samestep.distributed import CanonicalColwiseParallel, CanonicalRowwiseParallel

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    if styles == "pytorch" and dist.get_world_size() == 1:
        return model  # PyTorch's styles on one process: the plain model
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    col, row = ((CanonicalColwiseParallel(CHUNKS), CanonicalRowwiseParallel(CHUNKS)) if styles == "samestep"
                else (ColwiseParallel(), RowwiseParallel()))
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {"self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col,
                                         "self_attn.o_proj": row, "mlp.gate_proj": col, "mlp.up_proj": col,
                                         "mlp.down_proj": row})
    return model


def train(run_dir: Path, styles: str = "samestep", kill_after: int | None = None, **run_options: object) -> str:
    """The loop; the digest of the final parameters. ``kill_after``: every process dies (as a preempted job
    would) as the step after this one begins, its checkpoint committed. ``run_options``: ``samestep.Run``'s."""
    from samestep.distributed import clip_grad_norm_, full_state

    model = build(styles)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    with samestep.Run(run_dir, model=model, optimizer=optimizer, **run_options) as run:
        for step in run.steps(STEPS):
            if step == (kill_after or -1) + 1:
                os._exit(9)
            for i in range(MICROBATCHES):  # each rank takes every microbatch: one data rank, split tensors
                with run.microbatch(i):
                    ids = batch(step, i)
                    loss = model(input_ids=ids, labels=ids).loss / MICROBATCHES
                    loss.backward()
            run.metric("loss", loss)
            if styles == "samestep":  # its norm sums the shards in one order at every degree
                run.metric("grad_norm", clip_grad_norm_(list(model.parameters()), 1.0))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    params = full_state(model)[0]  # every process: the split parameters gathered whole
    return samestep.digest(torch.cat([t.reshape(-1) for t in params.values()]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--styles", choices=("samestep", "pytorch"), default="samestep")
    parser.add_argument("--kill-after", type=int, metavar="STEP", help="die as the step after STEP begins")
    parser.add_argument("--rng", choices=("keyed", "restore"), default="keyed",
                        help="samestep.Run(rng=): 'restore' refuses a resume on another number of processes")
    parser.add_argument("--trace-op", metavar="STEPS", help="trace these steps at op level (for diff and bisect)")
    parser.add_argument("--perturb", metavar="SPEC", help="plant one ULP (samestep.Run(perturb=)), to try diff")
    args = parser.parse_args()
    if "RANK" in os.environ:  # torchrun's processes
        dist.init_process_group("gloo")
    else:  # one process, without a launcher
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    options: dict = {"rng": args.rng, "perturb": args.perturb}
    if args.trace_op:
        options |= {"level": "op", "trace_steps": args.trace_op}
    try:
        digest = train(args.run_dir, args.styles, args.kill_after, **options)
        if dist.get_rank() == 0:
            print(digest)
    finally:
        dist.destroy_process_group()

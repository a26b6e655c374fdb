"""A model samestep did not write (a transformers Llama built from its config), tensor-parallel through PyTorch's
own ``parallelize_module`` with samestep's canonical styles, in a loop of one's own under ``samestep.Run``: the
same bits on 1 process, at TP 2 or 4 and with FSDP2 over TP, a run killed at one degree resumed at another
(docs/layouts.md):

    python examples/tp_llama.py runs/tp1                                               # 1 process
    torchrun --standalone --nproc_per_node 2 examples/tp_llama.py runs/tp2             # TP 2: the same digest
    torchrun --standalone --nproc_per_node 4 examples/tp_llama.py runs/2x2 --dp 2      # FSDP2 2 x TP 2: the same
    torchrun --standalone --nproc_per_node 2 examples/tp_llama.py runs/k --kill-after 2
    torchrun --standalone --nproc_per_node 4 examples/tp_llama.py runs/k               # resumed at TP 4: the same
    samestep diff runs/tp1 runs/k                                                      # identical

Each prints the digest of the final parameters, gathered whole. ``--dp D``: the processes are a D x (N / D)
mesh of data ranks by tensor ranks, each decoder layer FSDP2-sharded over the data ranks, which take the
step's microbatches in D parts; their gradients are summed by ``FsdpGradients`` in the order one process sums
them (``CanonicalGradients``). ``--styles pytorch`` takes PyTorch's own ColwiseParallel and RowwiseParallel
instead (each rank one matmul over its shard, the row-parallel sum an all-reduce) and FSDP2's own
reduce-scatter: another digest than on 1 process. Every random draw here is keyed by step and microbatch
(``samestep.rng.generator``), so the run declares ``rng="keyed"`` and resumes on any number of processes.
"""

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import samestep

STEPS, MICROBATCHES, CHUNKS = 4, 4, 8  # CHUNKS: the fixed cut of every split dimension, which each degree divides


def batch(step: int, microbatch: int) -> torch.Tensor:
    """Token ids, a pure function of where the run stands."""
    return torch.randint(0, 256, (1, 32), generator=samestep.rng.generator(0, step, microbatch, "data"))


def build(styles: str, dp: int | None) -> torch.nn.Module:
    """The Llama, its attention and MLP projections split over the tensor ranks; with ``dp``, each decoder layer
    (and the root: embeddings, norm, head) FSDP2-sharded over the data ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from samestep.distributed import CanonicalColwiseParallel, CanonicalRowwiseParallel, shard_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
        )
    )
    if styles == "pytorch" and dist.get_world_size() == 1:
        return model  # PyTorch's styles on one process: the plain model
    world = dist.get_world_size()
    if dp is None:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    else:
        grid = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
        mesh = grid["tp"]
    col, row = (
        (CanonicalColwiseParallel(CHUNKS), CanonicalRowwiseParallel(CHUNKS))
        if styles == "samestep"
        else (ColwiseParallel(), RowwiseParallel())
    )
    for layer in model.model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                "self_attn.q_proj": col,
                "self_attn.k_proj": col,
                "self_attn.v_proj": col,
                "self_attn.o_proj": row,
                "mlp.gate_proj": col,
                "mlp.up_proj": col,
                "mlp.down_proj": row,
            },
        )
    if dp is not None:
        shard_model(model, dp, mesh=grid["dp"], blocks=LlamaDecoderLayer)
    return model


def data_rank(model: torch.nn.Module) -> tuple[int, object]:
    """This process's index among the data ranks and their process group (0 and None without FSDP2)."""
    mesh = getattr(next(model.parameters()), "device_mesh", None)  # the embedding's: FSDP2's mesh where it shards
    if mesh is None or "dp" not in (mesh.mesh_dim_names or ()):
        return 0, None
    return mesh.get_local_rank("dp"), mesh.get_group("dp")


def gradients(model: torch.nn.Module, styles: str, dp: int | None) -> object:
    """What sums the microbatches' gradients: samestep's canonical order (over the data ranks' FSDP2 groups
    with ``dp``), or, for PyTorch's styles, autograd's and FSDP2's own (None)."""
    from samestep.distributed import CanonicalGradients, FsdpGradients

    if styles == "pytorch":
        return None
    if dp is None:
        return CanonicalGradients(model.parameters(), microbatches_per_process=MICROBATCHES)
    rank, group = data_rank(model)
    return FsdpGradients(model, microbatches_per_process=MICROBATCHES // dp, world_size=dp, rank=rank, group=group)


def train(
    run_dir: Path, styles: str = "samestep", dp: int | None = None, kill_after: int | None = None, **run_options: object
) -> str:
    """The loop; the digest of the final parameters. ``kill_after``: every process dies (as a preempted job
    would) as the step after this one begins, its checkpoint committed. ``run_options``: ``samestep.Run``'s."""
    from samestep.distributed import clip_grad_norm_, full_state

    model = build(styles, dp)
    grads = gradients(model, styles, dp)
    rank, group = data_rank(model)
    k = MICROBATCHES // (dp or 1)
    mine = range(rank * k, (rank + 1) * k)  # this data rank's part of the step; its tensor ranks take the same
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    with samestep.Run(run_dir, model=model, optimizer=optimizer, **run_options) as run:
        for step in run.steps(STEPS):
            if step == (kill_after or -1) + 1:
                os._exit(9)
            losses = []
            for i in mine:
                with run.microbatch(i):
                    ids = batch(step, i)
                    loss = model(input_ids=ids, labels=ids).loss / MICROBATCHES
                    loss.backward()
                if grads is not None:
                    grads.accumulate(i, extra=loss.detach())
                losses.append(loss.detach())
            if grads is not None:  # the step's loss, summed over every microbatch of every data rank in one order
                run.metric("loss", grads.reduce()[0])
            else:  # PyTorch's: this data rank's sum, all-reduced
                total = torch.stack(losses).sum()
                if group is not None:
                    dist.all_reduce(total, group=group)
                run.metric("loss", total)
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
    parser.add_argument("--dp", type=int, metavar="D", help="D data ranks (FSDP2) by N / D tensor ranks")
    parser.add_argument("--kill-after", type=int, metavar="STEP", help="die as the step after STEP begins")
    parser.add_argument(
        "--rng",
        choices=("keyed", "restore"),
        default="keyed",
        help="samestep.Run(rng=): 'restore' refuses a resume on another number of processes",
    )
    parser.add_argument("--trace-op", metavar="STEPS", help="trace these steps at op level (for diff and bisect)")
    parser.add_argument("--perturb", metavar="SPEC", help="plant one ULP (samestep.Run(perturb=)), to try diff")
    args = parser.parse_args()
    if args.dp is not None and (int(os.environ.get("WORLD_SIZE", 1)) % args.dp or MICROBATCHES % args.dp):
        parser.error(
            f"--dp {args.dp}: must divide the process count ({os.environ.get('WORLD_SIZE', 1)}) and "
            f"the {MICROBATCHES} microbatches; pass a divisor of both"
        )
    if "RANK" in os.environ:  # torchrun's processes
        dist.init_process_group("gloo")
    else:  # one process, without a launcher
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    options: dict = {"rng": args.rng, "perturb": args.perturb}
    if args.trace_op:
        options |= {"level": "op", "trace_steps": args.trace_op}
    try:
        digest = train(args.run_dir, args.styles, args.dp, args.kill_after, **options)
        if dist.get_rank() == 0:
            print(digest)
    finally:
        dist.destroy_process_group()

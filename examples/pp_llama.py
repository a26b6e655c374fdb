"""A model samestep did not write (a transformers Llama built from its config) cut into pipeline stages that
PyTorch's ``torch.distributed.pipelining`` runs, in a loop of one's own: the same bits on 1 process, at PP 2 and
at PP 2 x DP 2 (docs/layouts.md, "Pipeline parallelism"):

    python examples/pp_llama.py                                               # 1 process
    torchrun --standalone --nproc_per_node 2 examples/pp_llama.py             # 2 stages: the same digest
    torchrun --standalone --nproc_per_node 4 examples/pp_llama.py --dp 2      # 2 data ranks of 2 stages: the same

Each prints the digest of the final parameters, in one process's order, and the last step's loss bits. A
stage's gradients are summed over the microbatches (and its data ranks) by ``CanonicalGradients`` in the order
one process sums them (``samestep.distributed.canonical_stage``), the loss comes from the last stage, and the
gradient norm adds the stages' rows in one process's order (``clip_grad_norm_(..., over=pipe_group)``).
``--plain`` is PyTorch's own: pipelining's ``PipelineStage`` adds each microbatch's gradients into ``p.grad``
as it comes, the data ranks all-reduce them, and the norm is the stages' norms combined: another digest at
PP 2 x DP 2 than on 1 process.
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

import samestep

STEPS, MICROBATCHES, SEQ, VOCAB, WIDTH = 3, 4, 32, 256, 64


def batch(step: int, microbatch: int) -> torch.Tensor:
    """Token ids, a pure function of where the run stands."""
    return torch.randint(0, VOCAB, (1, SEQ), generator=samestep.rng.generator(0, step, microbatch, "data"))


class Stage(torch.nn.Module):
    """Decoder layers ``layers`` of the Llama, with its embedding on the first stage and its norm and head on the
    last: the pieces of ``LlamaModel.forward``, called as it calls them (one stage holding every layer is the
    whole model)."""

    def __init__(self, model: torch.nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        inner = model.model
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = torch.nn.ModuleList(inner.layers[i] for i in layers)
        self.rotary_emb = inner.rotary_emb
        self.norm, self.lm_head = (inner.norm, model.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = self.rotary_emb(h, positions)
        for layer in self.layers:  # no mask: scaled_dot_product_attention's causal path, as LlamaModel takes it
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        return self.lm_head(self.norm(h)) if self.lm_head is not None else h


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=SEQ,
            attn_implementation="sdpa",
        )
    )


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss of a microbatch (its mean over the microbatch's tokens), over the step's
    microbatches: their sum is the step's mean, one process's normalisation on every layout."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, ids, VOCAB) / MICROBATCHES


def train(dp: int, plain: bool) -> tuple[str, str]:
    """The loop; the digest of the final parameters and the last step's loss bits."""
    from torch.distributed.device_mesh import init_device_mesh

    from samestep.distributed import CanonicalGradients, broadcast_from, clip_grad_norm_

    world = dist.get_world_size()
    pp = world // dp
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    data, stage = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    data_group, pipe_group = (mesh.get_group("dp") if dp > 1 else None), mesh.get_group("pp")
    model = llama()  # every rank builds the whole model (one draw), then keeps its stage
    part = model if pp == 1 else Stage(model, range(stage, stage + 1), stage == 0, stage == pp - 1)
    params = list(part.parameters())
    k = MICROBATCHES // dp
    mine = range(data * k, (data + 1) * k)  # this data rank's microbatches
    grads = (
        None
        if plain
        else CanonicalGradients(params, microbatches_per_process=k, world_size=dp, rank=data, group=data_group)
    )
    schedule = None if pp == 1 else pipeline(part, stage, pp, pipe_group, grads, k)
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    for step in range(1, STEPS + 1):
        losses: list[torch.Tensor] = []
        if schedule is None:  # one stage: the model's own call, microbatch after microbatch
            for i in mine:
                ids = batch(step, i)
                loss = loss_of(model(input_ids=ids).logits, ids)
                loss.backward()
                if grads is not None:
                    grads.accumulate(i, extra=loss.detach())
                losses.append(loss.detach())
        else:
            ids = torch.cat([batch(step, i) for i in mine])
            if stage == 0:
                schedule.step(ids)
            else:
                schedule.step(target=ids, losses=losses)
        last = stage == pp - 1
        if plain:  # PyTorch's own: the data ranks' all-reduce, the norm of the stages' norms
            if data_group is not None:
                for p in params:
                    dist.all_reduce(p.grad, group=data_group)
            norm = torch.nn.utils.get_total_norm([p.grad for p in params]).square()
            dist.all_reduce(norm, group=pipe_group)
            torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm.sqrt())
            loss = torch.stack(losses).sum().reshape(1) if last else torch.zeros(1)
            if data_group is not None:
                dist.all_reduce(loss, group=data_group)
        else:
            loss = grads.reduce()  # the last stage's: the step's loss summed along the canonical tree
            clip_grad_norm_(params, 1.0, over=pipe_group)  # the stages' rows in one process's order
        loss = broadcast_from(loss if last else torch.zeros(1), int(mesh["pp"].mesh[-1]), pipe_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return digest_of(params, pipe_group, pp), float(loss).hex()


def pipeline(part: torch.nn.Module, stage: int, pp: int, pipe_group: object, grads: object, k: int) -> object:
    """pipelining's GPipe schedule over this rank's stage: samestep's ``canonical_stage``, or (``grads`` None)
    PyTorch's own ``PipelineStage``."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from samestep.distributed import canonical_stage

    meta, first, last = torch.device("meta"), stage == 0, stage == pp - 1
    inputs = (
        torch.empty(1, SEQ, dtype=torch.int64, device=meta)
        if first
        else torch.empty(1, SEQ, WIDTH, device=meta, requires_grad=True),
    )
    outputs = (torch.empty(1, SEQ, VOCAB if last else WIDTH, device=meta, requires_grad=True),)
    cpu = torch.device("cpu")
    runner = (
        PipelineStage(part, stage, pp, cpu, inputs, outputs, group=pipe_group)
        if grads is None
        else canonical_stage(
            part, stage, pp, cpu, grads=grads, group=pipe_group, input_args=inputs, output_args=outputs
        )
    )
    return ScheduleGPipe(runner, n_microbatches=k, loss_fn=loss_of, scale_grads=False)


def digest_of(params: list[torch.Tensor], pipe_group: object, pp: int) -> str:
    """The digest of every stage's parameters, in one process's order (stage after stage)."""
    mine = torch.cat([p.detach().reshape(-1) for p in params])
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(pp)]
    dist.all_gather(sizes, torch.tensor([mine.numel()]), group=pipe_group)
    longest = int(max(sizes))  # gloo gathers tensors of one size: each padded to the longest, then cut back
    every = [torch.empty(longest) for _ in sizes]
    dist.all_gather(every, torch.cat([mine, mine.new_zeros(longest - mine.numel())]), group=pipe_group)
    return samestep.digest(torch.cat([t[: int(n)] for t, n in zip(every, sizes)]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=1, metavar="D", help="D data ranks of N / D stages each")
    parser.add_argument("--plain", action="store_true", help="PyTorch's own accumulation, all-reduce and norm")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world % args.dp or MICROBATCHES % args.dp or world // args.dp not in (1, 2):
        parser.error(
            f"--dp {args.dp} on {world} process(es): 1 or 2 stages of --dp data ranks each, --dp dividing "
            f"the {MICROBATCHES} microbatches"
        )
    if "RANK" in os.environ:  # torchrun's processes
        dist.init_process_group("gloo")
    else:  # one process, without a launcher
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    samestep.enable(threads=1)
    try:
        digest, loss = train(args.dp, args.plain)
        if dist.get_rank() == 0:
            print(digest, loss)
    finally:
        dist.destroy_process_group()

"""Layout benchmark: canonical reduction vs PyTorch DDP's all-reduce (or, with --fsdp, the canonical
FSDP2 reduce-scatter vs FSDP2's own), 2 processes, side by side.

    .venv/bin/torchrun --standalone --nproc_per_node 2 bench/bench_layout.py [--fsdp|--tp [--block]|--pp|--ep]
        [--pairs 60]

The variants run the reference config's step in the same processes, in turn (so machine noise hits
them alike): the canonical variant is the reference run's own step (samestep.enable +
CanonicalGradients, its combine started bucket by bucket in the last microbatch's backward); the DDP
variant wraps the same model in DistributedDataParallel, skips the all-reduce with no_sync() on all but
the last microbatch (the usual gradient-accumulation idiom), and lets DDP's bucketed,
backward-overlapped all-reduce run; a third is the canonical step with the combine after the whole
backward (parallel.overlap=false); a fourth keeps DDP with samestep's communication hook
(``canonical_ddp_hook``, the first of each microbatch pair under no_sync() by ``CanonicalDdpState.microbatch``)
and clips by the canonical norm, what a loop of one's own that keeps DDP runs. Reported on rank 0: the medians
of per-pair step-time ratios to DDP, and bytes sent per process per step (by collective semantics) against a
ring all-reduce of the same gradient. With --fsdp both variants are the reference run's step with
parallel.fsdp=true: deterministic mode on (distributed/fsdp.py's reduce-scatter) against off (FSDP2's
own reduce-scatter of every microbatch), bytes against a ring reduce-scatter of the same gradient.
With --tp the processes are one tensor-parallel group running the reference run's step (``--preset``, ``--set``)
with parallel.tp_chunks against the same step with the decoder blocks' linear layers under PyTorch's
ColwiseParallel/RowwiseParallel (``stock_apply_tp``); with --tp --block, one decoder block (``TpBlock``) under
samestep's CanonicalColwiseParallel/CanonicalRowwiseParallel against PyTorch's styles.
With --pp every process is one pipeline stage of the reference run (``--set`` adds settings): the stages'
canonical tree against pipelining's own accumulation, deterministic mode on in both, and the bytes each sends.
With --ep a Llama MoE's experts spread over every process: each expert's canonical tree against the usual
expert parallelism (gradients accumulated as they arrive, the combine an accumulating index_put_).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import samestep
from samestep.determinism import rng
from samestep.distributed import CanonicalDdpState, canonical_ddp_hook, clip_grad_norm_
from samestep.distributed.reduce import ring_allreduce_bytes
from samestep.loop.data import load_corpus
from samestep.train import load_config
from samestep.train.loop import build


def ddp_step(parts, ddp: DDP, step: int, hooked: CanonicalDdpState | None = None) -> None:
    """One step the way a DDP user writes it: no_sync() for all but the last microbatch; ``hooked``: the
    canonical hook's state, whose ``microbatch`` runs the first of each pair under no_sync(), and the
    canonical norm clips."""
    t = parts.cfg.train
    for group in parts.optimizer.param_groups:
        group["lr"] = parts.schedule(step)
    owned = list(parts.grads.microbatches)
    for i in owned:
        x, y = parts.cursor.samples(parts.cursor.position + i * t.micro_batch, t.micro_batch)
        if hooked is not None:
            sync = hooked.microbatch(ddp, i)
        else:
            sync = contextlib.nullcontext() if i == owned[-1] else ddp.no_sync()
        with sync:
            _, loss = ddp(x, y, rng.generator(t.seed, step, i, "dropout"))
            (loss / parts.tokens_per_step).backward()
    if hooked is not None:
        clip_grad_norm_(list(parts.model.parameters()), t.grad_clip)
    else:
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), t.grad_clip, foreach=False)
    parts.optimizer.step()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.cursor.advance(t.global_batch)


def alternate(sides: list, pairs: int, steps: int) -> list[list[float]]:
    """Each side's seconds per step in ``pairs`` rounds after a warm-up round, the sides taking turns and
    each round starting with the next one (no side always first); barriers around each side's turn."""
    times: list[list[float]] = [[] for _ in sides]
    for p in range(pairs + 1):
        marks = [0.0] * len(sides)
        for i in (p + j for j in range(len(sides))):
            side = i % len(sides)
            dist.barrier()
            t0 = time.perf_counter()
            for s in range(steps):
                sides[side](p * steps + s)
            dist.barrier()
            marks[side] = (time.perf_counter() - t0) / steps
        if p:  # round 0 warms up
            for i, t in enumerate(marks):
                times[i].append(t)
    return times


class TpBlock(torch.nn.Module):
    """A pre-norm decoder block (attention with q, k, v and an output projection, a 4x MLP) whose heads and
    hidden units the tensor-parallel styles split: it computes on whatever its projections return."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        nn = torch.nn
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.head_dim = width // heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = self.norm1(x)
        q, k, v = (proj(h).reshape(b, n, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, n, -1))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


def tp_main(args: argparse.Namespace) -> int:
    """--tp --block: one TpBlock's training step (forward, backward, AdamW) under samestep's canonical styles against
    PyTorch's ColwiseParallel/RowwiseParallel, on every process as one tensor-parallel group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from samestep.distributed import CanonicalColwiseParallel, CanonicalRowwiseParallel

    samestep.enable(threads=1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    steps = []
    for col, row in (
        (CanonicalColwiseParallel(args.tp_chunks), CanonicalRowwiseParallel(args.tp_chunks)),
        (ColwiseParallel(), RowwiseParallel()),
    ):
        torch.manual_seed(0)
        block = parallelize_module(
            TpBlock(args.width, args.heads), mesh, {"q": col, "k": col, "v": col, "up": col, "o": row, "down": row}
        )
        opt = torch.optim.AdamW(block.parameters(), lr=1e-3, foreach=False)
        x = torch.randn(args.batch, args.seq, args.width, generator=rng.generator(0, 0, 0, "data"))

        def step(_: int, block=block, opt=opt, x=x) -> None:
            block(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps.append(step)
    return tp_report(
        args,
        steps,
        f"TP {world}",
        {"width": args.width, "seq": args.seq, "batch": args.batch, "tp_chunks": args.tp_chunks},
    )


def tp_report(args: argparse.Namespace, sides: list, label: str, about: dict) -> int:
    """Times --tp's two sides (canonical, PyTorch's styles) by ``alternate``, prints the result on rank 0 and ends
    the process group."""
    times = alternate(sides, args.pairs, args.steps)
    result = {
        "world_size": dist.get_world_size(),
        "pairs": args.pairs,
        **about,
        "step_ms_canonical": round(1000 * statistics.median(times[0]), 2),
        "step_ms_plain_tp": round(1000 * statistics.median(times[1]), 2),
        "time_ratio_median": round(statistics.median([a / b for a, b in zip(*times)]), 4),
    }
    if dist.get_rank() == 0:
        print(
            json.dumps(result)
            if args.json
            else f"{label}: canonical {result['step_ms_canonical']} ms/step vs PyTorch's styles "
            f"{result['step_ms_plain_tp']} ms/step; ratio median of {args.pairs} pairs: "
            f"{result['time_ratio_median']}"
        )
    dist.destroy_process_group()
    samestep.disable()
    return 0


def stock_apply_tp(model: torch.nn.Module, cfg, world: int, rank: int, device_type: str, meshes=None) -> None:
    """``train.tensor_parallel.apply_tp``'s place in ``build`` for the other side of --tp: the decoder blocks' linear
    layers under PyTorch's ColwiseParallel/RowwiseParallel over one mesh of every process, as a user of PyTorch's
    styles runs them (one matmul a shard, a row layer's sum an all-reduce, dropout drawn per rank, the activation
    whole); the embedding, the head and the vocabulary-parallel loss samestep's, as on the canonical side. A fused
    q/k/v is split in contiguous rows: a rank's q, k and v are other rows of the unsplit weight than the canonical
    split's, of the same shapes and cost."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from samestep.distributed.tp_styles import CanonicalColwiseParallel, CanonicalVocabEmbedding

    if meshes is not None or world != cfg.parallel.tp or cfg.parallel.sp or cfg.model.moe_experts:
        raise SystemExit("bench_layout.py --tp: every process one tensor rank, without parallel.sp or experts")
    chunks, mesh = cfg.parallel.tp_chunks, init_device_mesh(device_type, (world,))
    col, row = ColwiseParallel(), RowwiseParallel()
    if cfg.model.arch == "llama":
        styles = {"attn.q": col, "attn.kv": col, "attn.o": row, "mlp.gate": col, "mlp.up": col, "mlp.down": row}
        prefix, blocks = "layers", len(model.layers)
        ends = {"embed": CanonicalVocabEmbedding(chunks), "output": CanonicalColwiseParallel(chunks)}
    else:
        styles = {"attn.c_attn": col, "attn.c_proj": row, "mlp.c_fc": col, "mlp.c_proj": row}
        prefix, blocks = "transformer.h", len(model.transformer.h)
        ends = {"transformer.wte": CanonicalVocabEmbedding(chunks)}
    parallelize_module(
        model, mesh, ends | {f"{prefix}.{i}.{name}": style for i in range(blocks) for name, style in styles.items()}
    )
    if getattr(model, "lm_head", None) is not None:  # the GPT's head, tied to the sharded embedding
        model.lm_head.weight = model.transformer.wte.weight
        parallelize_module(model, mesh, {"lm_head": CanonicalColwiseParallel(chunks)})
    model.vocab_parallel = (chunks, mesh.get_group())


def tp_step_main(args: argparse.Namespace) -> int:
    """--tp: the reference run's step at TP = the process count with parallel.tp_chunks (samestep's canonical
    styles) against the same step with PyTorch's styles in its decoder blocks (``stock_apply_tp``)."""
    import samestep.train.trainer as trainer_module

    samestep.enable(threads=1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    corpus = load_corpus("stdlib")
    base = ["determinism.threads=1", f"parallel.tp_chunks={args.tp_chunks}", f"parallel.tp={world}", *args.set]
    cfg = load_config(None, base, args.preset)
    canon = build(cfg, world=world, rank=rank, corpus=corpus)
    own, trainer_module.apply_tp = trainer_module.apply_tp, stock_apply_tp
    try:
        stock = build(cfg, world=world, rank=rank, corpus=corpus)
    finally:
        trainer_module.apply_tp = own
    for trainer in (canon, stock):
        trainer.model.train()
    preset = args.preset or "reference"
    return tp_report(
        args, [canon.step, stock.step], f"{preset} step at TP {world}", {"preset": preset, "settings": base}
    )


class SentBytes:
    """Bytes this process sends point to point and in the collectives a pipelined step runs (pipelining's
    activations and their gradients, a tied weight's, an expert's rows, the gradients' combine, the loss and
    norm), counted by patching torch.distributed's functions, by collective semantics: a send's tensor
    (pipelining's batched sends call ``isend`` each, which its ``P2POp`` checks by identity: patched in both
    namespaces), a broadcast's from its source, an all-gather's input to each other rank, a ring all-reduce's
    2(W-1)/W, an all-to-all's rows to other ranks."""

    def __init__(self) -> None:
        from torch.distributed import distributed_c10d as c10d

        self.sent = 0
        me = dist.get_rank()
        originals = {
            name: getattr(c10d, name)
            for name in (
                "isend",
                "send",
                "broadcast",
                "all_gather",
                "all_gather_into_tensor",
                "all_reduce",
                "all_to_all_single",
            )
        }

        def counted(name: str, tensor_at: int, only_source: bool = False):
            def fn(*a, **k):
                t = a[tensor_at]
                if not only_source or (a[1] if len(a) > 1 else k.get("src")) == me:
                    self.sent += t.numel() * t.element_size()
                return originals[name](*a, **k)

            return fn

        def gathered(name: str):  # a ring all-gather: this rank's input to each other rank
            def fn(out, inp, group=None, *a, **k):
                self.sent += (dist.get_world_size(group) - 1) * inp.numel() * inp.element_size()
                return originals[name](out, inp, group, *a, **k)

            return fn

        def all_reduce(t, op=dist.ReduceOp.SUM, group=None, *a, **k):  # a ring all-reduce: 2(W-1)/W of it
            w = dist.get_world_size(group)
            self.sent += 2 * (w - 1) * -(-t.numel() // w) * t.element_size()
            return originals["all_reduce"](t, op, group, *a, **k)

        def all_to_all_single(out, inp, out_splits=None, in_splits=None, group=None, *a, **k):
            me_in = dist.get_rank(group)
            rows = inp.shape[0] if inp.dim() else 1
            to_self = in_splits[me_in] if in_splits else rows // dist.get_world_size(group)
            self.sent += (rows - to_self) * (inp.numel() // max(rows, 1)) * inp.element_size()
            return originals["all_to_all_single"](out, inp, out_splits, in_splits, group, *a, **k)

        for name, fn in (
            ("isend", counted("isend", 0)),
            ("send", counted("send", 0)),
            ("all_to_all_single", all_to_all_single),
            ("all_reduce", all_reduce),
            ("all_gather_into_tensor", gathered("all_gather_into_tensor")),
            ("broadcast", counted("broadcast", 0, only_source=True)),
            ("all_gather", gathered("all_gather")),
        ):
            setattr(dist, name, fn)
            setattr(c10d, name, fn)


def parts_main(args: argparse.Namespace) -> int:
    """--pp: the reference run's step on parallel.pp stages (every process one stage) with the stages' canonical
    tree against pipelining's own accumulation; --ep: a Llama MoE's step with its experts over every process
    (parallel.ep) against the usual expert parallelism (each expert's gradient accumulated as it arrives, the
    combine an index_put_ that accumulates). Deterministic mode on in both: the sums are all that differs. And
    the bytes each process sends a step in each."""
    samestep.enable(threads=1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    corpus = load_corpus("stdlib")
    layout = (
        [f"parallel.pp={world}"]
        if args.pp
        else [f"parallel.ep={world}", "model.arch=llama", f"model.moe_experts={args.experts}"]
    )
    base = ["determinism.threads=1", *layout, *args.set]
    canon = build(load_config(None, base, args.preset), world=world, rank=rank, corpus=corpus)
    plain = build(
        load_config(None, [*base, "determinism.enabled=false"], args.preset), world=world, rank=rank, corpus=corpus
    )
    counter = SentBytes()
    sent = []
    for trainer in (canon, plain):  # the bytes of one step each, after a step that sets the stages up
        trainer.step(0)
        before = counter.sent
        trainer.step(1)
        sent.append(counter.sent - before)
    times = alternate([canon.step, plain.step], args.pairs, args.steps)
    result = {
        "layout": "pp" if args.pp else "ep",
        "world_size": world,
        "pairs": args.pairs,
        "preset": args.preset,
        "settings": base,
        "step_ms_canonical": round(1000 * statistics.median(times[0]), 2),
        "step_ms_plain": round(1000 * statistics.median(times[1]), 2),
        "time_ratio_median": round(statistics.median([a / b for a, b in zip(*times)]), 4),
        "bytes_sent_per_step_canonical": sent[0],
        "bytes_sent_per_step_plain": sent[1],
        "bytes_ratio": round(sent[0] / sent[1], 4),
    }
    mine = torch.tensor(sent, dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    rank_results = [
        {
            "bytes_sent_per_step_canonical": int(e[0]),
            "bytes_sent_per_step_plain": int(e[1]),
            "bytes_ratio": round(int(e[0]) / int(e[1]), 4),
        }
        for e in every
    ]
    if rank == 0:
        result["bytes_ratio_per_rank"] = [r["bytes_ratio"] for r in rank_results]
        other = "pipelining's own accumulation" if args.pp else "the usual expert parallelism"
        print(
            json.dumps(result)
            if args.json
            else f"{result['layout'].upper()} {world}: canonical {result['step_ms_canonical']} ms/step vs {other} "
            f"{result['step_ms_plain']} ms/step; ratio median of {args.pairs} pairs: "
            f"{result['time_ratio_median']}; bytes sent per step by rank: "
            f"{[r['bytes_sent_per_step_canonical'] for r in rank_results]} vs "
            f"{[r['bytes_sent_per_step_plain'] for r in rank_results]} (ratios "
            f"{result['bytes_ratio_per_rank']})"
        )
    dist.destroy_process_group()
    samestep.disable()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--fsdp", action="store_true", help="FSDP2: canonical reduce-scatter vs FSDP2's own")
    ap.add_argument("--tp", action="store_true", help="tensor parallelism: canonical styles vs PyTorch's own")
    ap.add_argument("--block", action="store_true", help="--tp: one decoder block, not the reference step")
    ap.add_argument("--width", type=int, default=256, help="--tp --block: the block's width")
    ap.add_argument("--heads", type=int, default=8, help="--tp --block: its attention heads")
    ap.add_argument("--seq", type=int, default=128, help="--tp --block: tokens per sequence")
    ap.add_argument("--batch", type=int, default=8, help="--tp --block: sequences per step")
    ap.add_argument("--tp-chunks", type=int, default=8, help="--tp: parallel.tp_chunks")
    ap.add_argument("--pp", action="store_true", help="pipeline stages: the canonical tree vs pipelining's own")
    ap.add_argument("--ep", action="store_true", help="expert parallelism: the experts' trees vs the usual sums")
    ap.add_argument("--experts", type=int, default=8, help="--ep: experts per MoE layer")
    ap.add_argument("--set", action="append", default=[], help="--tp, --pp, --ep: a config setting (section.key=value)")
    ap.add_argument("--preset", default=None, help="--tp, --pp, --ep: a config preset (small)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.tp:
        return tp_main(args) if args.block else tp_step_main(args)
    if args.pp or args.ep:
        return parts_main(args)
    samestep.enable(threads=1)  # before the process group: NCCL_ALGO and friends
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    corpus = load_corpus("stdlib")
    fsdp = ["parallel.fsdp=true"] if args.fsdp else []
    cfg = load_config(None, ["determinism.threads=1", *fsdp])
    canon = build(cfg, world=world, rank=rank, corpus=corpus)
    plain = build(load_config(None, ["determinism.enabled=false", *fsdp]), world=world, rank=rank, corpus=corpus)
    ddp = None if args.fsdp else DDP(plain.model)
    # The canonical combine started after the whole backward (parallel.overlap=false), for the overlap's share.
    after = (
        None
        if args.fsdp
        else build(
            load_config(None, ["determinism.threads=1", "parallel.overlap=false"]),
            world=world,
            rank=rank,
            corpus=corpus,
        )
    )
    # DDP kept, its reduction samestep's hook (a user's own loop): the canonical config's model, wrapped
    hooked = hooked_ddp = None
    if not args.fsdp:
        hooked = build(cfg, world=world, rank=rank, corpus=corpus)
        hooked_ddp = DDP(hooked.model)
        hook_state = CanonicalDdpState(microbatches_per_process=hooked.grads.k)
        hooked_ddp.register_comm_hook(hook_state, canonical_ddp_hook)
        hook_state.watch(hooked.optimizer)

    def other(step: int) -> None:
        if ddp is None:
            plain.step(step)
        else:
            ddp_step(plain, ddp, step)

    sides = [canon.step, other] + (
        [after.step, lambda step: ddp_step(hooked, hooked_ddp, step, hook_state)] if after is not None else []
    )
    times = alternate(sides, args.pairs, args.steps)
    t_canon, t_ddp = times[0], times[1]
    ratios = [a / b for a, b in zip(t_canon, t_ddp)]
    sent_per_step = canon.grads.bytes_sent / ((args.pairs + 1) * args.steps)
    if args.fsdp:  # each group's gradients, unsharded: a ring reduce-scatter sends (W-1)/W of them
        numel = sum(p.numel() for p in canon.grads.params)
        ring, against, other = (world - 1) * -(-numel // world) * 4, "ring reduce-scatter", "FSDP2's own"
    else:
        numel = sum(p.numel() for p in canon.grads.params) + 1  # + the loss riding along
        ring, against, other = ring_allreduce_bytes(numel, 4, world), "ring all-reduce", "DDP"
    result = {
        "world_size": world,
        "pairs": args.pairs,
        "steps_per_side": args.steps,
        "fsdp": args.fsdp,
        "step_ms_canonical": round(1000 * statistics.median(t_canon), 2),
        "step_ms_other": round(1000 * statistics.median(t_ddp), 2),
        "time_ratio_median": round(statistics.median(ratios), 4),
        "bytes_sent_per_step": int(sent_per_step),
        "ring_bytes": ring,
        "bytes_ratio": round(sent_per_step / ring, 4),
    }
    if after is not None:
        result["step_ms_after_backward"] = round(1000 * statistics.median(times[2]), 2)
        result["time_ratio_after_backward_median"] = round(
            statistics.median([a / b for a, b in zip(times[2], t_ddp)]), 4
        )
        result["time_ratio_overlap_to_after_median"] = round(
            statistics.median([a / b for a, b in zip(t_canon, times[2])]), 4
        )
        result["step_ms_ddp_hook"] = round(1000 * statistics.median(times[3]), 2)
        result["time_ratio_ddp_hook_median"] = round(statistics.median([a / b for a, b in zip(times[3], t_ddp)]), 4)
    if rank == 0:
        if args.json:
            print(json.dumps(result))
        else:
            print(
                f"{world} processes: canonical {result['step_ms_canonical']} ms/step vs {other} "
                f"{result['step_ms_other']} ms/step; ratio median of {args.pairs} pairs: "
                f"{result['time_ratio_median']}"
            )
            if after is not None:
                print(
                    f"combine after the whole backward (parallel.overlap=false): {result['step_ms_after_backward']} "
                    f"ms/step; ratio to DDP {result['time_ratio_after_backward_median']}"
                )
                print(
                    f"DDP with canonical_ddp_hook: {result['step_ms_ddp_hook']} ms/step; ratio to DDP's own "
                    f"{result['time_ratio_ddp_hook_median']}"
                )
            print(
                f"bytes sent per process per step: {result['bytes_sent_per_step']:,} vs {against} "
                f"{ring:,} (ratio {result['bytes_ratio']})"
            )
    dist.destroy_process_group()
    samestep.disable()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # past the interpreter's teardown: gloo's threads may still be winding down there (a rank aborted after its
    # results were printed, under load), and nothing is left to do
    os._exit(code)

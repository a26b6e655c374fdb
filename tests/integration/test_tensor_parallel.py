"""Tensor parallelism on PyTorch's own styles with the reductions made canonical
(``samestep.distributed.CanonicalColwiseParallel`` / ``CanonicalRowwiseParallel``): a decoder block (attention
with column-parallel q, k, v, separate or fused, and a row-parallel output, an MLP column- then row-parallel)
trained for a few steps gives the bits of one process at TP 2 and TP 4 (every loss, every gradient norm and
every parameter, gathered whole), and its checkpoints move between degrees."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import samestep
from samestep.distributed.tensor_parallel import validate_tp
from tests.support import spawn

pytestmark = pytest.mark.slow
C, HEADS, T, CHUNKS, STEPS, SAVE_AT = 64, 4, 16, 8, 5, 3


class Block(nn.Module):
    """Pre-norm attention + MLP; ``fused``: q, k and v one projection, "stacked" (q, then k, then v, as the
    reference GPT's c_attn) or "grouped" (by head: each head's q, k and v rows together, as torchtitan's
    FusedQKVLinear lays out a kv group). Its heads and hidden units are split by the styles applied to it; it
    computes on whatever its projections return (local heads under tensor parallelism)."""

    def __init__(self, fused: str | None) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(C), nn.LayerNorm(C)
        if fused:
            self.qkv = nn.Linear(C, 3 * C)
        else:
            self.q, self.k, self.v = (nn.Linear(C, C) for _ in range(3))
        self.o = nn.Linear(C, C)
        self.up, self.down = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.fused = fused

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        hs = C // HEADS
        if self.fused == "grouped":  # (B, L, local heads, q k v, hs)
            q, k, v = self.qkv(x).view(B, L, -1, 3, hs).unbind(3)
        else:
            q, k, v = self.qkv(x).chunk(3, dim=-1) if self.fused else (proj(x) for proj in (self.q, self.k, self.v))
        q, k, v = (t.reshape(B, L, -1, hs).transpose(1, 2) for t in (q, k, v))  # (B, local heads, L, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        mask = torch.ones(L, L, dtype=torch.bool).tril()
        y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, L, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


def _batch(step: int) -> torch.Tensor:
    g = samestep.rng.generator(0, step, 0, "data")
    return torch.randn(2, T, C, generator=g) * torch.exp(torch.randn(2, T, C, generator=g) * 2)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(block: Block, clip, opt, steps: range) -> list[str]:
    losses = []
    for step in steps:
        loss = block(_batch(step)).square().mean()
        loss.backward()
        norm = _full(clip(block.parameters(), 0.5)) if clip else loss  # clips: the norms here are in the hundreds
        opt.step()
        opt.zero_grad()
        losses += [loss.detach().view(torch.int32).item(), norm.detach().view(torch.int32).item()]
    return [f"{v:08x}" for v in losses]


def _digest(block: Block) -> str:
    h = hashlib.sha256()
    for name, p in sorted(block.named_parameters()):
        h.update(name.encode() + _full(p.detach()).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _worker(rank: int, world: int, init: str, out: str, how: str, ckpt: str, phase: str) -> None:
    """``how``: "canonical" (samestep's styles and norm), "stock" (PyTorch's), "fused" (samestep's, q, k and v
    one projection: ``CanonicalColwiseParallel(parts=3, fused="stacked")``), "fresh_moments" (as "fused", a
    resume that loads no optimizer state), "grouped" (q, k and v fused by head, ``fused="grouped"``),
    "grouped_as_stacked" (that layout declared stacked), "gathered" (the MLP's first layer's output gathered
    whole, ``output_layouts=Replicate()``, its second layer unsplit). ``phase``: "straight" (steps
    0..STEPS-1), "save" (the same, a sharded checkpoint after step SAVE_AT-1 into ``ckpt``) or "resume" (from
    ``ckpt``, steps SAVE_AT..)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from samestep.checkpoint import load_checkpoint, save_checkpoint
    from samestep.distributed import (
        CanonicalColwiseParallel,
        CanonicalRowwiseParallel,
        ShardedModel,
        ShardedOptimizer,
        clip_grad_norm_,
    )

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    with samestep.enable(threads=1):
        torch.manual_seed(0)
        fused = "stacked" if how in ("fused", "fresh_moments") else "grouped" if how.startswith("grouped") else None
        block = Block(fused)
        mesh = init_device_mesh("cpu", (world,))  # one process: a mesh of one, the same placements
        if how == "stock":
            col, row, clip = ColwiseParallel(), RowwiseParallel(), None  # its DTensor and plain gradients mix
        else:
            col, row, clip = CanonicalColwiseParallel(CHUNKS), CanonicalRowwiseParallel(CHUNKS), clip_grad_norm_
        plan = {"up": col, "o": row, "down": row}
        if how == "gathered":
            from torch.distributed.tensor import Replicate

            del plan["down"]
            plan["up"] = CanonicalColwiseParallel(CHUNKS, output_layouts=Replicate())
        stacked = CanonicalColwiseParallel(CHUNKS, parts=3, fused="stacked")
        grouped = CanonicalColwiseParallel(CHUNKS, fused="grouped", groups=HEADS)
        plan |= {"qkv": grouped if how == "grouped" else stacked} if fused else {"q": col, "k": col, "v": col}
        if how != "stock" or world > 1:
            parallelize_module(block, mesh, plan)
        opt = torch.optim.AdamW(block.parameters(), lr=0.01, foreach=False)
        if phase == "resume":
            load_checkpoint(
                ckpt,
                model=ShardedModel(block),
                restore_rng=False,
                optimizer=None if how == "fresh_moments" else ShardedOptimizer(opt),
            )
            losses = _train(block, clip, opt, range(SAVE_AT, STEPS))
        else:
            losses = _train(block, clip, opt, range(SAVE_AT))
            if phase == "save":
                save_checkpoint(ckpt, SAVE_AT, model=block, optimizer=opt, sharded=True)
            losses += _train(block, clip, opt, range(SAVE_AT, STEPS))
        digest = _digest(block)
    if rank == 0:
        Path(out).write_text(json.dumps({"losses": losses, "digest": digest}))


def _run(tmp_path: Path, world: int, how: str, phase: str = "straight") -> dict:
    out = tmp_path / f"{how}_{world}_{phase}.json"
    spawn(
        _worker,
        (world, str(tmp_path / f"init_{how}_{world}_{phase}"), str(out), how, str(tmp_path / "ckpt"), phase),
        world,
    )
    return json.loads(out.read_text())


def test_tp_2_and_4_give_the_one_process_bits_and_stock_styles_do_not(tmp_path):
    """Every step's loss and canonical gradient-norm bits (clipping on) and the final parameters, gathered
    whole, at TP 2 and TP 4 equal one process (the same styles on a mesh of one). Negative control: PyTorch's
    own ColwiseParallel/RowwiseParallel (each rank one matmul over its shard, the row-parallel sum an
    all-reduce; no clipping, which torch's clip_grad_norm_ refuses over its mix of DTensor and plain
    gradients) at TP 2 repeat themselves but give other parameter bits than the plain block on one
    process."""
    one = _run(tmp_path, 1, "canonical")
    for world in (2, 4):
        assert _run(tmp_path, world, "canonical") == one, world
    plain_one, plain_two = _run(tmp_path, 1, "stock"), _run(tmp_path, 2, "stock")
    (tmp_path / "again").mkdir()
    assert _run(tmp_path / "again", 2, "stock") == plain_two
    assert plain_two["digest"] != plain_one["digest"]


def test_fused_qkv_and_a_checkpoint_written_at_tp_2_resume_at_tp_4_and_1_bit_for_bit(tmp_path):
    """q, k and v fused in one projection (each rank its heads of each: DTensor's _StridedShard): TP 2 gives
    the one-process bits; its sharded checkpoint (version 3: the fused weight in parts, the row-parallel
    weights split along dim 1) written after step SAVE_AT-1, resumed at TP 4 and on one process, gives the
    remaining steps' loss and norm bits and the final parameters of the run straight through. Negative
    control: a resume that loads the model but not the optimizer state (AdamW's moments afresh) ends
    elsewhere."""
    straight = _run(tmp_path, 2, "fused", "save")
    assert _run(tmp_path, 1, "fused") == straight
    manifest = json.loads(next((tmp_path / "ckpt").glob("step_*/manifest.json")).read_text())
    assert manifest["version"] == 3 and manifest["world_size"] == 2
    for world in (4, 1):
        resumed = _run(tmp_path, world, "fused", "resume")
        assert resumed["losses"] == straight["losses"][2 * SAVE_AT :] and resumed["digest"] == straight["digest"], world
    assert _run(tmp_path, 1, "fresh_moments", "resume")["digest"] != straight["digest"]


def test_a_fused_layer_declares_its_rows_and_an_output_may_be_gathered(tmp_path):
    """q, k and v fused by head (torchtitan's kv-group layout, ``fused="grouped", groups=4``): TP 2 and TP 4 give
    the one-process bits, each rank holding whole heads; so does an MLP whose first layer's output is gathered
    whole (``output_layouts=Replicate()``: an all-gather) into an unsplit second layer. Negative control: that
    grouped weight declared stacked (``parts=3, fused="stacked"``), what an undeclared ``parts=3`` read it as,
    trains another model at TP 2 (other bits than the one process)."""
    one = _run(tmp_path, 1, "grouped")
    assert _run(tmp_path, 2, "grouped") == one and _run(tmp_path, 4, "grouped") == one
    assert _run(tmp_path, 2, "grouped_as_stacked")["digest"] != one["digest"]
    assert _run(tmp_path, 2, "gathered") == _run(tmp_path, 1, "gathered")


def test_a_style_refuses_an_undeclared_fused_layout_and_layouts_it_cannot_keep():
    """``parts`` without ``fused``, a grouped layout without groups, and PyTorch's layout keyword arguments that
    would change the bits (a DTensor output, a column-parallel input split by features, a gathered fused
    output) are refused, one line naming the argument and what the style takes. Negative control: the
    arguments it takes map onto its own (``Shard(1)``: sequence parallelism)."""
    from torch.distributed.tensor import Replicate, Shard

    from samestep.distributed import CanonicalColwiseParallel, CanonicalRowwiseParallel

    for kwargs, words in (
        ({"parts": 3}, "a fused layer says how its rows lie"),
        ({"fused": "grouped"}, "fused='grouped' with groups=g"),
        ({"fused": "stacked", "parts": 1}, "fused='stacked' with parts=k"),
        ({"use_local_output": False}, "use_local_output=True"),
        ({"input_layouts": Shard(2)}, "takes Replicate() (the input whole) or Shard(1)"),
        ({"parts": 3, "fused": "stacked", "output_layouts": Replicate()}, "of an unfused layer"),
    ):
        with pytest.raises(ValueError, match="Fix:|takes|gives") as e:
            CanonicalColwiseParallel(8, **kwargs)
        assert words in str(e.value) and "\n" not in str(e.value), (kwargs, str(e.value))
    with pytest.raises(ValueError, match=r"output_layouts=Shard\(0\)\): gives Replicate\(\)"):
        CanonicalRowwiseParallel(8, output_layouts=Shard(0))
    assert CanonicalColwiseParallel(8, input_layouts=Shard(1)).sequence_dim == 1
    assert CanonicalRowwiseParallel(8, output_layouts=Shard(1)).sequence_dim == 1
    assert CanonicalColwiseParallel(8, output_layouts=Replicate()).gather_output
    assert CanonicalColwiseParallel(8, fused="grouped", groups=4).groups == 4


def test_a_degree_that_does_not_cut_whole_chunks_is_refused():
    """TP 3, a chunk count not a power of two, and a width the chunks do not divide: one line each, naming the
    value and the fix. Negative control: TP 4 of 8 chunks over a width of 64 and 4 heads passes."""
    validate_tp(4, 8, {"n_embd": 64, "n_head": 4})
    for degree, chunks, dims, words in (
        (3, 8, {"n_embd": 48}, "parallel.tp=3"),
        (2, 6, {"n_embd": 48}, "parallel.tp_chunks=6"),
        (2, 8, {"n_embd": 36}, "n_embd=36"),
        (4, 8, {"n_embd": 64, "n_head": 2}, "n_head=2"),
    ):
        with pytest.raises(ValueError, match="Fix:") as e:
            validate_tp(degree, chunks, dims)
        assert words in str(e.value) and "\n" not in str(e.value)


def _two_d_worker(rank: int, init: str, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from samestep.checkpoint import CheckpointError, save_checkpoint
    from samestep.distributed import canonical_grad_norm

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    flat, square = init_device_mesh("cpu", (1,)), init_device_mesh("cpu", (1, 1))
    ok = distribute_tensor(torch.ones(4, 4), flat, [Shard(1)])
    canonical_grad_norm([ok])  # one placement: bracketed
    model = nn.Linear(4, 4, bias=False)
    model.weight = nn.Parameter(distribute_tensor(torch.ones(4, 4), square, [Shard(0), Shard(1)]))
    with pytest.raises(ValueError, match=r"2-D mesh.*Fix: pass full_tensor\(\)"):
        canonical_grad_norm([model.weight.detach()])
    with pytest.raises(CheckpointError, match=r"'weight' is placed .*full_tensor\(\) instead"):
        save_checkpoint(root, 1, model=model, sharded=True)
    model.weight = nn.Parameter(ok)
    save_checkpoint(root, 1, model=model, sharded=True)


def test_a_two_dimensional_placement_is_refused_by_the_norm_and_the_checkpoint(tmp_path):
    """A tensor sharded over a 2-D mesh whose dimensions have no names (not FSDP2 over tensor parallelism's):
    canonical_grad_norm and a sharded save refuse it, naming it and the fix (full_tensor()); nothing is
    committed. Negative control: the same tensor on a 1-D mesh is taken by
    both."""
    spawn(_two_d_worker, (str(tmp_path / "init"), str(tmp_path / "ckpt")), 1)
    assert [p.name for p in (tmp_path / "ckpt").glob("step_*")] == ["step_000001"]


VOCAB = 256


def _loss_worker(rank: int, world: int, init: str, out: str, how: str) -> None:
    """An output layer over VOCAB ids, column-parallel, and each token's cross-entropy: ``how`` "canonical"
    (CanonicalColwiseParallel, vocab_parallel_cross_entropy) or "stock" (ColwiseParallel and DTensor's
    loss_parallel(), F.cross_entropy unsplit on one process)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    from samestep.distributed import CanonicalColwiseParallel, vocab_parallel_cross_entropy

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    with samestep.enable(threads=1):
        torch.manual_seed(0)
        head = nn.Linear(C, VOCAB, bias=False)
        mesh = init_device_mesh("cpu", (world,))
        g = samestep.rng.generator(0, 0, 0, "data")
        x = (torch.randn(4, T, C, generator=g) * 3).requires_grad_()
        targets = torch.randint(0, VOCAB, (4, T), generator=g)
        if how == "canonical":
            parallelize_module(head, mesh, CanonicalColwiseParallel(CHUNKS))
            group = mesh.get_group() if world > 1 else None
            per_token = vocab_parallel_cross_entropy(head(x), targets, CHUNKS, group)
        elif world > 1:
            parallelize_module(head, mesh, ColwiseParallel(use_local_output=False))
            with loss_parallel():
                per_token = nn.functional.cross_entropy(
                    head(x).flatten(0, 1), targets.flatten(), reduction="none"
                ).full_tensor()
                per_token.sum().backward()
        else:
            per_token = nn.functional.cross_entropy(head(x).flatten(0, 1), targets.flatten(), reduction="none")
        if how == "canonical" or world == 1:
            per_token.sum().backward()
        bits = {
            "loss": per_token.detach().contiguous().view(torch.uint8).numpy().tobytes().hex(),
            "x_grad": hashlib.sha256(x.grad.view(torch.uint8).numpy().tobytes()).hexdigest(),
            "w_grad": hashlib.sha256(
                _full(head.weight.grad).contiguous().view(torch.uint8).numpy().tobytes()
            ).hexdigest(),
        }
    if rank == 0:
        Path(out).write_text(json.dumps(bits))


def _loss_run(tmp_path: Path, world: int, how: str) -> dict:
    out = tmp_path / f"loss_{how}_{world}.json"
    spawn(_loss_worker, (world, str(tmp_path / f"init_loss_{how}_{world}"), str(out), how), world)
    return json.loads(out.read_text())


def test_a_vocabulary_parallel_cross_entropy_gives_one_process_bits_at_tp_2_and_4(tmp_path):
    """Every token's loss, the hidden states' gradient and the output layer's gradient, gathered whole: TP 2
    and TP 4 give one process's bits (the sum over the vocabulary in 8 fixed chunks along the canonical
    tree). Negative control: PyTorch's ColwiseParallel and loss_parallel() at TP 2 give other loss bits than
    F.cross_entropy on one process."""
    one = _loss_run(tmp_path, 1, "canonical")
    for world in (2, 4):
        assert _loss_run(tmp_path, world, "canonical") == one, world
    assert _loss_run(tmp_path, 2, "stock")["loss"] != _loss_run(tmp_path, 1, "stock")["loss"]

"""Tensor parallelism on PyTorch's own styles with the reductions made canonical
(``samestep.distributed.CanonicalColwiseParallel`` / ``CanonicalRowwiseParallel``): a decoder block (attention
with column-parallel q, k, v and a row-parallel output, an MLP column- then row-parallel) trained for a few
steps gives the bits of one process at TP 2 and TP 4: every loss and every parameter, gathered whole."""

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
from samestep.distributed.tensor_parallel import column_linear, row_linear, validate_tp
from tests.conftest import spawn

pytestmark = pytest.mark.slow
C, HEADS, T, CHUNKS, STEPS = 64, 4, 16, 8, 3


class Block(nn.Module):
    """Pre-norm attention + MLP. ``tp``: the tensor-parallel degree its heads and hidden units are split by
    (its projections are sharded by the styles applied to it); ``canonical``: run the projections through
    samestep's chunked forms (on one process too), else through ``nn.Linear``/DTensor as PyTorch does."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.q, self.k, self.v, self.o = (nn.Linear(C, C) for _ in range(4))
        self.up, self.down = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.heads = HEADS

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = (proj(x) for proj in (self.q, self.k, self.v))
        hs = C // HEADS
        q, k, v = (t.reshape(B, L, -1, hs).transpose(1, 2) for t in (q, k, v))  # (B, local heads, L, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        mask = torch.ones(L, L, dtype=torch.bool).tril()
        y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, L, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


def _canonical_unsplit(block: Block) -> None:
    """One process, no mesh: each projection's forward is the canonical chunked form over the whole layer."""
    for name, fn in (("q", column_linear), ("k", column_linear), ("v", column_linear), ("up", column_linear),
                     ("o", row_linear), ("down", row_linear)):
        lin = getattr(block, name)
        lin.forward = (lambda f, m: lambda x: f(x, m.weight, m.bias, CHUNKS))(fn, lin)


def _batch(step: int) -> torch.Tensor:
    g = samestep.rng.generator(0, step, 0, "data")
    return torch.randn(2, T, C, generator=g) * torch.exp(torch.randn(2, T, C, generator=g) * 2)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(block: Block) -> tuple[list[str], str]:
    opt = torch.optim.AdamW(block.parameters(), lr=0.01, foreach=False)
    losses = []
    for step in range(STEPS):
        loss = block(_batch(step)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().view(torch.int32).item())
    h = hashlib.sha256()
    for name, p in sorted(block.named_parameters()):
        h.update(name.encode() + _full(p.detach()).contiguous().view(torch.uint8).numpy().tobytes())
    return [f"{v:08x}" for v in losses], h.hexdigest()


def _worker(rank: int, world: int, init: str, out: str, how: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from samestep.distributed import CanonicalColwiseParallel, CanonicalRowwiseParallel

    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        with samestep.enable(threads=1):
            torch.manual_seed(0)
            block = Block()
            if world > 1:
                mesh = init_device_mesh("cpu", (world,))
                col, row = ((CanonicalColwiseParallel(CHUNKS), CanonicalRowwiseParallel(CHUNKS)) if how == "canonical"
                            else (ColwiseParallel(), RowwiseParallel()))
                parallelize_module(block, mesh, {"q": col, "k": col, "v": col, "up": col, "o": row, "down": row})
            elif how == "canonical":
                _canonical_unsplit(block)
            losses, digest = _train(block)
        if rank == 0:
            Path(out).write_text(json.dumps({"losses": losses, "digest": digest}))
    finally:
        if world > 1:
            dist.destroy_process_group()


def _run(tmp_path: Path, world: int, how: str) -> dict:
    out = tmp_path / f"{how}_{world}.json"
    if world == 1:
        _worker(0, 1, "", str(out), how)
    else:
        spawn(_worker, (world, str(tmp_path / f"init_{how}_{world}"), str(out), how), world)
    return json.loads(out.read_text())


def test_tp_2_and_4_give_the_one_process_bits_and_stock_styles_do_not(tmp_path):
    """Every step's loss bits and the final parameters, gathered whole, at TP 2 and TP 4 equal one process
    running the same chunked forms unsplit. Negative control: PyTorch's own ColwiseParallel/RowwiseParallel
    (each rank one matmul over its shard, the row-parallel sum an all-reduce) at TP 2 repeat themselves but
    give other parameter bits than the same block unsplit."""
    one = _run(tmp_path, 1, "canonical")
    for world in (2, 4):
        assert _run(tmp_path, world, "canonical") == one, world
    plain_one, plain_two = _run(tmp_path, 1, "stock"), _run(tmp_path, 2, "stock")
    (tmp_path / "again").mkdir()
    assert _run(tmp_path / "again", 2, "stock") == plain_two
    assert plain_two["digest"] != plain_one["digest"]


def test_a_degree_that_does_not_cut_whole_chunks_is_refused():
    """TP 3, a chunk count not a power of two, and a width the chunks do not divide: one line each, naming the
    value and the fix. Negative control: TP 4 of 8 chunks over a width of 64 and 4 heads passes."""
    validate_tp(4, 8, {"n_embd": 64, "n_head": 4})
    for degree, chunks, dims, words in ((3, 8, {"n_embd": 48}, "parallel.tp=3"),
                                        (2, 6, {"n_embd": 48}, "parallel.tp_chunks=6"),
                                        (2, 8, {"n_embd": 36}, "n_embd=36"),
                                        (4, 8, {"n_embd": 64, "n_head": 2}, "n_head=2")):
        with pytest.raises(ValueError, match="Fix:") as e:
            validate_tp(degree, chunks, dims)
        assert words in str(e.value) and "\n" not in str(e.value)

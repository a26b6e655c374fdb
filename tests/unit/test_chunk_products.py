"""The canonical tensor-parallel layers' chunk products: batched where that gives each chunk the bits of its own
matmul, and only there (docs/layouts.md, "Tensor parallelism")."""

from __future__ import annotations

import pytest
import torch

from samestep.distributed import chunk_products as cp

# (rows, in, out, chunks, parts): the reference GPT's layers (fused q/k/v, the MLP, the head), the small Llama's,
# a wide one, and one just above the batched form's size threshold
SHAPES = [(256, 128, 384, 8, 3), (256, 128, 512, 8, 1), (256, 512, 128, 8, 1), (256, 128, 96, 8, 1),
          (128, 384, 1152, 4, 3), (128, 384, 256, 2, 2), (128, 1024, 1024, 8, 1), (16, 16, 16, 8, 1)]


def _bits(t: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.view(torch.int32) for x in (t if isinstance(t, list) else [t])]


def _all_forms(m: int, k: int, n: int, chunks: int, parts: int, bf16: bool) -> dict[str, object]:
    g = torch.Generator().manual_seed(m * k + n)

    def rand(*shape):  # operands as the layer holds them: bf16-rounded values in fp32 under bf16 autocast
        t = torch.randn(*shape, generator=g)
        return t.to(torch.bfloat16).float() if bf16 else t

    x, w, b, gy = rand(m, k), rand(n, k), rand(n), rand(m, n)
    xr, wr, gr = rand(m, n), rand(k, n), rand(m, k)  # a row layer: input n wide, output k wide
    return {"column_forward": cp.column_forward(x, w, b, chunks),
            "column_forward_unbiased": cp.column_forward(x, w, None, chunks),
            "column_grad_input_parts": cp.column_grad_input_parts(gy, w, chunks, parts),
            "column_grad_weight": cp.column_grad_weight(gy, x, chunks),
            "row_forward": cp.row_forward(xr, wr, chunks),
            "row_grad_input": cp.row_grad_input(gr, wr, chunks),
            "row_grad_weight": cp.row_grad_weight(gr, xr, chunks)}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-rounded"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_batched_products_give_every_chunk_the_bits_of_its_own_matmul(shape, bf16, monkeypatch):
    """On one intra-op thread each product's batched form has the bytes of the loop of one matmul a chunk (the
    path's definition), over the layers' shapes; the batched form is the one taken there."""
    torch.set_num_threads(1)
    m, k, n, chunks, _ = shape
    assert cp.batched(torch.empty(0), m, k // chunks, n)
    fast = _all_forms(*shape, bf16)
    monkeypatch.setattr(cp, "batched", lambda *a: False)
    slow = _all_forms(*shape, bf16)
    for name in fast:
        a, b = _bits(fast[name]), _bits(slow[name])
        assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b)), name


def test_the_batched_form_is_refused_where_atens_bmm_would_not_give_the_loops_bits():
    """Below the size threshold ATen's CPU bmm runs its own kernel, whose bytes differ from the GEMM's: the
    same check catches it (control), and ``batched`` refuses that shape, and any shape on more threads."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 4, generator=g), torch.randn(16, 4, generator=g)
    loop = torch.cat([x @ c.t() for c in w.chunk(8, 0)], dim=1)
    bmm = torch.bmm(x.expand(8, 4, 4), w.view(8, 2, 4).transpose(1, 2)).transpose(0, 1).reshape(4, 16)
    assert not torch.equal(loop.view(torch.int32), bmm.view(torch.int32))
    assert not cp.batched(x, 4, 4, 2)
    assert torch.equal(cp.column_forward(x, w, None, 8).view(torch.int32), loop.view(torch.int32))
    torch.set_num_threads(2)
    assert not cp.batched(x, 256, 128, 48)

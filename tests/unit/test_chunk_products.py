"""The canonical tensor-parallel layers' chunk products: batched where that gives each chunk the bits of its own
matmul, and only there (docs/layouts.md, "Tensor parallelism")."""

from __future__ import annotations

import pytest
import torch

from samestep.distributed import chunk_products as cp

# (rows, in, out, chunks, parts): the reference GPT's layers (fused q/k/v, the MLP, the head), the small Llama's,
# a wide one, and one just above the batched form's size threshold
SHAPES = [
    (256, 128, 384, 8, 3),
    (256, 128, 512, 8, 1),
    (256, 512, 128, 8, 1),
    (256, 128, 96, 8, 1),
    (128, 384, 1152, 4, 3),
    (128, 384, 256, 2, 2),
    (128, 1024, 1024, 8, 1),
    (16, 16, 16, 8, 1),
]


def _bits(t: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.view(torch.int32) for x in (t if isinstance(t, list) else [t])]


def _all_forms(m: int, k: int, n: int, chunks: int, parts: int, bf16: bool) -> dict[str, object]:
    g = torch.Generator().manual_seed(m * k + n)

    def rand(*shape):  # operands as the layer holds them: bf16-rounded values in fp32 under bf16 autocast
        t = torch.randn(*shape, generator=g)
        return t.to(torch.bfloat16).float() if bf16 else t

    x, w, b, gy = rand(m, k), rand(n, k), rand(n), rand(m, n)
    xr, wr, gr = rand(m, n), rand(k, n), rand(m, k)  # a row layer: input n wide, output k wide
    return {
        "column_forward": cp.column_forward(x, w, b, chunks),
        "column_forward_unbiased": cp.column_forward(x, w, None, chunks),
        "column_grad_input_parts": cp.column_grad_input_parts(gy, w, chunks, parts),
        "column_grad_weight": cp.column_grad_weight(gy, x, chunks),
        "column_grad_bias": cp.column_grad_bias(gy, parts * chunks),
        "row_forward": cp.row_forward(xr, wr, chunks),
        "row_grad_input": cp.row_grad_input(gr, wr, chunks),
        "row_grad_weight": cp.row_grad_weight(gr, xr, chunks),
    }


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-rounded"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_batched_products_give_every_chunk_the_bits_of_its_own_matmul(shape, bf16, monkeypatch):
    """On one intra-op thread each product's batched form has the bytes of the loop of one matmul a chunk (the
    path's definition), over the layers' shapes; the batched form is the one taken there."""
    torch.set_num_threads(1)
    m, k, n, chunks, _ = shape
    assert cp.batched(torch.empty(0), m, k // chunks, n)
    fast = _all_forms(*shape, bf16)
    monkeypatch.setattr(cp, "one_thread_cpu", lambda x: False)
    slow = _all_forms(*shape, bf16)
    for name in fast:
        a, b = _bits(fast[name]), _bits(slow[name])
        assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b)), name


def test_the_batched_form_is_refused_where_atens_bmm_would_not_give_the_loops_bits():
    """Below the size threshold ATen's CPU bmm may run a kernel of its own (on some CPUs its bytes differ from
    the GEMM's, on others not: a CPU decides), so ``batched`` refuses that shape on any CPU, and any shape on
    more threads; the chunked form there is the loop's bits. Control: the same bitwise check catches the same
    products summed in another order (the kind of difference another kernel makes)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 4, generator=g), torch.randn(16, 4, generator=g)
    loop = torch.cat([x @ c.t() for c in w.chunk(8, 0)], dim=1)
    reordered = torch.cat([x.flip(1) @ c.flip(1).t() for c in w.chunk(8, 0)], dim=1)
    assert not torch.equal(loop.view(torch.int32), reordered.view(torch.int32))
    assert not cp.batched(x, 4, 4, 2)
    assert torch.equal(cp.column_forward(x, w, None, 8).view(torch.int32), loop.view(torch.int32))
    torch.set_num_threads(2)
    assert not cp.batched(x, 256, 128, 48)


def _activation(fn, x: torch.Tensor, width: int | None, grad: torch.Tensor) -> list[torch.Tensor]:
    """``fn`` on ``x`` (whole, or chunk by chunk as ``chunkwise`` defines it) and its input's gradient, as bits."""
    x = x.detach().requires_grad_()
    y = fn(x) if width is None else torch.cat([fn(c.contiguous()) for c in x.split(width, -1)], -1)
    (gx,) = torch.autograd.grad(y, x, grad)
    view = torch.int16 if x.dtype == torch.bfloat16 else torch.int32
    return [y.detach().view(view), gx.view(view)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fn", [torch.nn.functional.gelu, torch.nn.functional.silu], ids=["gelu", "silu"])
@pytest.mark.parametrize("rows, width, chunks", [(256, 64, 8), (7, 64, 8), (128, 128, 4), (33, 128, 2)])
def test_an_activation_runs_whole_where_that_gives_it_the_bits_of_its_chunks(rows, width, chunks, fn, dtype):
    """Where ``elementwise_whole`` says so (the reference GPT's and the small Llama's MLP widths, any row count),
    an activation and its gradient on the whole tensor have the bytes of the chunk-by-chunk ones."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rows * width)
    x = (3 * torch.randn(rows, width * chunks, generator=g)).to(dtype)
    grad = torch.randn(rows, width * chunks, generator=g).to(dtype)
    assert cp.elementwise_whole(x, width)
    whole, chunked = _activation(fn, x, None, grad), _activation(fn, x, width, grad)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


def test_an_activation_keeps_its_chunks_where_a_scalar_tail_would_move():
    """Chunks 12 wide over 33 rows put some elements in silu's scalar tail chunk by chunk and in its vectorized
    loop whole: the same check catches the other bits (control), and ``elementwise_whole`` refuses that width,
    a strided tensor and more threads."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, grad = 3 * torch.randn(33, 96, generator=g), torch.randn(33, 96, generator=g)
    whole, chunked = (
        _activation(torch.nn.functional.silu, x, None, grad),
        _activation(torch.nn.functional.silu, x, 12, grad),
    )
    assert not all(torch.equal(a, b) for a, b in zip(whole, chunked))
    assert not cp.elementwise_whole(x, 12)
    assert not cp.elementwise_whole(torch.randn(128, 64).t(), 64)
    torch.set_num_threads(2)
    assert not cp.elementwise_whole(torch.randn(64, 128), 64)

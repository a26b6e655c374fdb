"""The chunk-by-chunk work of the canonical tensor-parallel layers (``tensor_parallel``) and of the activations
between them (``train.model.chunkwise``), each written once: chunk by chunk, the path's definition, or as one
call where that gives every chunk the same bits.

A layer cut into C chunks runs C matmuls of one chunk's shape where a plain layer runs one; on a small layer
the C calls, their copies and their concatenation cost more than the products (docs/performance.md, "tensor
parallelism's path on one device"). ATen's CPU ``bmm`` hands every batch item to the GEMM one ``mm`` would
call, with the same operands' strides, when its process runs one intra-op thread and an item has at least
``_BATCHED_MIN`` multiply-adds (below it ATen runs a loop kernel of its own; with more threads it splits the
batch where ``mm`` splits the matrix). There, and only there, a chunk's product is batched. An activation runs
chunk by chunk so that a vectorized kernel's scalar tail falls on the same elements at every degree; where no
element of the whole tensor or of a chunk falls in a tail (``elementwise_whole``) it runs on the whole.
``tests/unit/test_chunk_products.py`` holds each form to the chunk-by-chunk bits over the layers' shapes, and
shows them differing where the conditions fail. On a GPU every chunk keeps its own call: whether cuBLAS's
strided-batched GEMM picks each item the kernel of its own GEMM at every batch count is for a device to show.

Every product takes operands already rounded and held as the layer computes (``tensor_parallel._dtypes``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "batched",
    "column_grad_bias",
    "column_grad_input_parts",
    "column_grad_weight",
    "column_forward",
    "elementwise_whole",
    "one_thread_cpu",
    "row_forward",
    "row_grad_input",
    "row_grad_weight",
]

_BATCHED_MIN = 400  # ATen's CPU bmm runs its own loop kernel below this many multiply-adds an item
_LANES = 64  # elements a vectorized CPU loop takes a turn at most: two 512-bit vectors of a 2-byte type


def one_thread_cpu(x: torch.Tensor) -> bool:
    """Whether ``x`` is on the CPU in a process of one intra-op thread, where ATen runs one call over several
    chunks as it runs each chunk alone (with more threads it splits the work where a single chunk's call would
    split it otherwise)."""
    return x.device.type == "cpu" and torch.get_num_threads() == 1


def batched(x: torch.Tensor, rows: int, inner: int, cols: int) -> bool:
    """Whether a batch of (rows x inner) @ (inner x cols) chunk products on ``x``'s device gives each item the bits
    of its own matmul (the conditions in the module's docstring)."""
    return one_thread_cpu(x) and rows * inner * cols >= _BATCHED_MIN


def elementwise_whole(x: torch.Tensor, width: int) -> bool:
    """Whether an elementwise op (an activation, its gradient) on ``x`` whole gives every element the bits it gets
    with ``x`` cut into ``width``-wide chunks of its last dimension, each made contiguous: on a CPU process of
    one intra-op thread, ``x`` contiguous and ``width`` whole runs of ``_LANES``, every element of either falls
    in the kernel's vectorized loop, which computes lane by lane alike, and none in its scalar tail."""
    return one_thread_cpu(x) and x.is_contiguous() and width % _LANES == 0


def column_forward(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunks: int) -> torch.Tensor:
    """``x2 W^T + b`` as ``chunks`` products over W's row chunks, laid side by side: (M, N)."""
    (m, k), n = x2.shape, weight.shape[0] // chunks
    if not batched(x2, m, k, n):
        bs = bias.chunk(chunks, 0) if bias is not None else [None] * chunks
        return torch.cat([nn.functional.linear(x2, w, b) for w, b in zip(weight.chunk(chunks, 0), bs)], dim=1)
    a, w = x2.expand(chunks, m, k), weight.reshape(chunks, n, k).transpose(1, 2)
    y = torch.bmm(a, w) if bias is None else torch.baddbmm(bias.view(chunks, 1, n), a, w)
    return y.transpose(0, 1).reshape(m, chunks * n)


def column_grad_input_parts(g2: torch.Tensor, weight: torch.Tensor, chunks: int, parts: int) -> list[torch.Tensor]:
    """The input's gradient of a column layer of ``parts`` fused projections, one leaf a chunk: chunk c's
    ``g_c W_c`` of each part, added in part order, (M, K) each."""
    m, (rows, k) = g2.shape[0], weight.shape
    n = rows // (parts * chunks)
    if not batched(g2, m, n, k):
        gs = [g.contiguous() for g in g2.chunk(parts * chunks, 1)]  # a chunk's matmuls: one shape anywhere
        ws = weight.chunk(parts * chunks, 0)
        leaves = []
        for c in range(chunks):
            leaf = gs[c] @ ws[c]
            for p in range(1, parts):
                leaf.add_(gs[p * chunks + c] @ ws[p * chunks + c])
            leaves.append(leaf)
        return leaves
    gs, ws = g2.reshape(m, parts, chunks, n), weight.reshape(parts, chunks, n, k)
    leaves = torch.bmm(gs[:, 0].transpose(0, 1), ws[0])
    for p in range(1, parts):
        leaves.add_(torch.bmm(gs[:, p].transpose(0, 1), ws[p]))
    return list(leaves.unbind(0))


def column_grad_weight(g2: torch.Tensor, x2: torch.Tensor, chunks: int) -> torch.Tensor:
    """The weight's gradient of a column layer: chunk c's ``g_c^T x``, stacked, (N, K)."""
    (m, rows), k = g2.shape, x2.shape[1]
    n = rows // chunks
    if not batched(g2, n, m, k):
        return torch.cat([g.contiguous().t() @ x2 for g in g2.chunk(chunks, 1)], dim=0)
    return torch.bmm(g2.reshape(m, chunks, n).permute(1, 2, 0), x2.expand(chunks, m, k)).view(rows, k)


def column_grad_bias(g2: torch.Tensor, chunks: int) -> torch.Tensor:
    """The bias's gradient of a column layer: chunk c's column sums over its own rows, each chunk made contiguous
    (one shape anywhere), laid side by side, (N,). On one intra-op thread the chunks go in one contiguous copy,
    chunk after chunk, summed over their rows in one call, which runs each chunk as it runs it alone."""
    m, rows = g2.shape
    if not one_thread_cpu(g2):
        return torch.cat([g.contiguous().sum(0) for g in g2.chunk(chunks, 1)])
    return g2.reshape(m, chunks, rows // chunks).transpose(0, 1).contiguous().sum(1).view(rows)


def row_forward(x2: torch.Tensor, weight: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    """A row layer's partial products, one leaf a chunk of K: ``x_c W_c^T``, (M, N) each."""
    (m, k), n = x2.shape, weight.shape[0]
    kc = k // chunks
    if not batched(x2, m, kc, n):
        ws = [w.contiguous() for w in weight.chunk(chunks, 1)]
        return [xc.contiguous() @ wc.t() for xc, wc in zip(x2.chunk(chunks, 1), ws)]
    return list(
        torch.bmm(x2.reshape(m, chunks, kc).transpose(0, 1), weight.reshape(n, chunks, kc).permute(1, 2, 0)).unbind(0)
    )


def row_grad_input(g2: torch.Tensor, weight: torch.Tensor, chunks: int) -> torch.Tensor:
    """The input's gradient of a row layer: ``g W_c`` for each chunk c of K, side by side, (M, K)."""
    (m, n), k = g2.shape, weight.shape[1]
    kc = k // chunks
    if not batched(g2, m, n, kc):
        return torch.cat([g2 @ w.contiguous() for w in weight.chunk(chunks, 1)], dim=1)
    out = torch.bmm(g2.expand(chunks, m, n), weight.reshape(n, chunks, kc).transpose(0, 1))
    return out.transpose(0, 1).reshape(m, k)


def row_grad_weight(g2: torch.Tensor, x2: torch.Tensor, chunks: int) -> torch.Tensor:
    """The weight's gradient of a row layer: ``g^T x_c`` for each chunk c of K, side by side, (N, K)."""
    (m, n), k = g2.shape, x2.shape[1]
    kc = k // chunks
    if not batched(g2, n, m, kc):
        return torch.cat([g2.t() @ xc.contiguous() for xc in x2.chunk(chunks, 1)], dim=1)
    out = torch.bmm(g2.t().expand(chunks, n, m), x2.reshape(m, chunks, kc).transpose(0, 1))
    return out.transpose(0, 1).reshape(n, k)

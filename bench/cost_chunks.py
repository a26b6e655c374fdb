"""What the fixed chunks of canonical tensor parallelism cost on a GPU, estimated for a 7B and a 70B Llama
(docs/performance.md, its row "tensor parallelism's chunks on a GPU, projected"): the decoder layer's compute at
TP T, PyTorch's styles (one GEMM a linear a rank) against the canonical layers (``parallel.tp_chunks`` C: C / T GEMMs
of a chunk's width a linear a rank, and the tree sums of their partial products).

    .venv/bin/python bench/cost_chunks.py [--chunks 8] [--tokens 8192] [--seq 4096] [--tflops 989]
                                          [--efficiency 0.75] [--sms 132] [--launch-us 5] [--hbm-gbps 3000] [--json]

Assumptions (defaults: an H100 SXM in bf16): a GEMM of M x N outputs over K runs in waves of output tiles, each
wave one tile an SM (``--sms``), a tile's FLOPs at ``--efficiency`` of the peak shared by the SMs times the
tile's own efficiency (``TILES``: a smaller tile fills more SMs at a lower rate), the fastest tile taken (as
cuBLAS's heuristics pick one), never faster than its operands' bytes at ``--hbm-gbps``, plus ``--launch-us``;
a tree sum of two bf16 tensors reads both and writes one at ``--hbm-gbps``. A linear of the layer (q, k and v,
the output projection, gate, up, down) runs its forward, input-gradient and weight-gradient GEMMs; k and v are
two projections on both sides (separate GEMMs, their input gradients added); the canonical forward of a
row-parallel layer and backward of a column-parallel one sum a rank's chunks (C / T - 1 adds of the
activation); the attention (flash attention, its FLOPs at the same rate, the
backward 2.5 times the forward) and the cross-rank sums (``cost_model.py --tp``) are alike in both and only the
first is counted here. Not modelled: the GEMMs' overlap with communication, kernels that fuse the sums into
the GEMM's epilogue, fp32 accumulation of the sums.
"""

from __future__ import annotations

import argparse
import math
import sys

from cost_model import report  # bench/ is this script's directory

MODELS = {  # Llama 2: hidden, MLP width, heads, kv heads, layers
    "7B": (4096, 11008, 32, 32, 32),
    "70B": (8192, 28672, 64, 8, 80),
}


TILES = ((128, 256, 1.0), (128, 128, 0.9), (64, 128, 0.8), (64, 64, 0.65))  # rows, columns, rate


def gemm_ms(m: int, n: int, k: int, a: argparse.Namespace) -> float:
    """One GEMM of (m x k) @ (k x n), in ms, by the waves-and-bytes model of the module's docstring."""
    compute = min(
        math.ceil(math.ceil(m / tm) * math.ceil(n / tn) / a.sms)
        * 2
        * tm
        * tn
        * k
        / (a.tflops * 1e12 * a.efficiency * rate / a.sms)
        for tm, tn, rate in TILES
    )
    memory = 2 * (m * k + k * n + m * n) / (a.hbm_gbps * 1e9)
    return 1e3 * max(compute, memory) + a.launch_us * 1e-3


def add_ms(elements: int, a: argparse.Namespace) -> float:
    return 1e3 * 3 * 2 * elements / (a.hbm_gbps * 1e9) + a.launch_us * 1e-3


def linear_ms(m: int, k: int, n: int, t: int, column: bool, parts: int, a: argparse.Namespace) -> tuple[float, float]:
    """(PyTorch's styles, canonical) ms of one linear's forward and backward on a rank: ``k`` in, ``n`` out (in
    ``parts`` projections), column- or row-parallel at TP ``t``."""
    local = a.chunks // t  # chunks a rank holds
    if column:  # split along n: a chunk is n / chunks of each projection

        def three(width: int) -> float:  # forward, input gradient, weight gradient
            return gemm_ms(m, width, k, a) + gemm_ms(m, k, width, a) + gemm_ms(width, k, m, a)

        plain = parts * three(n // (t * parts)) + (parts - 1) * add_ms(m * k, a)
        pieces = local * parts
        return plain, pieces * three(n // (a.chunks * parts)) + (pieces - 1) * add_ms(m * k, a)
    plain = gemm_ms(m, n, k // t, a) + gemm_ms(m, k // t, n, a) + gemm_ms(n, k // t, m, a)
    width = k // a.chunks  # row: split along k
    canonical = local * (gemm_ms(m, n, width, a) + gemm_ms(m, width, n, a) + gemm_ms(n, width, m, a))
    return plain, canonical + (local - 1) * add_ms(m * n, a)  # the output's chunks summed


def layer(name: str, t: int, a: argparse.Namespace) -> dict:
    hidden, mlp, heads, kv_heads, layers = MODELS[name]
    m, kv = a.tokens, 2 * hidden * kv_heads // heads
    linears = [
        (hidden, hidden, True, 1),
        (hidden, kv, True, 2),
        (hidden, hidden, False, 1),
        (hidden, mlp, True, 1),
        (hidden, mlp, True, 1),
        (mlp, hidden, False, 1),
    ]
    plain, canonical = (sum(x) for x in zip(*(linear_ms(m, k, n, t, c, p, a) for k, n, c, p in linears)))
    causal = 2 * m * a.seq * hidden / t  # flash attention's forward FLOPs a rank (half of the square)
    attention = 1e3 * 3.5 * causal / (a.tflops * 1e12 * a.efficiency)
    return {
        "model": name,
        "tp": t,
        "chunks_a_rank": a.chunks // t,
        "linears_ms_plain": plain,
        "linears_ms_canonical": canonical,
        "attention_ms": attention,
        "layers": layers,
        "linears_ratio": canonical / plain,
        "layer_ratio": (canonical + attention) / (plain + attention),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=8, help="parallel.tp_chunks")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of a microbatch")
    ap.add_argument("--seq", type=int, default=4096, help="tokens of a sequence (the attention's span)")
    ap.add_argument("--tflops", type=float, default=989.0, help="dense bf16 peak, TFLOP/s")
    ap.add_argument("--efficiency", type=float, default=0.75, help="of the peak, a GEMM's full waves")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--launch-us", type=float, default=5.0, help="a kernel's launch and tail")
    ap.add_argument("--hbm-gbps", type=float, default=3000.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = [layer(name, t, a) for name in MODELS for t in (1, 2, 4, 8) if a.chunks % t == 0]
    return report(
        rows,
        a.json,
        ["model", "TP", "chunks a rank", "linears a layer, PyTorch's / canonical", "attention", "linears", "layer"],
        lambda r: [
            r["model"],
            str(r["tp"]),
            str(r["chunks_a_rank"]),
            f"{r['linears_ms_plain']:.2f} / {r['linears_ms_canonical']:.2f} ms",
            f"{r['attention_ms']:.2f} ms",
            f"{r['linears_ratio']:.3f}x",
            f"{r['layer_ratio']:.3f}x",
        ],
    )


if __name__ == "__main__":
    sys.exit(main())

"""The Triton kernels agree bit for bit with the CPU path: on a GPU when there is one, else on CPU
tensors under TRITON_INTERPRET=1 (small sizes: the interpreter is slow)."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
triton = pytest.importorskip("triton")  # a test extra on Linux x86-64; no wheel elsewhere

import samestep.ops as ops  # noqa: E402
from samestep.ops import _impl  # noqa: E402
from samestep.testing import assert_replays_bit_exact, first_difference  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
G = torch.Generator().manual_seed(3)
V, D, N = 12, 40, 150


def _wide(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G) * torch.exp(torch.randn(*shape, generator=G) * 4)


IDX = torch.randint(0, V, (N,), generator=G)
IDX2D = torch.randint(0, V, (N, D), generator=G)
SRC, BASE = _wide(N, D), _wide(V, D)
TOK = torch.randint(0, N // 3, (N,), generator=G)
CASES = {
    "index_add": (lambda b, i, s: ops.index_add(b, 0, i, s), (BASE, IDX, SRC)),
    "scatter_add": (lambda b, i, s: ops.scatter_add(b, 0, i, s), (BASE, IDX2D, SRC)),
    "scatter_reduce_mean": (lambda b, i, s: ops.scatter_reduce(b, 0, i, s, "mean"), (BASE, IDX2D, SRC)),
    "index_put": (lambda b, i, s: ops.index_put(b, (i,), s, accumulate=True), (BASE, IDX, SRC)),
    "embedding_backward": (lambda i, s: ops.embedding_backward(s, i, V), (IDX, SRC)),
    "bincount": (lambda i, w: ops.bincount(i, w, minlength=V), (IDX, SRC[:, 0].contiguous())),
    "segment_sum": (lambda s, i: ops.segment_sum(s, i, V), (SRC, IDX)),
    "moe_combine": (lambda e, t, w: ops.moe_combine(e, t, w, N // 3), (SRC, TOK, torch.rand(N, generator=G))),
}


@pytest.fixture
def backend():
    def use(name: str) -> None:
        _impl.BACKEND = name

    yield use
    _impl.BACKEND = "auto"


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_matches_cpu_bit_for_bit(backend, name):
    """The Triton kernel's bits equal the CPU path's (the same left fold), and repeat across replays."""
    fn, inputs = CASES[name]
    backend("torch")
    cpu = fn(*inputs)
    backend("triton")
    dev_inputs = [x.to(DEVICE) for x in inputs]
    got = fn(*dev_inputs).cpu()
    assert first_difference(got, cpu) is None
    assert_replays_bit_exact(fn, *dev_inputs, replays=2, contention=False)

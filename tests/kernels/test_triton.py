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
from tests.kernels.cases import make_cases  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
CASES = make_cases(12, 40, 150, seed=3)  # small: the interpreter runs kernels in Python


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


@pytest.mark.parametrize("strategy", ["slots", "sorted"])
def test_both_strategies_past_one_tile(backend, monkeypatch, strategy):
    """Past TILE sources both Triton strategies (private slots per tile; sorted segments) give the CPU
    path's tile-tree bits."""
    from samestep.ops import triton_kernels

    if strategy == "sorted":
        monkeypatch.setattr(triton_kernels, "SLOT_LIMIT", 0)  # force the other strategy at this size
    g = torch.Generator().manual_seed(11)
    n = _impl.TILE + 3000
    idx = torch.randint(0, 5, (n,), generator=g)
    src = torch.randn(n, 2, generator=g) * torch.exp(torch.randn(n, 2, generator=g) * 4)
    base = torch.randn(5, 2, generator=g)
    backend("torch")
    cpu = ops.index_add(base, 0, idx, src)
    backend("triton")
    got = ops.index_add(base.to(DEVICE), 0, idx.to(DEVICE), src.to(DEVICE)).cpu()
    assert first_difference(got, cpu) is None

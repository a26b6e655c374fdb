"""The Triton kernels agree bit for bit with the CPU path: on a GPU when there is one, else on CPU
tensors under TRITON_INTERPRET=1 (small sizes: the interpreter is slow)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined (tests/conftest.py sets it first)
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
    path's tile-tree bits. Under the interpreter the tile is 1024 sources (both paths read TILE when
    called); on a GPU the real one."""
    from samestep.ops import triton_kernels

    if not HAS_CUDA:
        monkeypatch.setattr(_impl, "TILE", 1024)  # the interpreter runs each program in Python
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


def test_digest_kernel_matches_the_other_paths(monkeypatch):
    """The fused digest kernel (digests.triton_rows) gives the default path's digests bit for bit: extreme
    words, rows across program blocks, a short last row, the higher levels, packed small tensors; a
    flipped bit shows (negative control)."""
    dg = importlib.import_module("samestep.digests")
    rows = importlib.import_module("samestep.digests.rows")
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (41 * 512 + 7,), dtype=torch.uint8, generator=g)
    data[:512] = 0x80  # words 0x8080 (-32640), then 0x7F7F, -1 and 0 rows
    data[512:1024] = 0x7F
    data[1024:1536] = 0xFF
    data[1536:2048] = 0x00
    data[2048:2050] = torch.tensor([0x00, 0x80], dtype=torch.uint8)  # -32768
    data[2050:2052] = torch.tensor([0xFF, 0x7F], dtype=torch.uint8)  # 32767
    tensors = [data, torch.randn(3000, generator=g), torch.tensor(2.5), torch.empty(0), torch.randn(40, 17).t()]
    ref = [dg.digest(t) for t in tensors]  # the default path on CPU
    monkeypatch.setattr(rows, "TRITON", "on")
    assert [dg.digest(t.to(DEVICE)) for t in tensors] == ref
    assert dg.digest_many([t.to(DEVICE) for t in tensors]) == ref
    flipped = data.clone()
    flipped[4321] ^= 1
    assert dg.digest(flipped.to(DEVICE)) != ref[0]

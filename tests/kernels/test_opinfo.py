"""samestep's kernels pass PyTorch's own OpInfo tests: every sample, reference and error input of every
op whose forward or backward reaches an accumulating op, in every CPU dtype, routed and direct.

The float32 slice runs by default; the whole sweep carries the ``opinfo`` marker (``make test`` runs it,
``make test-fast`` leaves it out)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import opinfo


def _params():
    for name, dtype in opinfo.cases():
        marks = () if dtype == torch.float32 else (pytest.mark.opinfo,)
        yield pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}", marks=marks)


@pytest.mark.parametrize(("name", "dtype"), list(_params()))
def test_matches_pytorch(name, dtype):
    """Outputs, gradients, dtypes, strides and errors are PyTorch's; bytes repeat over reruns and threads."""
    found = []
    for label, sample, grad in opinfo.samples(name, dtype):
        found += [f"{label}: {why}" for why in opinfo.check_sample(name, sample, grad, dtype)]
    assert not found, f"{len(found)} departures from PyTorch:\n" + "\n".join(found[:20])


@pytest.mark.parametrize("name", [n for n in opinfo.SWEPT if opinfo.DB[n].error_inputs_func is not None])
def test_error_inputs(name):
    """Each OpInfo error input raises PyTorch's error, routed and direct."""
    found = opinfo.check_error_inputs(name)
    assert not found, "\n".join(found)


def test_the_sweep_catches_a_wrong_kernel(monkeypatch):
    """Negative control: a kernel that drops the last contribution of every sum is reported."""
    from samestep.ops import _impl

    right = _impl.fold

    def drops_last(out, dim, index, source, alpha=1):
        n = index.numel()
        return right(out, dim, index.reshape(-1)[:-1], source.narrow(dim, 0, n - 1), alpha) if n > 1 else out

    monkeypatch.setattr(_impl, "fold", drops_last)
    found = []
    for label, sample, grad in opinfo.samples("index_add", torch.float32):
        found += opinfo.check_sample("index_add", sample, grad, torch.float32)
    assert any("routed output" in f for f in found) and any("direct output" in f for f in found)

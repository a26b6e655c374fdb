"""The vocabulary-parallel embedding's arithmetic, rank by rank in one process: a rank with group None is rank
0, so rank r of T is the lookup of ids shifted down by r V/T in its slice of the rows (ids of other ranks fall
outside it, as they do on rank r). The ranks' outputs summed in rank order (the all-reduce, exact in any
order) and their gradients side by side are the unsplit embedding's bits; the same run with gloo at TP 2 and
4 is tests/integration/test_tp_training.py."""

from __future__ import annotations

import pytest
import torch

from samestep import ops
from samestep.distributed import vocab_parallel_embedding

V, C = 256, 4
N = 140_000  # tokens: more than two of the fold's tiles (ops._impl.TILE, 65,536 contributions)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


@pytest.fixture(scope="module")
def case():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(V, C, generator=g)
    weight[::7, 1] = -0.0  # a -0.0 comes out as -0.0 only if the other ranks add -0.0
    idx = torch.randint(0, V, (N,), generator=g)
    grad_out = torch.randn(N, C, generator=g)
    return weight, idx, grad_out


def _rank(weight: torch.Tensor, idx: torch.Tensor, grad_out: torch.Tensor, degree: int, r: int):
    rows = V // degree
    w = weight[r * rows : (r + 1) * rows].clone().requires_grad_()
    out = vocab_parallel_embedding(idx - r * rows, w)
    out.backward(grad_out)
    return out.detach(), w.grad


@pytest.mark.parametrize("degree", [2, 4])
def test_ranks_give_the_unsplit_output_and_weight_gradient_bits(case, degree):
    """Output: each rank's lookups plus -0.0s, summed in rank order, are weight[idx]'s bits; weight gradient:
    the ranks' rows are the unsplit fold's."""
    weight, idx, grad_out = case
    whole, whole_grad = _rank(weight, idx, grad_out, 1, 0)
    assert torch.equal(_bits(whole), _bits(weight[idx]))
    parts = [_rank(weight, idx, grad_out, degree, r) for r in range(degree)]
    summed = parts[0][0].clone()
    for out, _ in parts[1:]:
        summed += out
    assert torch.equal(_bits(summed), _bits(whole))
    assert torch.equal(_bits(torch.cat([grad for _, grad in parts])), _bits(whole_grad))


def test_zeros_for_other_ranks_or_a_fold_over_a_ranks_own_tokens_give_other_bits(case):
    """Negative controls at TP 2: +0.0 for the tokens of other ranks (PyTorch's masked embedding) turns a
    -0.0 into +0.0, and folding only the tokens a rank holds (the others left out, not sent to a spare row)
    puts other contributions in each tile, which gives other gradient bits than unsplit."""
    weight, idx, grad_out = case
    whole, whole_grad = _rank(weight, idx, grad_out, 1, 0)
    mine = idx < V // 2
    zero_filled = weight[idx.clamp(max=V // 2 - 1)].masked_fill(~mine.unsqueeze(-1), 0.0)
    other = weight[(idx - V // 2).clamp(min=0)].masked_fill(mine.unsqueeze(-1), 0.0)
    assert not torch.equal(_bits(zero_filled + other), _bits(whole))
    own = ops.index_add(torch.zeros(V // 2, C), 0, idx[mine], grad_out[mine])
    assert not torch.equal(_bits(own), _bits(whole_grad[: V // 2]))

"""The canonical reduction tree (single process; the multi-process combine is in tests/integration)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from samestep.distributed import CanonicalGradients, validate_layout
from samestep.distributed.tree import BinaryCounter, canonical_sum


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _leaves(n: int, seed: int, size: int = 257) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # A wide dynamic range makes every bracketing produce different bits somewhere.
    return [torch.randn(size, generator=g) * torch.exp(torch.randn(size, generator=g) * 6) for _ in range(n)]


def _layout_sum(leaves: list[torch.Tensor], world: int) -> torch.Tensor:
    """What `world` processes compute: per-rank counters over aligned ranges, then a counter over ranks."""
    k = len(leaves) // world
    blocks = [canonical_sum(leaves[r * k : (r + 1) * k]) for r in range(world)]
    counter = BinaryCounter()
    for b in blocks:
        counter.push(b, size=k)
    return counter.result()


def test_tree_over_eight_is_the_documented_bracketing():
    """N=8 sums as ((m0+m1)+(m2+m3))+((m4+m5)+(m6+m7)); a left fold differs (negative control)."""
    m = _leaves(8, 0)
    tree = ((m[0] + m[1]) + (m[2] + m[3])) + ((m[4] + m[5]) + (m[6] + m[7]))
    assert torch.equal(_bits(canonical_sum(m)), _bits(tree))
    fold = m[0].clone()
    for t in m[1:]:
        fold = fold + t
    assert not torch.equal(_bits(fold), _bits(tree))


def test_non_power_of_two_count_combines_leftover_blocks():
    """N=6 is (block 0..3) + (block 4..5); N=7 is (0..3) + ((4..5) + 6)."""
    m = _leaves(7, 1)
    six = ((m[0] + m[1]) + (m[2] + m[3])) + (m[4] + m[5])
    seven = ((m[0] + m[1]) + (m[2] + m[3])) + ((m[4] + m[5]) + m[6])
    assert torch.equal(_bits(canonical_sum(m[:6])), _bits(six))
    assert torch.equal(_bits(canonical_sum(m)), _bits(seven))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), log_n=st.integers(0, 4))
def test_every_aligned_layout_gives_the_same_bits(seed, log_n):
    """(1 x N), (2 x N/2), ... (N x 1) all give the single-process bits."""
    n = 2**log_n
    leaves = _leaves(n, seed, size=33)
    reference = canonical_sum(leaves)
    for world in (w for w in (1, 2, 4, 8, 16) if n % w == 0):
        assert torch.equal(_bits(_layout_sum(leaves, world)), _bits(reference)), world


def test_three_processes_of_two_match_one_process():
    """A non-power-of-two world size with power-of-two ranges is still a subtree decomposition."""
    leaves = _leaves(6, 2)
    assert torch.equal(_bits(_layout_sum(leaves, 3)), _bits(canonical_sum(leaves)))


def test_unsupported_layout_is_refused_with_alternatives():
    """3 processes x 3 microbatches is not aligned; the error names supported layouts of the same batch."""
    validate_layout(4, 2)
    validate_layout(1, 3)
    validate_layout(3, 2)
    with pytest.raises(ValueError) as err:
        validate_layout(3, 3)
    msg = str(err.value)
    assert "3 processes x 3 microbatches" in msg and "--nproc 1 (9 microbatches per process)" in msg


def test_accumulate_checks_the_microbatch_order():
    """Gradients must arrive in this rank's global index order; reduce() needs all of them."""
    p = torch.nn.Parameter(torch.zeros(3))
    grads = CanonicalGradients([p], microbatches_per_process=2, world_size=2, rank=1)
    assert list(grads.microbatches) == [2, 3]
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="expects global index 2"):
        grads.accumulate(0)
    grads.accumulate(2, extra=torch.tensor(1.5))
    with pytest.raises(RuntimeError, match="after 1 of 2"):
        grads.reduce()


def test_the_second_of_a_pair_adds_into_the_first_with_the_trees_bits():
    """Autograd adds the second microbatch of each pair into the first's gradients in place: the result has
    the bits of the canonical tree over the leaves, also for a parameter that got no gradient in the first
    (it sums as zeros: 0 + (-0.0) is +0.0, as the combine of two processes makes it). Negative control:
    taking the second microbatch's gradient as it is keeps the -0.0."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    c = torch.tensor([-0.0, 1.5, -2.25])
    grads = CanonicalGradients([a, b], microbatches_per_process=4)
    leaves_a, leaves_b = [], []
    for i in range(4):
        scale = torch.tensor([0.1, 1e-8, 3e7]) * (i + 1)
        loss = (a * scale).sum() + ((b * c * (i + 1)).sum() if i % 2 else 0)
        loss.backward()
        leaves_a.append(scale)
        leaves_b.append(c * (i + 1) if i % 2 else torch.zeros(3))
        grads.accumulate(i)
    grads.reduce()
    assert torch.equal(_bits(a.grad), _bits(canonical_sum(leaves_a)))
    assert torch.equal(_bits(b.grad), _bits(canonical_sum(leaves_b)))
    assert _bits(b.grad)[0] == 0  # +0.0
    assert _bits(c)[0] != 0  # the negative control: -0.0 as the second microbatch's own gradient


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(0, 12))
def test_fold_into_is_push_then_result_for_one_element_of_the_leaves(seed, n):
    """A parameter's part of the final sum, made as soon as its last leaf exists (the combine's overlap),
    has the bits of pushing that leaf and taking the result, and leaves the counter as it was; a missing
    leaf sums as a zero tensor. Negative control: the same leaves folded from the bottom of the stack up
    (another bracketing) differ."""
    leaves = [[x, x * 3] for x in _leaves(n + 1, seed, size=65)]
    counter = BinaryCounter()
    for leaf in leaves[:-1]:
        counter.push([t.clone() for t in leaf])
    out = torch.empty(65)
    for index in (0, 1):
        expected = BinaryCounter()
        for leaf in leaves:
            expected.push(leaf[index].clone())
        assert torch.equal(_bits(counter.fold_into(out, leaves[-1][index], index=index)), _bits(expected.result()))
        zeros = BinaryCounter()
        for leaf in [*leaves[:-1], [torch.zeros(65), torch.zeros(65)]]:
            zeros.push(leaf[index].clone())
        assert torch.equal(_bits(counter.fold_into(out, None, index=index)), _bits(zeros.result()))
    assert torch.equal(
        _bits(canonical_sum([leaf[0] for leaf in leaves])), _bits(counter.fold_into(out, leaves[-1][0], index=0))
    )  # the counter is unchanged
    if n >= 3:  # from four leaves on, the tree is not the left fold
        bottom_up = leaves[0][0].clone()
        for leaf in leaves[1:]:
            bottom_up = bottom_up + leaf[0]
        assert not torch.equal(_bits(bottom_up), _bits(counter.fold_into(out, leaves[-1][0], index=0)))

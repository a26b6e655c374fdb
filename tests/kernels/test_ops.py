"""samestep.ops byte for byte: replays under contention, thread counts, a left-fold reference,
golden digests, the manifest, and the negative control that PyTorch's default path races."""

from __future__ import annotations

import re

import pytest
import torch

import samestep
import samestep.ops as ops
from samestep.digests import digest_many
from samestep.testing import assert_replays_bit_exact, count_differing_replays, first_difference
from tests.kernels.cases import make_cases

RACE_ATTEMPTS = 25  # sets of replays a negative control runs until the race shows (a busy machine hides it)
V, D, N = 256, 128, 2048  # N * D >= 32768: PyTorch's CPU index_put_ accumulate races at this size
CASES = make_cases(V, D, N, seed=0)
BASE, IDX, SRC = CASES["index_add"][1]
G = torch.Generator().manual_seed(1)


def _wide(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G) * torch.exp(torch.randn(*shape, generator=G) * 4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_replays_bit_exact(name):
    """Replays under contention and at 1, 2 and 4 threads give the same bits."""
    fn, inputs = CASES[name]
    assert_replays_bit_exact(fn, *inputs, replays=6, contention=True)
    threads = torch.get_num_threads()
    try:
        per_threads = set()
        for t in (1, 2, 4):
            torch.set_num_threads(t)
            per_threads.add(tuple(digest_many([fn(*inputs)])))
    finally:
        torch.set_num_threads(threads)
    assert len(per_threads) == 1


def test_pytorch_default_index_put_races():
    """Negative control: PyTorch's default index_put_(accumulate=True) differs between replays here."""
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(2)

    def racy(b, i, s):
        return b.clone().index_put_((i,), s, accumulate=True)

    assert count_differing_replays(racy, BASE, IDX, SRC, replays=8, attempts=RACE_ATTEMPTS) > 0
    for _ in range(RACE_ATTEMPTS):  # the check catches a race once it happens; under load it may take a few sets
        try:
            assert_replays_bit_exact(racy, BASE, IDX, SRC, replays=8)
        except AssertionError as e:
            assert re.match(r"output 0 of replay \d+ differs from replay 0: \d+ of \d+ elements", str(e)), str(e)
            break
    else:
        pytest.fail(f"index_put_(accumulate=True) did not race in {RACE_ATTEMPTS} sets of 8 replays")


def _left_fold(base: torch.Tensor, targets: list[tuple[int, ...]], values: list[torch.Tensor]) -> torch.Tensor:
    out = base.clone()
    for t, v in zip(targets, values):  # one addition at a time, in ascending source order
        out[t] = out[t] + v
    return out


@pytest.mark.parametrize("name", ["index_add", "scatter_add"])
def test_matches_left_fold_reference(name):
    """The documented definition: input, then contributions added one by one in ascending source order."""
    g = torch.Generator().manual_seed(5)
    base, src = _wide(6, 3), _wide(40, 3)
    if name == "index_add":
        idx = torch.randint(0, 6, (40,), generator=g)
        got = ops.index_add(base, 0, idx, src)
        ref = _left_fold(base, [(int(i),) for i in idx], list(src))
    else:
        idx = torch.randint(0, 6, (40, 3), generator=g)
        got = ops.scatter_add(base, 0, idx, src)
        targets = [(int(idx[r, c]), c) for r in range(40) for c in range(3)]
        ref = _left_fold(base, targets, [src[r, c] for r in range(40) for c in range(3)])
    assert first_difference(got, ref) is None


def test_index_put_is_the_backward_of_indexing():
    """With kernels routed, the gradient of x[idx] is bit-identical to ops.index_put and repeats exactly."""

    def grad_of_indexing(src):
        w = torch.zeros(V, D, requires_grad=True)
        (w[IDX] * src).sum().backward()
        return w.grad

    with samestep.enable(threads=2, kernels=True):
        assert_replays_bit_exact(grad_of_indexing, SRC, replays=4)
        routed = grad_of_indexing(SRC)
    assert first_difference(routed, ops.index_put(torch.zeros(V, D), (IDX,), SRC, accumulate=True)) is None


def test_routing_makes_a_racy_model_repeat():
    """Deterministic algorithms off but kernels routed: the racing index_put_ now repeats (and without
    routing it races: the negative control)."""

    def step(src):
        w = torch.zeros(V, D, requires_grad=True)
        (w[IDX] * src).sum().backward()
        return w.grad

    torch.set_num_threads(2)
    assert count_differing_replays(step, SRC, replays=8, attempts=RACE_ATTEMPTS) > 0
    from samestep.ops.routing import KernelMode

    with KernelMode():
        assert count_differing_replays(step, SRC, replays=8) == 0


def test_moe_combine_gradients():
    """moe_combine's gradients equal autograd through the composite definition, bit for bit."""
    e = SRC[:64].clone().requires_grad_()
    w = torch.rand(64, generator=G).requires_grad_()
    t = torch.randint(0, 16, (64,), generator=G)
    ops.moe_combine(e, t, w, 16).pow(2).sum().backward()
    e2, w2 = e.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.zeros(16, D).index_add(0, t, e2 * w2.unsqueeze(-1)).pow(2).sum().backward()
    assert first_difference(e.grad, e2.grad) is None and first_difference(w.grad, w2.grad) is None


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_digests(golden, name):
    """Pinned per environment: a torch upgrade that moves these bits fails here. Where this environment has none
    pinned, skipped with the reason (record with --samestep-update-golden): tests/unit/test_golden.py."""
    fn, inputs = CASES[name]
    golden.check(name, fn(*inputs))


def test_every_op_has_byte_for_byte_tests(request):
    """The kernel manifest lists tests for every public op, and every listed test exists."""
    public = {n for n in ops.__all__ if n != "KERNELS"}
    assert public == set(ops.KERNELS), f"ops without a manifest entry: {sorted(public - set(ops.KERNELS))}"
    collected = {item.nodeid for item in request.session.items}
    files = {i.partition("::")[0] for i in collected}
    for op, tests in ops.KERNELS.items():
        assert tests, f"samestep.ops.{op} has no byte-for-byte test"
        # Only files collected in this session can be checked (a run may select a subset).
        missing = [t for t in tests if t.partition("::")[0] in files and t not in collected]
        assert not missing, f"samestep.ops.{op}: manifest names tests that do not exist: {missing}"


def _tile_tree_reference(base: torch.Tensor, idx: torch.Tensor, src: torch.Tensor, tile: int) -> torch.Tensor:
    """docs/kernels.md's tile tree with numpy float32 row additions, one at a time."""
    out = base.numpy().copy()
    x, rows = src.numpy(), idx.tolist()
    for a in range(0, len(rows), tile):
        if a == 0:
            for s in range(min(tile, len(rows))):
                out[rows[s]] = out[rows[s]] + x[s]
            continue
        sums: dict[int, object] = {}
        for s in range(a, min(a + tile, len(rows))):
            r = rows[s]
            sums[r] = x[s].copy() if r not in sums else sums[r] + x[s]
        for r in sorted(sums):
            out[r] = out[r] + sums[r]
    return torch.from_numpy(out)


@pytest.mark.parametrize("buffer", ["slots", "compact"])
def test_more_sources_than_a_tile_follow_the_tile_tree(monkeypatch, buffer):
    """Past TILE sources, later tiles are summed on their own first, then added in tile order (reference),
    by either buffer of the CPU path; the plain left fold gives other bits here (so the test can tell the
    two apart)."""
    from samestep.ops import _impl

    if buffer == "compact":
        monkeypatch.setattr(_impl, "SLOT_LIMIT", 0)
    g = torch.Generator().manual_seed(9)
    n = _impl.TILE * 2 + 1000
    idx = torch.randint(0, 7, (n,), generator=g)
    src = torch.randn(n, 2, generator=g) * torch.exp(torch.randn(n, 2, generator=g) * 4)
    base = torch.randn(7, 2, generator=g)
    got = ops.index_add(base, 0, idx, src)
    assert first_difference(got, _tile_tree_reference(base, idx, src, _impl.TILE)) is None
    assert first_difference(got, base.clone().index_add_(0, idx, src)) is not None


def test_routed_bincount_and_put_run_pytorchs_own_loop_where_it_is_the_definition():
    """Routed weighted bincount past one tile (PyTorch's serial call per tile, from +0.0, the tile sums added
    in order) gives the tile tree's bits, a bin of -0.0 weights included; PyTorch's bincount over all sources,
    one left fold, gives other bits (the control). Routed put_ of one tile with deterministic algorithms on
    (PyTorch's serial loop, negative positions included) gives the left fold's bits; with them off it is not
    left to PyTorch."""
    from samestep.ops import _impl, _indexing
    from samestep.ops.routing import KernelMode

    g = torch.Generator().manual_seed(5)
    n = _impl.TILE * 2 + 500
    idx = torch.randint(0, 7, (n,), generator=g)
    w = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    w[idx == 5] = -0.0
    want = _tile_tree_reference(torch.zeros(8, 1), idx, w.view(-1, 1), _impl.TILE).view(-1)
    with KernelMode():
        got = torch.bincount(idx, w, minlength=8)
    assert first_difference(got, want) is None
    assert first_difference(torch.bincount(idx, w, minlength=8), want) is not None

    x = torch.randn(7, 3, generator=g)
    flat = torch.randint(-21, 21, (_impl.TILE,), generator=g)
    s = torch.randn(_impl.TILE, generator=g) * torch.exp(torch.randn(_impl.TILE, generator=g) * 4)
    want = _tile_tree_reference(x.reshape(-1, 1), flat % 21, s.view(-1, 1), _impl.TILE).view(7, 3)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)  # PyTorch's put_ then splits over threads: left to the tile tree
    assert not _indexing.put_by_torch(x, flat)
    torch.use_deterministic_algorithms(True)
    try:
        assert _indexing.put_by_torch(x, flat)
        with KernelMode():
            got = x.clone().put_(flat, s, accumulate=True)
    finally:
        torch.use_deterministic_algorithms(before)
    assert first_difference(got, want) is None

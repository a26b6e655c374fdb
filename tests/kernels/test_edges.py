"""samestep's kernels at the edges OpInfo does not reach: boolean masks of several dimensions, bounds and
aliasing errors, empty and 0-dim tensors, more than a tile of duplicates into one slot, non-contiguous,
expanded and transposed operands, NaN, inf and -0.0, half precision, what routing warns about, and the
races the routing removes (with PyTorch's own race as the negative control)."""

from __future__ import annotations

import warnings

import pytest
import torch

import samestep
import samestep.ops as ops
from samestep.ops import _impl
from samestep.ops.routing import KernelMode
from samestep.testing import count_differing_replays, first_difference

G = torch.Generator().manual_seed(11)


def _wide(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=G) * torch.exp(torch.randn(*shape, generator=G) * 3)).to(dtype)


def _torch_deterministic(fn, *args):
    torch.use_deterministic_algorithms(True)
    try:
        return fn(*args)
    finally:
        torch.use_deterministic_algorithms(False)


def _raises_as_torch(call_ours, call_torch):
    """Ours raises PyTorch's exception type with PyTorch's message."""
    with pytest.raises(Exception) as theirs:
        call_torch()
    with pytest.raises(type(theirs.value)) as got:
        call_ours()
    assert str(got.value) == str(theirs.value)


# -- silently wrong answers ---------------------------------------------------------------------------
def test_multi_dimensional_mask_accumulates_into_the_masked_elements():
    """index_put_(accumulate=True) with a 2-d mask on a 3-d tensor, routed and direct, is PyTorch's answer
    bit for bit (one contribution per element); so is the backward of x[mask]."""
    x = _wide(4, 5, 3)
    mask = torch.rand(4, 5, generator=G) > 0.5
    values = _wide(int(mask.sum()), 3)
    want = _torch_deterministic(lambda: x.clone().index_put_((mask,), values, accumulate=True))
    with KernelMode():
        routed = x.clone().index_put_((mask,), values, accumulate=True)
    assert first_difference(routed, want) is None
    assert first_difference(ops.index_put(x, (mask,), values, accumulate=True), want) is None
    # a mask after a slice: x[:, mask2] with a 2-d mask over the last two dims
    mask2 = torch.rand(5, 3, generator=G) > 0.3
    v2 = _wide(4, int(mask2.sum()))
    want2 = _torch_deterministic(lambda: torch.ops.aten.index_put(x, [None, mask2], v2, True))
    assert first_difference(ops.index_put(x, (None, mask2), v2, accumulate=True), want2) is None

    def grad_of_masked(w):
        w = w.clone().requires_grad_()
        (w[mask] * values).sum().backward()
        return w.grad

    with KernelMode():
        routed_grad = grad_of_masked(x)
    assert first_difference(routed_grad, _torch_deterministic(grad_of_masked, x)) is None


@pytest.mark.parametrize("case", ["past the end", "negative", "index wider than input"])
def test_scatter_add_checks_bounds_as_pytorch_does(case):
    """An index out of bounds raises PyTorch's error (routed, direct) and leaves the input as it was."""
    x = torch.zeros(3, 4)
    index = {
        "past the end": torch.tensor([[3]]),
        "negative": torch.tensor([[-1]]),
        "index wider than input": torch.zeros(2, 5, dtype=torch.long),
    }[case]
    src = torch.ones(2, 5)
    _raises_as_torch(lambda: ops.scatter_add(x, 0, index, src), lambda: torch.scatter_add(x, 0, index, src))
    y = x.clone()
    with KernelMode():
        _raises_as_torch(lambda: y.scatter_add_(0, index, src), lambda: x.clone().scatter_add_(0, index, src))
    assert torch.equal(y, x)


def test_index_put_checks_bounds_and_dtypes_as_pytorch_does():
    """Out of range raises IndexError (no wrap-around); a negative index in range counts from the end;
    values of another dtype raise PyTorch's RuntimeError, not a silent cast."""
    x = torch.zeros(3, 4)
    for idx in (torch.tensor([3]), torch.tensor([-4]), torch.tensor([7])):
        _raises_as_torch(
            lambda: ops.index_put(x, (idx,), torch.ones(4), accumulate=True),
            lambda: torch.index_put(x, (idx,), torch.ones(4), accumulate=True),
        )
    _raises_as_torch(
        lambda: ops.index_put(x, (torch.tensor([0]), torch.tensor([7])), torch.ones(1), True),
        lambda: torch.index_put(x, (torch.tensor([0]), torch.tensor([7])), torch.ones(1), True),
    )
    _raises_as_torch(
        lambda: ops.index_put(x, (torch.tensor([0]),), torch.ones(4, dtype=torch.float64), True),
        lambda: torch.index_put(x, (torch.tensor([0]),), torch.ones(4, dtype=torch.float64), True),
    )
    got = ops.index_put(x, (torch.tensor([-1, 2]),), torch.ones(4), accumulate=True)
    assert torch.equal(got[2], torch.full((4,), 2.0)) and not got[:2].any()


def test_embedding_padding_row_takes_no_nan():
    """A NaN or inf gradient at a padding token leaves the padding row 0.0 (PyTorch's answer), routed and
    direct; the same NaN at another token reaches its row (the control: the check sees NaN)."""
    grad = _wide(6, 4)
    grad[1] = float("nan")
    grad[3] = float("inf")
    tokens = torch.tensor([0, 2, 1, 2, 0, 1])
    want = torch.ops.aten.embedding_dense_backward(grad, tokens, 3, 2, False)
    got = ops.embedding_backward(grad, tokens, 3, padding_idx=2)
    with KernelMode():
        routed = torch.ops.aten.embedding_dense_backward(grad, tokens, 3, 2, False)
    for result in (got, routed):
        assert first_difference(result, want) is None
        assert torch.equal(result[2], torch.zeros(4)) and result[2].signbit().logical_not().all()
    assert ops.embedding_backward(grad, tokens, 3, padding_idx=0)[2].isnan().all()


def test_index_add_into_itself_is_refused_in_place():
    """x.index_add_(0, idx, x) raises PyTorch's overlap error under routing; out of place it is fine."""
    x = _wide(3, 4)
    idx = torch.tensor([0, 1, 2])
    y = x.clone()
    with KernelMode(), pytest.raises(RuntimeError, match="refer to a single memory location"):
        y.index_add_(0, idx, y)
    assert first_difference(ops.index_add(x, 0, idx, x), torch.index_add(x, 0, idx, x)) is None


# -- the shapes that crashed ----------------------------------------------------------------------------
def test_empty_and_0_dim_operands():
    """Empty indices and sources, and 0-dim tensors, give PyTorch's answers."""
    x = _wide(3, 4)
    empty = torch.empty(0, dtype=torch.long)
    assert torch.equal(ops.index_add(x, 0, empty, torch.empty(0, 4)), x)
    assert torch.equal(ops.scatter_add(x, 0, torch.empty(0, 4, dtype=torch.long), torch.empty(0, 4)), x)
    assert torch.equal(ops.index_put(x, (torch.zeros(3, dtype=torch.bool),), torch.ones(4), True), x)
    assert ops.embedding_backward(torch.empty(0, 4), empty, 5).shape == (5, 4)
    assert torch.equal(ops.bincount(empty, torch.empty(0), minlength=3), torch.bincount(empty, torch.empty(0), 3))
    s = torch.tensor(2.5)
    assert torch.equal(ops.index_add(s, 0, torch.tensor([0]), torch.tensor(1.5)), torch.tensor(4.0))
    assert torch.equal(ops.scatter_add(s, 0, torch.tensor(0), torch.tensor(1.5)), torch.tensor(4.0))
    w = s.clone().requires_grad_()
    torch.gather(w, 0, torch.tensor(0)).backward()
    with KernelMode():
        w2 = s.clone().requires_grad_()
        torch.gather(w2, 0, torch.tensor(0)).backward()
    assert torch.equal(w.grad, w2.grad)


def test_integer_and_half_semantics():
    """ops.index_add on integers with alpha, bincount of int8/uint8 input and half weights, an integral
    scatter mean, and index_put on a transposed input: PyTorch's dtypes, values and strides."""
    xi = torch.arange(6).reshape(3, 2)
    idx = torch.tensor([0, 2, 0])
    src = torch.arange(6).reshape(3, 2)
    assert torch.equal(ops.index_add(xi, 0, idx, src, alpha=3), torch.index_add(xi, 0, idx, src, alpha=3))
    for dt in (torch.int8, torch.int16, torch.uint8):
        inp = torch.tensor([1, 3, 1, 0], dtype=dt)
        w = torch.tensor([0.5, 1.25, 2.0, 4.0], dtype=torch.float16)
        want = torch.bincount(inp, w)
        got = ops.bincount(inp, w)
        assert got.dtype == want.dtype == torch.float64 and torch.equal(got, want)
    mean_i = ops.scatter_reduce(xi, 0, torch.tensor([[0, 0], [0, 1]]), torch.tensor([[5, 7], [8, 9]]), "mean")
    want_i = torch.scatter_reduce(xi, 0, torch.tensor([[0, 0], [0, 1]]), torch.tensor([[5, 7], [8, 9]]), "mean")
    assert mean_i.dtype == want_i.dtype and torch.equal(mean_i, want_i)
    t = _wide(5, 3).t()
    got = ops.index_put(t, (torch.tensor([0, 2, 0]),), _wide(3, 5), accumulate=True)
    assert got.stride() == torch.index_put(t, (torch.tensor([0]),), _wide(1, 5), True).stride() == t.stride()


# -- beyond a tile, and odd layouts -----------------------------------------------------------------------
def test_more_than_a_tile_of_duplicates_into_one_slot():
    """70,000 contributions to one element follow the tile tree in index_add, scatter_add and index_put,
    alike and at 1 and 2 threads."""
    n = _impl.TILE + 4464
    src = _wide(n, 1)
    idx = torch.zeros(n, dtype=torch.long)
    base = _wide(1, 1)
    acc = base.clone()  # the tile tree written out: tile 0 onto the input, then tile 1's own sum
    for k in range(_impl.TILE):
        acc = acc + src[k]
    part = src[_impl.TILE].clone()
    for k in range(_impl.TILE + 1, n):
        part = part + src[k]
    want = acc + part
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results += [
            ops.index_add(base, 0, idx, src),
            ops.scatter_add(base, 0, idx.view(n, 1), src),
            ops.index_put(base, (idx,), src, accumulate=True),
        ]
    for r in results:
        assert first_difference(r, want) is None


def test_non_contiguous_expanded_and_transposed_operands():
    """Transposed inputs, expanded indices and sliced values give PyTorch's bits (its deterministic CPU
    kernels fold in the same order within a tile)."""
    base = _wide(8, 6)
    t_in = base.t()  # (6, 8), transposed
    idx = torch.randint(0, 6, (1,), generator=G).expand(40)  # one row, expanded: 40 duplicates
    src = _wide(40, 16)[:, ::2]  # sliced: stride 2
    want = _torch_deterministic(lambda: torch.index_add(t_in, 0, idx, src))
    assert first_difference(ops.index_add(t_in, 0, idx, src), want) is None
    idx2 = torch.randint(0, 6, (40, 8), generator=G)
    want = _torch_deterministic(lambda: torch.scatter_add(t_in, 0, idx2, src))
    assert first_difference(ops.scatter_add(t_in, 0, idx2, src), want) is None
    want = _torch_deterministic(lambda: torch.index_put(t_in, (idx,), src, True))
    got = ops.index_put(t_in, (idx,), src, accumulate=True)
    assert first_difference(got, want) is None and got.stride() == want.stride()
    cols = torch.randint(0, 8, (30,), generator=G)  # x[:, cols] += v: a slice before the index tensor
    v = _wide(6, 30)
    want = _torch_deterministic(lambda: torch.ops.aten.index_put(t_in, [None, cols], v, True))
    assert first_difference(ops.index_put(t_in, (None, cols), v, accumulate=True), want) is None
    rows, cols3 = torch.randint(0, 4, (5, 1), generator=G), torch.randint(0, 6, (1, 7), generator=G)
    x3 = _wide(4, 3, 6)  # x[rows, :, cols]: index tensors apart, broadcast to (5, 7)
    v3 = _wide(5, 7, 3)
    want = _torch_deterministic(lambda: torch.ops.aten.index_put(x3, [rows, None, cols3], v3, True))
    assert first_difference(ops.index_put(x3, (rows, None, cols3), v3, accumulate=True), want) is None


def test_nan_inf_and_signed_zero():
    """-0.0 stays -0.0 where nothing or -0.0 is added, inf + -inf is NaN, NaN propagates: PyTorch's bits."""
    base = torch.tensor([[-0.0], [-0.0], [1.0], [2.0]])
    src = torch.tensor([[-0.0], [float("inf")], [float("-inf")], [float("nan")]])
    idx = torch.tensor([0, 2, 2, 3])
    want = base.clone().index_add_(0, idx, src)
    for got in (
        ops.index_add(base, 0, idx, src),
        ops.index_put(base, (idx,), src, accumulate=True),
        ops.scatter_add(base, 0, idx.view(4, 1), src),
    ):
        assert first_difference(got, want) is None
    assert got[0].signbit() and got[1].signbit() and got[2].isnan() and got[3].isnan()


def test_half_precision_accumulates_in_float32():
    """bfloat16 sums accumulate in float32 and round once: samestep's bits equal that reference, and PyTorch's
    1-d index_add, which rounds at every addition, gives other bits here (the documented difference); so does
    PyTorch's 2-d index_add with an alpha other than 1, farther from the exact sum (with alpha 1: the same)."""
    n = 300
    idx = torch.randint(0, 3, (n,), generator=G)
    src = _wide(n, dtype=torch.bfloat16)
    base = _wide(3, dtype=torch.bfloat16)
    wide = base.float().index_add_(0, idx, src.float()).to(torch.bfloat16)
    per_step = base.clone()
    for k in range(n):
        per_step[idx[k]] = per_step[idx[k]] + src[k]
    assert first_difference(wide, per_step) is not None  # the two semantics differ on these inputs
    assert first_difference(ops.index_add(base, 0, idx, src), wide) is None
    assert first_difference(ops.index_put(base, (idx,), src, accumulate=True), wide) is None
    assert first_difference(base.clone().index_add_(0, idx, src), per_step) is None  # PyTorch's 1-d kernel
    # with alpha the sum is alpha times each contribution, in float32, rounded once: closer to the exact sum
    # than PyTorch's 2-d kernel, whose bits differ in most elements (the documented difference; alpha 1: equal)
    base2, src2 = _wide(3, 4, dtype=torch.bfloat16), _wide(n, 4, dtype=torch.bfloat16)
    exact = base2.double().index_add(0, idx, src2.double(), alpha=-1.7)
    ours = ops.index_add(base2, 0, idx, src2, alpha=-1.7)
    assert first_difference(ours, base2.float().index_add_(0, idx, src2.float(), alpha=-1.7).to(torch.bfloat16)) is None
    theirs = base2.clone().index_add_(0, idx, src2, alpha=-1.7)
    assert first_difference(ours, theirs) is not None
    assert (ours.double() - exact).abs().sum() < (theirs.double() - exact).abs().sum()
    assert first_difference(ops.index_add(base2, 0, idx, src2), base2.clone().index_add_(0, idx, src2)) is None


# -- routing: what races, what is refused or warned about -------------------------------------------------
def test_routing_removes_the_cpu_races():
    """With deterministic algorithms off, the accumulating forms that race on the CPU repeat under routing:
    x[:, idx] backward, put_(accumulate=True), take backward and _unsafe_masked_index_put_accumulate.
    Negative control: without routing, each of them races here."""
    v, d, n = 64, 256, 4096  # n * d >= 32768 elements: PyTorch's CPU kernel races at this size
    torch.use_deterministic_algorithms(False)
    torch.set_num_threads(2)
    src = _wide(n, d)
    idx = torch.randint(0, v, (n,), generator=G)
    flat = torch.randint(0, v * d, (n * d,), generator=G)
    mask = torch.ones(n, 1, dtype=torch.bool)

    def column_backward(s):
        w = torch.zeros(d, v, requires_grad=True)
        (w[:, idx] * s.t()).sum().backward()
        return w.grad

    def put(s):
        return torch.zeros(v, d).put_(flat, s.reshape(-1), accumulate=True)

    def take_backward(s):
        w = torch.zeros(v, d, requires_grad=True)
        (w.take(flat) * s.reshape(-1)).sum().backward()
        return w.grad

    def masked(s):
        return torch.ops.aten._unsafe_masked_index_put_accumulate(torch.zeros(v, d), mask, [idx], s)

    for fn in (column_backward, put, take_backward, masked):
        assert count_differing_replays(fn, src, replays=12, attempts=10) > 0, f"{fn.__name__} did not race unrouted"
        with KernelMode():
            assert count_differing_replays(fn, src, replays=6) == 0, fn.__name__


def test_unrouted_ops_warn_where_they_may_race():
    """An accumulating op left to PyTorch warns once by name on a device other than the CPU with
    deterministic algorithms off (meta stands in for one); on the CPU, or with them on, it is silent."""
    x, idx, src = torch.zeros(4, 3), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3)
    torch.use_deterministic_algorithms(False)
    with KernelMode(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        x.scatter_reduce(0, idx, src, "prod")
        m = x.to("meta")
        m.scatter_reduce(0, idx.to("meta"), src.to("meta"), "prod")
        m.scatter_reduce(0, idx.to("meta"), src.to("meta"), "amax")  # once per op
    named = [str(w.message) for w in seen if "aten.scatter_reduce" in str(w.message)]
    assert len(named) == 1 and "meta" in named[0]
    torch.use_deterministic_algorithms(True)
    with KernelMode(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        x.to("meta").scatter_reduce(0, idx.to("meta"), src.to("meta"), "prod")
    assert not [w for w in seen if "samestep kernels" in str(w.message)]


def test_a_0_dim_boolean_index_is_refused_by_name():
    """A 0-dim mask (x[True]) is outside the kernel: PyTorch's own error, or a refusal naming the op."""
    with pytest.raises((RuntimeError, NotImplementedError, IndexError)):
        ops.index_put(torch.zeros(3), (torch.tensor(True),), torch.ones(3), accumulate=True)


def test_enable_works_under_pytorch_test_scaffolding():
    """samestep.enable() sets and disable() restores its knobs while torch.backends flags are frozen, as
    PyTorch's test scaffolding freezes them."""
    before = torch.backends.cudnn.deterministic
    frozen = torch.backends.flags_frozen()
    torch.backends.disable_global_flags()
    try:
        with pytest.raises(RuntimeError, match="disable_global_flags"):  # the control: frozen they are
            torch.backends.cudnn.benchmark = False
        samestep.enable(threads=1)
        assert torch.backends.cudnn.deterministic
        samestep.disable()
        assert torch.backends.cudnn.deterministic == before
    finally:
        if not frozen:
            torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True


def test_docs_list_every_op_the_routing_decides():
    """docs/kernels.md's routing table names every op routed and every accumulating op left to PyTorch."""
    from pathlib import Path

    from samestep.ops.routing import ROUTED, UNROUTED

    text = (Path(__file__).parents[2] / "docs" / "kernels.md").read_text()
    table = text[text.index("## Routing") :]
    missing = [name for name in {*ROUTED, *UNROUTED} if f"`{name.removeprefix('aten.')}`" not in table]
    assert not missing, f"docs/kernels.md's routing table lacks {missing}"


@pytest.mark.parametrize("shape", [(1000, 64), (1000, 1), (1000,)], ids=["rows", "one-column", "vector"])
def test_index_add_with_alpha_is_pytorchs_bits(shape):
    """index_add with alpha=-0.1 in float32 (a tile's worth of sources, duplicates among them) is PyTorch's
    answer bit for bit, routed and direct: the scale goes into each add as PyTorch's kernel applies it (a fused
    multiply-add where its rows take add_, two roundings in its 1-d loop). Negative control: scaling the source
    first, then adding, differs from PyTorch by a ULP in thousands of elements of the rows."""
    x, src = _wide(*shape), _wide(*shape)
    index = torch.randint(0, shape[0], (shape[0],), generator=G)
    want = torch.index_add(x, 0, index, src, alpha=-0.1)
    assert torch.equal(ops.index_add(x, 0, index, src, alpha=-0.1).view(torch.int32), want.view(torch.int32))
    with samestep.enable(kernels=True):
        routed = torch.index_add(x, 0, index, src, alpha=-0.1)
    assert torch.equal(routed.view(torch.int32), want.view(torch.int32))
    if shape == (1000, 64):
        scaled_first = torch.index_add(x, 0, index, src * -0.1)
        assert int((scaled_first.view(torch.int32) != want.view(torch.int32)).sum()) > 1000


ROUTED_CALLS = {
    "index_add": lambda t, i, s: torch.index_add(t, 0, i, s),
    "scatter_add": lambda t, i, s: torch.scatter_add(t, 0, i.unsqueeze(1).expand(-1, 8), s),
    "scatter_reduce": lambda t, i, s: t.scatter_reduce(0, i.unsqueeze(1).expand(-1, 8), s, "mean"),
    "index_put accumulate": lambda t, i, s: t.index_put((i,), s, accumulate=True),
    "put accumulate": lambda t, i, s: t.put(i, s[:, 0], accumulate=True),
    "embedding backward": lambda t, i, s: torch.ops.aten.embedding_dense_backward(s, i, 50, -1, False),
}


@pytest.mark.parametrize("where", ["meta", "fake"])
def test_routed_ops_on_tensors_without_values_take_pytorchs_shapes(where):
    """Each routed op on meta tensors (a model built on the meta device) and under FakeTensorMode (a compiler
    tracing shapes) with kernels on gives PyTorch's own result's shape, dtype and device, with no value read;
    so does a GPT's forward and backward built on the meta device. Negative control: on real tensors the same
    calls reach samestep's kernels (counted)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from samestep.train import GPT, ModelConfig

    x, index, src = _wide(50, 8), torch.randint(0, 50, (40,), generator=G), _wide(40, 8)
    for name, call in ROUTED_CALLS.items():
        want = call(x, index, src)
        if where == "meta":
            args = (x.to("meta"), index.to("meta"), src.to("meta"))
            with samestep.enable(kernels=True):
                got = call(*args)
        else:
            with samestep.enable(kernels=True), FakeTensorMode() as fake:
                got = call(*(fake.from_tensor(t) for t in (x, index, src)))
        assert (got.shape, got.dtype) == (want.shape, want.dtype), name
        assert got.device.type == ("meta" if where == "meta" else "cpu"), name
    if where == "meta":
        with torch.device("meta"):
            model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, dropout=0.0), 64, 0)
        with samestep.enable(kernels=True):
            tokens = torch.zeros(2, 8, dtype=torch.long, device="meta")
            model(tokens, tokens, None)[1].backward()
        assert model.transformer.wte.weight.grad.device.type == "meta"
    calls = []
    folded = _impl.fold

    def counted(*args, **kwargs):
        calls.append(1)
        return folded(*args, **kwargs)

    _impl.fold = counted
    try:
        with samestep.enable(kernels=True):
            ROUTED_CALLS["index_add"](x, index, src)
    finally:
        _impl.fold = folded
    assert calls, "a routed op on real tensors did not reach samestep's kernel"


def _out_cases():
    """(name, functional call, out= call) for every out= overload of a routed op, on inputs where samestep
    computes the answer (index_put and put: bf16, which PyTorch's serial loop does not take)."""
    aten = torch.ops.aten
    x, i, s = _wide(50, 8), torch.randint(0, 50, (40,), generator=G), _wide(40, 8)
    i2 = i.unsqueeze(1).expand(-1, 8).contiguous()
    xb, sb = x.to(torch.bfloat16), s.to(torch.bfloat16)
    w, b = torch.rand(40, generator=G), torch.randint(0, 9, (40,), generator=G)
    return [
        (
            "index_put",
            lambda: aten.index_put(xb, [i], sb, True),
            lambda o: aten.index_put.out(xb, [i], sb, True, out=o),
        ),
        ("put", lambda: aten.put(xb, i * 8, sb[:, 0], True), lambda o: aten.put.out(xb, i * 8, sb[:, 0], True, out=o)),
        (
            "index_add",
            lambda: aten.index_add(x, 0, i, s, alpha=-0.3),
            lambda o: aten.index_add.out(x, 0, i, s, alpha=-0.3, out=o),
        ),
        ("scatter_add", lambda: aten.scatter_add(x, 0, i2, s), lambda o: aten.scatter_add.out(x, 0, i2, s, out=o)),
        (
            "scatter_reduce",
            lambda: aten.scatter_reduce.two(x, 0, i2, s, "mean"),
            lambda o: aten.scatter_reduce.two_out(x, 0, i2, s, "mean", out=o),
        ),
        (
            "scatter",
            lambda: aten.scatter.reduce(x, 0, i2, s, reduce="add"),
            lambda o: aten.scatter.reduce_out(x, 0, i2, s, reduce="add", out=o),
        ),
        (
            "embedding_dense_backward",
            lambda: aten.embedding_dense_backward(s, i, 50, -1, False),
            lambda o: aten.embedding_dense_backward.out(s, i, 50, -1, False, out=o),
        ),
        ("bincount", lambda: aten.bincount(b, w, 0), lambda o: aten.bincount.out(b, w, 0, out=o)),
    ]


@pytest.mark.parametrize("case", _out_cases(), ids=lambda c: c[0])
def test_every_out_overload_of_a_routed_op_writes_its_out(case):
    """An out= overload of a routed op writes samestep's answer (the functional form's bits) into ``out`` and
    returns it: into an ``out`` of the right shape holding -7, into an empty one (resized), and into one of
    another shape (resized, with PyTorch's warning). Negative control: ``out`` as it was (what the routing
    once left there) is not that answer."""
    name, functional, into = case
    with samestep.enable(kernels=True):
        want = functional()
        for out in (torch.full_like(want, -7), torch.empty(0, dtype=want.dtype)):
            assert first_difference(out, want) is not None or not want.numel()  # the control: not yet written
            got = into(out)
            assert got is out and first_difference(out, want) is None, name
        other = torch.zeros(3, dtype=want.dtype)
        with pytest.warns(UserWarning, match="was resized"):
            into(other)
        assert first_difference(other, want) is None, name


def test_an_expanded_destination_is_left_to_pytorchs_kernel_by_name():
    """index_put_ with accumulate into an expanded tensor (every row the same memory) adds every contribution
    into it, as PyTorch does ([[3, 3, 3]]), with a warning naming the fallback; a fold could not write it.
    Control: into a tensor of its own the kernel takes it, with no warning."""

    def call(base):
        return base.index_put_((torch.tensor([0, 1, 1]),), torch.ones(3, 3), accumulate=True)

    want = call(torch.zeros(1, 3).expand(4, 3))
    with samestep.enable(kernels=True):
        with pytest.warns(RuntimeWarning, match="index_put_ into a tensor whose elements share memory"):
            got = call(torch.zeros(1, 3).expand(4, 3))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            own = call(torch.zeros(4, 3))
    assert first_difference(got, want) is None and got.tolist() == [[3.0] * 3] * 4
    assert own.tolist() == [[1.0] * 3, [2.0] * 3, [0.0] * 3, [0.0] * 3]


def test_pytorchs_index_add_tile_is_its_deterministic_index_put_bit_for_bit():
    """The CPU tile of samestep's fold (PyTorch's index_add_ along dim 0) adds each row's sources in the order
    PyTorch's deterministic index_put_ with accumulate adds them: the same bits on narrow and wide rows, at 1
    and 2 threads (docs/performance.md prices the one against the other). Control: the tile's sources in
    reverse order give other bits under the same comparison."""
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for rows, width in ((1000, 8), (1000, 1), (50, 1), (300, 64)):
                base, index, src = (
                    _wide(rows, width),
                    torch.randint(0, rows, (60_000,), generator=G),
                    _wide(60_000, width),
                )
                tile = base.clone().index_add_(0, index, src)
                put = _torch_deterministic(lambda: base.clone().index_put_((index,), src, accumulate=True))
                assert torch.equal(tile.view(torch.int32), put.view(torch.int32)), (n_threads, rows, width)
        reversed_tile = base.clone().index_add_(0, index.flip(0), src.flip(0))
        assert not torch.equal(reversed_tile.view(torch.int32), tile.view(torch.int32))
    finally:
        torch.set_num_threads(threads)


def test_a_fold_of_narrow_rows_is_the_same_bits_through_either_serial_loop():
    """samestep's index_put of narrow rows (2 to 63 elements) adds its tiles through PyTorch's index_put_ under
    deterministic algorithms, and through index_add_ without them: the same bits for one tile, for several
    (the slots, then the tile sums) and for a table too large for slots (a sort of each tile), at 1 and 2
    threads. Control: the same comparison catches the sources of one tile reordered."""
    from samestep.ops import _indexing

    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for rows, width, n in ((1000, 8, 60_000), (1000, 8, 300_000), (1_000_000, 3, 200_000), (7, 63, 140_000)):
                base, index, values = _wide(rows, width), torch.randint(0, rows, (n,), generator=G), _wide(n, width)
                plain = _indexing.index_put(base, [index], values, True)
                through_put = _torch_deterministic(lambda: _indexing.index_put(base, [index], values, True))
                assert torch.equal(plain.view(torch.int32), through_put.view(torch.int32)), (n_threads, rows, n)
        tile = _impl.TILE
        swapped = torch.cat([index[:tile].flip(0), index[tile:]]), torch.cat([values[:tile].flip(0), values[tile:]])
        reordered = _indexing.index_put(base, [swapped[0]], swapped[1], True)
        assert not torch.equal(reordered.view(torch.int32), plain.view(torch.int32))
    finally:
        torch.set_num_threads(threads)

"""torch.compile under ``samestep.enable(kernels=True)``: Dynamo compiles (a dispatch mode that does not say it
ignores compile internals makes Dynamo skip every frame, so a compiled model ran eagerly, with no word), and the
compiled code's accumulating ops, which Inductor calls as ATen fallbacks under deterministic algorithms, run
samestep's kernels: the eager kernels' bits, the same on every run and at 1 and 2 threads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch._dynamo.utils import counters

import samestep
from samestep.ops.routing import KernelMode

G = torch.Generator().manual_seed(5)
TABLE = torch.randn(1000, 8, generator=G)
# two tiles of duplicates (one is PyTorch's own serial loop, which computes the definition): the backward
# accumulates in samestep's order
INDEX = torch.randint(0, 1000, (100_000,), generator=G)
WEIGHTS = torch.randn(100_000, 8, generator=G) * torch.exp(torch.randn(100_000, 8, generator=G) * 3)


def _lookup(table: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (table[index] * weights).sum()  # backward: index_put with accumulate of the weights


@contextlib.contextmanager
def _counting_routed() -> Iterator[list[str]]:
    """The ops the kernel mode routes while inside, by name."""
    routed: list[str] = []
    route = KernelMode._route

    def counted(self, func, args, kwargs):
        out = route(self, func, args, kwargs)
        routed.extend([str(func)] if out is not NotImplemented else [])
        return out

    KernelMode._route = counted
    try:
        yield routed
    finally:
        KernelMode._route = route


def _gradient(compiled: bool, threads: int, mode: type[KernelMode] | None = None) -> tuple[torch.Tensor, int, int]:
    """The lookup's gradient under kernels (``mode``: a further mode pushed inside plain deterministic mode
    instead), how many graphs Dynamo compiled, and how many routed calls ran."""
    torch._dynamo.reset()
    counters.clear()
    table = TABLE.clone().requires_grad_()
    fn = torch.compile(_lookup) if compiled else _lookup
    with _counting_routed() as routed:
        if mode is None:
            with samestep.enable(threads=threads, kernels=True):
                fn(table, INDEX, WEIGHTS).backward()
        else:
            with samestep.enable(threads=threads), mode():
                fn(table, INDEX, WEIGHTS).backward()
    return table.grad, counters["stats"]["unique_graphs"], len(routed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.slow
def test_a_compiled_function_under_kernels_compiles_and_gives_the_eager_kernels_bits():
    """Compiled under kernels: one graph, its backward's index_put routed to samestep's kernel, and the
    gradient the eager kernel's bits, the same again and at 2 threads. Negative control: the same mode that
    does not say it ignores compile internals compiles no graph (what kernels mode did before), though the
    eager calls are routed."""
    eager, graphs, calls = _gradient(False, 1)
    assert graphs == 0 and calls >= 1
    for threads in (1, 1, 2):
        grad, graphs, calls = _gradient(True, threads)
        assert graphs == 1 and calls >= 1, (graphs, calls)
        assert torch.equal(_bits(grad), _bits(eager)), f"threads={threads}"

    class Skipped(KernelMode):
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return False

    grad, graphs, calls = _gradient(True, 1, Skipped)
    assert graphs == 0 and calls >= 1, (graphs, calls)
    assert torch.equal(_bits(grad), _bits(eager))  # run eagerly: the same kernel, no compilation


def _accumulations(index: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, ...]:
    zeros = torch.zeros(1000)
    return (
        zeros.index_add(0, index, src),
        zeros.scatter_add(0, index, src),
        zeros.scatter_reduce(0, index, src, "mean"),
        torch.bincount(index, src, 1000),
    )


@pytest.mark.slow
def test_each_compiled_accumulation_under_kernels_is_the_eager_kernels_bits():
    """index_add, scatter_add, scatter_reduce's mean and a weighted bincount, compiled under kernels at 2
    threads: Inductor calls them, in its own forms, as fallbacks under deterministic algorithms, which the
    mode routes (four routed calls in the compiled one), and each output is the eager kernels' bits. Control:
    one element moved by a ULP is caught by the same comparison."""
    src = WEIGHTS[:, 0].contiguous()
    torch._dynamo.reset()
    counters.clear()
    with samestep.enable(threads=2, kernels=True):
        eager = _accumulations(INDEX, src)
        with _counting_routed() as routed:
            compiled = torch.compile(_accumulations)(INDEX, src)
    assert counters["stats"]["unique_graphs"] == 1
    # Inductor's forms: index_add as index_put_, scatter_add and the mean as scatter_reduce_ (sums)
    assert sorted(routed) == ["aten.bincount.default", "aten.index_put_.default"] + ["aten.scatter_reduce_.two"] * 2
    for e, c in zip(eager, compiled, strict=True):
        assert torch.equal(_bits(c), _bits(e))
    moved = eager[0].clone()
    moved[0] = torch.nextafter(moved[0], torch.tensor(float("inf")))
    assert not torch.equal(_bits(moved), _bits(eager[0]))


@pytest.mark.slow
def test_compiled_code_with_deterministic_algorithms_turned_off_runs_eagerly_routed_and_says_so():
    """Deterministic algorithms turned off inside kernels mode: Inductor would write its own racing kernels for
    the accumulating ops, so Dynamo compiles no graph, the calls are routed eagerly (the eager kernels' bits)
    and one warning names the fix. Control: with them on, the same call compiles one graph."""
    eager, _, _ = _gradient(False, 1)
    KernelMode._eager_warned = False
    torch._dynamo.reset()
    counters.clear()
    table = TABLE.clone().requires_grad_()
    with samestep.enable(threads=1, kernels=True), _counting_routed() as routed:
        torch.use_deterministic_algorithms(False)
        try:
            with pytest.warns(RuntimeWarning, match="torch.compile runs eagerly here"):
                torch.compile(_lookup)(table, INDEX, WEIGHTS).backward()
        finally:
            torch.use_deterministic_algorithms(True)
    assert counters["stats"]["unique_graphs"] == 0 and routed, (counters["stats"]["unique_graphs"], routed)
    assert torch.equal(_bits(table.grad), _bits(eager))
    _, graphs, _ = _gradient(True, 1)
    assert graphs == 1

"""The canonical tree: a step's gradient sums its microbatches along one fixed binary tree over their
global indices, so its bits do not depend on the number of processes (docs/layouts.md "The tree").

``BinaryCounter`` builds that tree as leaves arrive, ``canonical_sum`` is its one-call form, and
``validate_layout`` refuses a layout whose per-process ranges are not subtrees of it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["BinaryCounter", "Leaf", "canonical_sum", "validate_layout"]


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def validate_layout(world_size: int, microbatches_per_process: int) -> None:
    """Refuses a layout whose per-process microbatch ranges are not aligned subtrees of the tree.

    A layout (W, K) is supported when K is a power of two (any W: N = W*K decomposes into power-of-two
    blocks of at least K, so every range [rK, (r+1)K) lies inside one block, aligned), or when W = 1.

    Raises:
        ValueError: names the layout and the nearest supported ones.
    """
    w, k = world_size, microbatches_per_process
    if w < 1 or k < 1:
        raise ValueError(f"layout (world size {w}, {k} microbatches per process) needs both at least 1")
    if w == 1 or _is_pow2(k):
        return
    n = w * k
    near = sorted(
        {(w2, n // w2) for w2 in range(1, n + 1) if n % w2 == 0 and (w2 == 1 or _is_pow2(n // w2))},
        key=lambda wk: abs(wk[0] - w),
    )[:3]
    options = ", ".join(f"--nproc {w2} ({k2} microbatches per process)" for w2, k2 in near)
    raise ValueError(
        f"layout of {w} processes x {k} microbatches per process is not supported: each process must own "
        f"an aligned, power-of-two range of the {n} global microbatches so that the canonical reduction "
        f"tree does not depend on the layout. Same global batch, supported: {options}"
    )


Leaf = torch.Tensor | list[torch.Tensor]


def _add_into(left: Leaf, right: Leaf) -> Leaf:
    """``left += right`` elementwise (a tensor, or a list of tensors added pairwise in one foreach op)."""
    if isinstance(left, torch.Tensor):
        return left.add_(right)
    torch._foreach_add_(left, right)
    return left


class BinaryCounter:
    """Sums leaves pushed in index order along the canonical tree, holding O(log n) partial sums.

    A leaf is a tensor, or a list of tensors (e.g. one gradient per parameter) summed elementwise.
    """

    def __init__(self) -> None:
        self._stack: list[tuple[int, Leaf]] = []  # (leaves covered, partial sum)

    def push(self, leaf: Leaf, size: int = 1) -> None:
        """Adds the next leaf (or an already-summed aligned block of ``size`` leaves). Takes ownership."""
        while self._stack and self._stack[-1][0] == size:
            left_size, left = self._stack.pop()
            leaf = _add_into(left, leaf)
            size += left_size
        self._stack.append((size, leaf))

    def fold_into(self, out: torch.Tensor, leaf: torch.Tensor | None, index: int | None = None) -> torch.Tensor:
        """Writes into ``out`` what ``push(leaf)`` then ``result()`` would give (of list leaves, element
        ``index``), leaving the counter as it is: one part of the final sum, made as soon as its last leaf
        exists. Both merge the partial sums from the top of the stack down, ``left + acc``, so this is the
        same bracketing. ``leaf`` None sums as zeros (the bits of a zero tensor pushed)."""
        acc = leaf
        if acc is None:
            acc = out.zero_()
        for _, entry in reversed(self._stack):
            torch.add(entry if index is None else entry[index], acc, out=out)
            acc = out
        if acc is not out:
            out.copy_(acc)
        return out

    def clear(self) -> None:
        """Drops every partial sum."""
        self._stack.clear()

    def result(self) -> Leaf:
        """The tree sum of everything pushed; resets the counter."""
        if not self._stack:
            raise RuntimeError("BinaryCounter.result() with nothing pushed")
        _, acc = self._stack.pop()
        while self._stack:  # leftover blocks, smallest (rightmost) first
            _, left = self._stack.pop()
            acc = _add_into(left, acc)
        return acc


def canonical_sum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The canonical-tree sum of ``tensors`` in order (inputs are not modified)."""
    counter = BinaryCounter()
    for t in tensors:
        counter.push(t.clone())
    return counter.result()

"""The canonical reduction: a step's gradient is one fixed binary tree over global microbatch indices.

Floating-point addition is commutative but not associative, so the bits of a sum depend only on its
bracketing. samestep fixes the bracketing by the *global* microbatch index 0..N-1, whatever the number
of processes (docs/design.md, invariant 2):

- the tree is the one a binary counter builds: leaves are pushed in index order and two equal-sized
  subtrees merge as soon as both exist; whatever remains (when N is not a power of two) is combined
  from the smallest block up. Over N = 8 that is ((m0+m1)+(m2+m3))+((m4+m5)+(m6+m7)).
- each process owns an aligned range of K = 2^k microbatch indices, a subtree of that tree, and reduces
  it locally as its microbatches finish, holding O(log K) buffers instead of K;
- the processes then combine their subtree sums with the same counter over rank index, so the result
  has the same bits as on one process. The combine moves the bytes of a ring all-reduce: an all-to-all
  of 1/W chunks (a reduce-scatter whose summing order we choose), the fixed-order sum of the W chunks,
  and an all-gather: 2(W-1)/W of the buffer sent per process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["AllReduceGradients", "BinaryCounter", "CanonicalGradients", "canonical_sum", "combine_across_ranks",
           "ring_allreduce_bytes", "validate_layout"]


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
    near = sorted({(w2, n // w2) for w2 in range(1, n + 1) if n % w2 == 0 and (w2 == 1 or _is_pow2(n // w2))},
                  key=lambda wk: abs(wk[0] - w))[:3]
    options = ", ".join(f"--nproc {w2} ({k2} microbatches per process)" for w2, k2 in near)
    raise ValueError(
        f"layout of {w} processes x {k} microbatches per process is not supported: each process must own "
        f"an aligned, power-of-two range of the {n} global microbatches so that the canonical reduction "
        f"tree does not depend on the layout. Same global batch, supported: {options}")


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


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: object):
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


# Elements per bucket: big enough to amortise a collective's latency, small enough that the
# fixed-order combine of one bucket overlaps the all-to-all of the next.
BUCKET_ELEMENTS = 4 * 1024 * 1024


def ring_allreduce_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one process sends in a ring all-reduce of ``numel`` elements: 2(W-1)/W of the buffer."""
    return 2 * (world_size - 1) * -(-numel // world_size) * element_size


def combine_across_ranks(local: torch.Tensor, world_size: int, group: object = None,
                         bucket_elements: int = BUCKET_ELEMENTS) -> tuple[torch.Tensor, int]:
    """Sums one equal-sized block per rank in rank order along the canonical tree; same bits on all ranks.

    Per bucket: an all-to-all hands rank j the j-th chunk of every rank's bucket (a reduce-scatter whose
    summing order we choose), rank j sums the W chunks with the binary counter over rank index, and
    an all-gather returns the summed chunks to everyone. Buckets are pipelined: bucket b+1's
    all-to-all is in flight while bucket b is summed. Element-wise sums do not depend on the chunking,
    so the bucket size changes no bit.

    Returns:
        The sum (``local``'s shape and dtype) and the bytes this process sent.
    """
    import torch.distributed as dist

    if world_size == 1:
        return local, 0
    n, sent = local.numel(), 0
    out = torch.empty_like(local)
    step = max(bucket_elements, world_size)
    spans = [(a, min(a + step, n)) for a in range(0, n, step)]

    def launch(a: int, b: int):
        chunk = -(-(b - a) // world_size)
        padded = torch.zeros(chunk * world_size, dtype=local.dtype, device=local.device)
        padded[: b - a] = local[a:b]
        received = torch.empty_like(padded)
        work = dist.all_to_all_single(received, padded, group=group, async_op=True)
        return work, received, chunk

    gathers = []
    pending = launch(*spans[0])
    for idx, (a, b) in enumerate(spans):
        work, received, chunk = pending
        if idx + 1 < len(spans):
            pending = launch(*spans[idx + 1])
        work.wait()  # row j = rank j's copy of my chunk
        counter = BinaryCounter()
        for row in received.view(world_size, chunk):
            counter.push(row.clone())
        mine = counter.result()
        gathered = torch.empty(chunk * world_size, dtype=local.dtype, device=local.device)
        gathers.append((_all_gather(gathered, mine, group), gathered, a, b))
        sent += 2 * (world_size - 1) * chunk * local.element_size()
    for work, gathered, a, b in gathers:
        work.wait()
        out[a:b] = gathered[: b - a]
    return out, sent


def _flat_grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient as a 1-D tensor (zeros for a parameter that received none)."""
    return [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            for p in params]


class CanonicalGradients:
    """Layout-invariant gradient accumulation and reduction for a data-parallel loop.

    After each microbatch's ``backward()``, call ``accumulate(i)`` with its global index; after the
    last one, ``reduce()`` leaves in every ``p.grad`` the canonical-tree sum over all microbatches of
    all processes: the same bits on 1, 2, 4 or 8 processes.

        grads = CanonicalGradients(model.parameters(), world_size=W, rank=r, microbatches_per_process=K)
        for i in range(r * K, (r + 1) * K):
            loss = model(batch(i)) / total_tokens
            loss.backward()
            grads.accumulate(i, extra=loss.detach())
        loss_sum = grads.reduce()   # the canonical sum of the extras, same on every rank
        optimizer.step()
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, microbatches_per_process: int,
                 world_size: int = 1, rank: int = 0, group: object = None) -> None:
        validate_layout(world_size, microbatches_per_process)
        self.params = [p for p in params if p.requires_grad]
        self.k, self.world_size, self.rank, self.group = microbatches_per_process, world_size, rank, group
        self._counter = BinaryCounter()
        self._next = rank * self.k
        self._n_extra = 0
        self._pending_extra: torch.Tensor | None = None  # the first of a pair's extra, until the second
        self.bytes_sent = 0  # by collective semantics, summed over reduce() calls
        # Called as observer(name, input, output) around each collective (a trace recorder, say).
        self.observer: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None

    @property
    def microbatches(self) -> range:
        """The global microbatch indices this process owns."""
        return range(self.rank * self.k, (self.rank + 1) * self.k)

    def accumulate(self, microbatch: int, extra: torch.Tensor | None = None) -> None:
        """Takes the current ``p.grad`` of every parameter as microbatch ``microbatch``'s leaf.

        The tree's first level adds microbatches in pairs (2j, 2j+1), always within one process (its range
        is aligned): after the first of a pair the gradients stay in ``p.grad`` (zeros where a parameter
        got none), so the next ``backward()`` adds into them, autograd's in-place add, the bits of
        ``left.add_(right)``, at plain accumulation's cost; after the second the pair's sum is pushed and
        ``p.grad`` cleared.

        Args:
            microbatch: the global index; must be the next one of this process's range.
            extra: a small tensor (e.g. the loss) summed along the same tree, returned by ``reduce()``.
        """
        if microbatch != self._next or microbatch not in self.microbatches:
            raise ValueError(f"accumulate(microbatch={microbatch}): rank {self.rank} expects global index "
                             f"{self._next} next (it owns {self.microbatches.start}..{self.microbatches.stop - 1})")
        dtype = self.params[0].dtype
        extra_flat = extra.detach().reshape(-1).to(dtype).clone() if extra is not None else torch.zeros(0, dtype=dtype)
        self._n_extra = extra_flat.numel()
        self._next += 1
        if (microbatch - self.microbatches.start) % 2 == 0 and self._next < self.microbatches.stop:
            for p in self.params:  # the first of a pair: the next backward adds into these
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._pending_extra = extra_flat
            return
        size = 1
        if self._pending_extra is not None:  # the second of a pair: p.grad holds the pair's sum
            extra_flat, self._pending_extra, size = self._pending_extra.add_(extra_flat), None, 2
        # The leaf is the list of the gradients themselves (autograd made them and they are cleared below,
        # so the counter owns them): no copy into a flat buffer per microbatch.
        self._counter.push(_flat_grads(self.params) + [extra_flat], size=size)
        for p in self.params:
            p.grad = None

    def reduce(self) -> torch.Tensor:
        """Combines across processes and writes the result into ``p.grad``; returns the summed extra."""
        if self._next != self.microbatches.stop:
            raise RuntimeError(f"reduce() after {self._next - self.microbatches.start} of {self.k} microbatches")
        parts = self._counter.result()
        if self.world_size == 1:  # no collective: the tree sums are the gradients, without a flat copy
            for p, g in zip(self.params, parts):
                p.grad = g.view_as(p)
            self._next = self.microbatches.start
            return parts[-1].clone()
        local = torch.cat(parts)  # one flat buffer per step, for the collectives
        total, sent = combine_across_ranks(local, self.world_size, self.group)
        self.bytes_sent += sent
        if self.observer is not None and self.world_size > 1:
            self.observer("canonical_combine", local, total)
        offset = 0
        for p in self.params:
            p.grad = total[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        self._next = self.microbatches.start
        return total[offset: offset + self._n_extra].clone()


class AllReduceGradients:
    """The usual path, for comparison: ``.grad`` accumulates in arrival order, then one all-reduce.

    This is what DDP with ``no_sync()`` on all but the last microbatch does. Its bits depend on the
    world size (the all-reduce sums in a topology-dependent order, and each process folds a
    different number of microbatches), which is why the reference run uses it only with
    ``determinism.enabled = false``. Same interface as ``CanonicalGradients``.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, microbatches_per_process: int,
                 world_size: int = 1, rank: int = 0, group: object = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.k, self.world_size, self.rank, self.group = microbatches_per_process, world_size, rank, group
        self._extra: torch.Tensor | None = None
        self.bytes_sent = 0
        self.observer: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None

    @property
    def microbatches(self) -> range:
        return range(self.rank * self.k, (self.rank + 1) * self.k)

    def accumulate(self, microbatch: int, extra: torch.Tensor | None = None) -> None:
        if extra is not None:
            flat = extra.detach().reshape(-1).clone()
            self._extra = flat if self._extra is None else self._extra + flat

    def reduce(self) -> torch.Tensor:
        import torch.distributed as dist

        parts = _flat_grads(self.params)
        extra = self._extra if self._extra is not None else parts[0][:0]
        total = torch.cat(parts + [extra.to(parts[0].dtype)])
        if self.world_size > 1:
            local = total.clone() if self.observer is not None else total
            dist.all_reduce(total, group=self.group)
            if self.observer is not None:
                self.observer("all_reduce", local, total)
            self.bytes_sent += ring_allreduce_bytes(total.numel(), total.element_size(), self.world_size)
        offset = 0
        for p in self.params:
            p.grad = total[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        self._extra = None
        return total[offset:].clone()

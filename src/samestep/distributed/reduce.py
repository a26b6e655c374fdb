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

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from samestep.distributed.buckets import BUCKET_ELEMENTS, GradientBuckets
from samestep.distributed.group import group_up
from samestep.distributed.shards import local_shard, placed, spec_of
from samestep.distributed.tree import BinaryCounter, validate_layout

__all__ = [
    "AllReduceGradients",
    "CanonicalGradients",
    "PendingCombine",
    "combine_across_ranks",
    "ring_allreduce_bytes",
    "tree_across_ranks",
]

_NOTHING = contextlib.nullcontext()  # reusable: it holds no state


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: object):
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def ring_allreduce_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one process sends in a ring all-reduce of ``numel`` elements: 2(W-1)/W of the buffer."""
    return 2 * (world_size - 1) * -(-numel // world_size) * element_size


class PendingCombine:
    """One block's combine across ranks (``combine_across_ranks``), started: the all-to-all that hands rank j
    the j-th chunk of every rank's block is in flight. ``gather()`` waits for it, sums this rank's W chunks
    along the tree over rank index and starts the all-gather; ``wait()`` returns the sum (``local``'s shape).
    Every rank starts, gathers and waits its blocks in one order. ``sent``: the bytes this process sends."""

    def __init__(self, local: torch.Tensor, world_size: int, group: object = None) -> None:
        import torch.distributed as dist

        self.shape, self.world, self.group = local.shape, world_size, group
        self.n = local.numel()
        self.chunk = -(-self.n // world_size)
        padded = torch.zeros(self.chunk * world_size, dtype=local.dtype, device=local.device)
        padded[: self.n] = local.reshape(-1)
        self._received = torch.empty_like(padded)
        self._gathered: torch.Tensor | None = None
        self._work = dist.all_to_all_single(self._received, padded, group=group, async_op=True)
        self.sent = 2 * (world_size - 1) * self.chunk * local.element_size()

    def gather(self) -> None:
        self._work.wait()  # row j = rank j's copy of my chunk
        counter = BinaryCounter()
        for row in self._received.view(self.world, self.chunk):
            counter.push(row.clone())
        mine = counter.result()
        self._gathered = torch.empty(self.chunk * self.world, dtype=mine.dtype, device=mine.device)
        self._work = _all_gather(self._gathered, mine, self.group)

    def wait(self) -> torch.Tensor:
        if self._gathered is None:
            raise RuntimeError("PendingCombine.wait() before gather()")
        self._work.wait()
        return self._gathered[: self.n].view(self.shape)


def combine_across_ranks(
    local: torch.Tensor, world_size: int, group: object = None, bucket_elements: int = BUCKET_ELEMENTS
) -> tuple[torch.Tensor, int]:
    """Sums one equal-sized block per rank in rank order along the canonical tree; same bits on all ranks.

    Per bucket: an all-to-all hands rank j the j-th chunk of every rank's bucket (a reduce-scatter whose
    summing order we choose), rank j sums the W chunks with the binary counter over rank index, and
    an all-gather returns the summed chunks to everyone (``PendingCombine``). Buckets are pipelined: bucket
    b+1's all-to-all is in flight while bucket b is summed. Element-wise sums do not depend on the chunking,
    so the bucket size changes no bit.

    Returns:
        The sum (``local``'s shape and dtype) and the bytes this process sent.
    """
    if world_size == 1:
        return local, 0
    if local.numel() == 0:  # nothing to sum (an expert that got no token): every rank's block is empty alike
        return local.clone(), 0
    n, sent = local.numel(), 0
    flat = local.reshape(-1)
    out = torch.empty(local.shape, dtype=local.dtype, device=local.device)
    step = max(bucket_elements, world_size)
    spans = [(a, min(a + step, n)) for a in range(0, n, step)]
    started = []
    pending = PendingCombine(flat[spans[0][0] : spans[0][1]], world_size, group)
    for idx, (a, b) in enumerate(spans):
        current = pending
        if idx + 1 < len(spans):
            pending = PendingCombine(flat[spans[idx + 1][0] : spans[idx + 1][1]], world_size, group)
        current.gather()
        started.append((current, a, b))
        sent += current.sent
    out_flat = out.view(-1)
    for current, a, b in started:
        out_flat[a:b] = current.wait()
    return out, sent


def tree_across_ranks(leaves: list[torch.Tensor], group: object = None) -> torch.Tensor:
    """The canonical-tree sum of leaves laid out over ranks: this rank's ``leaves`` are its aligned,
    power-of-two run of them, in order (a rank of ``group`` holds the run after the one before it). The
    rank sums its run, then the ranks combine their sums in rank order (``combine_across_ranks``): the
    bits of one process summing them all, on every rank. Consumes ``leaves``.

    On 2 ranks an all-gather of the two sums is the ring all-reduce's bytes in one collective instead of
    two (their sum in rank order is the tree's), so it goes that way."""
    counter = BinaryCounter()
    for leaf in leaves:
        counter.push(leaf)
    local = counter.result()
    if group is None:
        return local
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world != 2:
        return combine_across_ranks(local, world, group)[0]
    n = local.numel()
    both = torch.empty(2 * n, dtype=local.dtype, device=local.device)
    _all_gather(both, local.reshape(-1).contiguous(), group).wait()
    return both[:n].add_(both[n:]).view(local.shape)


def _flat_grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient (of a DTensor parameter, this rank's shard of it) as a 1-D tensor (zeros for a
    parameter that received none)."""
    return [
        local_shard(p.grad).reshape(-1)
        if p.grad is not None
        else torch.zeros(local_shard(p).numel(), dtype=p.dtype, device=p.device)
        for p in params
    ]


def _grad_like(g: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
    """``g`` (flat, this rank's part) shaped as ``p.grad``: a DTensor placed as ``p`` where ``p`` is one (its
    spec, as DTensor's operators place an output like their input, without ``from_local``'s checks)."""
    return placed(g.view(local_shard(p).shape), spec_of(p))


def _zeros_like(p: torch.nn.Parameter) -> torch.Tensor:
    """Zeros laid out as ``p``: of a DTensor, its shard's zeros placed as ``p`` (no dispatch through DTensor)."""
    return placed(torch.zeros_like(local_shard(p)), spec_of(p))


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

    On W > 1 processes the combine across them starts during the last microbatch's backward, bucket by
    bucket, as each bucket's gradients are final (``GradientBuckets``, on a process group of its own unless
    ``group`` is given; ``overlap=False`` waits for the whole backward, for a loop that runs backward more
    than once through a parameter per microbatch).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        microbatches_per_process: int,
        world_size: int = 1,
        rank: int = 0,
        group: object = None,
        overlap: bool = True,
        **bucket_options: Any,
    ) -> None:
        import torch.distributed as dist

        validate_layout(world_size, microbatches_per_process)
        self.params = [p for p in params if p.requires_grad]
        self.k, self.world_size, self.rank, self.group = microbatches_per_process, world_size, rank, group
        self._counter = BinaryCounter()
        self._next = rank * self.k
        self._pending_extra: torch.Tensor | None = None  # the first of a pair's extra, until the second
        # Called as observer(name, input, output) around each collective (a trace recorder, say).
        self.observer: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None
        overlap = overlap and world_size > 1
        if overlap and group is None and group_up():
            # A process group of its own: the collectives started inside the backward then never interleave
            # with the default group's, which a rank may issue before or after them (a parameter that got no
            # gradient on one rank holds its bucket back to the backward's end there, and not on another).
            group = dist.new_group()
        self.group = group
        # a tensor-parallel (DTensor) parameter: its shard is what this rank combines with the other data ranks
        self.buckets = (
            GradientBuckets([local_shard(p) for p in self.params], world_size=world_size, group=group, **bucket_options)
            if world_size > 1
            else None
        )
        self._hooks = (
            [p.register_post_accumulate_grad_hook(self._hook(j)) for j, p in enumerate(self.params)] if overlap else []
        )

    @property
    def bytes_sent(self) -> int:
        """Bytes this process sent, by collective semantics, summed over ``reduce()`` calls."""
        return self.buckets.bytes_sent if self.buckets is not None else 0

    @property
    def microbatches(self) -> range:
        """The global microbatch indices this process owns."""
        return range(self.rank * self.k, (self.rank + 1) * self.k)

    def _hook(self, j: int) -> Callable[[torch.Tensor], None]:
        from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

        buckets, last = self.buckets, self.microbatches.stop - 1

        def packed_when_final(p: torch.Tensor) -> None:
            if self._next != last:  # not the last local microbatch's backward
                return
            # Not one of the model's ops: an op-level trace recorder (a dispatch mode) must not see it. Entered
            # only under one: it costs more than the packing's own Python.
            with _disable_current_modes() if _get_current_dispatch_mode_stack() else _NOTHING:
                buckets.pack(j, self._counter, local_shard(p.grad))  # the hook runs once p.grad exists
                buckets.start_ready()

        return packed_when_final

    def accumulate(self, microbatch: int, extra: torch.Tensor | None = None) -> None:
        """Takes the current ``p.grad`` of every parameter as microbatch ``microbatch``'s leaf.

        The tree's first level adds microbatches in pairs (2j, 2j+1), always within one process (its range
        is aligned): after the first of a pair the gradients stay in ``p.grad`` (zeros where a parameter
        got none), so the next ``backward()`` adds into them, autograd's in-place add, the bits of
        ``left.add_(right)``, at plain accumulation's cost; after the second the pair's sum is pushed and
        ``p.grad`` cleared. After the last, on several processes, every bucket is packed and started.

        Args:
            microbatch: the global index; must be the next one of this process's range.
            extra: a small tensor (e.g. the loss) summed along the same tree, returned by ``reduce()``.
        """
        if microbatch != self._next or microbatch not in self.microbatches:
            raise ValueError(
                f"accumulate(microbatch={microbatch}): rank {self.rank} expects global index "
                f"{self._next} next (it owns {self.microbatches.start}..{self.microbatches.stop - 1})"
            )
        dtype = self.params[0].dtype
        extra_flat = extra.detach().reshape(-1).to(dtype).clone() if extra is not None else torch.zeros(0, dtype=dtype)
        self._next += 1
        if (microbatch - self.microbatches.start) % 2 == 0 and self._next < self.microbatches.stop:
            for p in self.params:  # the first of a pair: the next backward adds into these
                if p.grad is None:
                    p.grad = _zeros_like(p)
            self._pending_extra = extra_flat
            return
        size = 1
        if self._pending_extra is not None:  # the second of a pair: p.grad holds the pair's sum
            extra_flat, self._pending_extra, size = self._pending_extra.add_(extra_flat), None, 2
        if self._next == self.microbatches.stop and self.buckets is not None:
            self._pack_rest(extra_flat)
        else:
            # The leaf is the list of the gradients themselves (autograd made them and they are cleared
            # below, so the counter owns them): no copy into a flat buffer per microbatch.
            self._counter.push(_flat_grads(self.params) + [extra_flat], size=size)
        for p in self.params:
            p.grad = None

    def _pack_rest(self, extra: torch.Tensor) -> None:
        """The last microbatch is done: packs what its backward's hooks did not (all of it without the
        overlap; a parameter that got no gradient in it), the extra, and starts every bucket."""
        buckets = self.buckets
        for j in buckets.unpacked():
            grad = self.params[j].grad
            buckets.pack(j, self._counter, local_shard(grad) if grad is not None else None)
        buckets.pack_extra(self._counter, extra)
        buckets.start_ready()
        self._counter.clear()

    def reduce(self) -> torch.Tensor:
        """Combines across processes and writes the result into ``p.grad``; returns the summed extra."""
        if self._next != self.microbatches.stop:
            raise RuntimeError(f"reduce() after {self._next - self.microbatches.start} of {self.k} microbatches")
        self._next = self.microbatches.start
        if self.buckets is None:  # no collective: the tree sums are the gradients, without a flat copy
            parts = self._counter.result()
            for p, g in zip(self.params, parts):
                p.grad = _grad_like(g, p)
            return parts[-1].clone()
        reduced, extra = self.buckets.finish()
        if self.observer is not None:
            local = torch.cat([self.buckets.local(j) for j in range(len(self.params) + 1)])
            self.observer("canonical_combine", local, torch.cat([*reduced, extra]))
        for p, g in zip(self.params, reduced):
            p.grad = _grad_like(g, p)
        return extra.clone()


class AllReduceGradients:
    """The usual path, for comparison: ``.grad`` accumulates in arrival order, then one all-reduce.

    This is what DDP with ``no_sync()`` on all but the last microbatch does. Its bits depend on the
    world size (the all-reduce sums in a topology-dependent order, and each process folds a
    different number of microbatches), which is why the reference run uses it only with
    ``determinism.enabled = false``. Same interface as ``CanonicalGradients``.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        microbatches_per_process: int,
        world_size: int = 1,
        rank: int = 0,
        group: object = None,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.k, self.world_size, self.rank, self.group = microbatches_per_process, world_size, rank, group
        self._extra: torch.Tensor | None = None
        self.bytes_sent = 0
        self.observer: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None

    @property
    def microbatches(self) -> range:
        return range(self.rank * self.k, (self.rank + 1) * self.k)

    def accumulate(self, microbatch: int, extra: torch.Tensor | None = None) -> None:
        if extra is not None:  # a DTensor's (a loss replicated over tensor ranks): this rank's copy
            flat = local_shard(extra.detach()).reshape(-1).clone()
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
            n = local_shard(p).numel()
            p.grad = _grad_like(total[offset : offset + n], p)
            offset += n
        self._extra = None
        return total[offset:].clone()

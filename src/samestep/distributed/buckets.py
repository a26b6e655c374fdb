"""Gradient buckets: the canonical combine across processes, started while the backward still runs.

DDP reduces each bucket of gradients as soon as the backward has produced them. The canonical combine
(docs/layouts.md) can start as early: once the last local microbatch's gradient of a parameter has been
accumulated, that parameter's local tree sum is final (``BinaryCounter.fold_into``), so it is packed
into its bucket's send buffer there and then, and a bucket whose parameters are all packed starts its
all-to-all while the backward goes on. Buckets start in a fixed order (bucket b only after b - 1), so
every rank issues the same collectives in the same order whatever order its gradients arrive in.

After the backward, ``finish`` completes the buckets in order: rank j sums the W copies of its chunk in
rank order along the tree, and the sums are gathered to every rank (bucket b's gather in flight while
bucket b + 1 is summed). Waiting for a bucket inside the backward could deadlock (``start_ready``), so
that half of the combine is left after it. Element-wise sums do not depend on the chunking, so neither
the buckets nor the moment they start change a bit; each process sends 2(W-1)/W of the gradient, a ring
all-reduce's bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from samestep.distributed.tree import BinaryCounter

__all__ = ["BUCKET_ELEMENTS", "FIRST_BUCKET_ELEMENTS", "GradientBuckets"]

# Elements per bucket: big enough to amortise a collective's latency, small enough that the
# fixed-order combine of one bucket overlaps the all-to-all of the next.
BUCKET_ELEMENTS = 4 * 1024 * 1024
# The first bucket (the parameters the backward reaches first) is small, as DDP's is (1 MiB of fp32):
# it starts early in the backward rather than near its end.
FIRST_BUCKET_ELEMENTS = 256 * 1024


class _Bucket:
    """Parameters (indices) packed side by side; the last bucket also carries the extra (the loss)."""

    __slots__ = ("chunk", "extra", "gather", "numel", "offsets", "out", "params", "recv", "send", "waiting", "work")

    def __init__(self, params: list[int], offsets: list[int], numel: int) -> None:
        self.params, self.offsets, self.numel = params, offsets, numel
        self.extra = 0  # elements of the extra after the parameters (the last bucket only)
        self.chunk = 0
        self.send = self.recv = torch.empty(0)
        self.waiting = 0  # parts not yet packed this step
        self.work: Any = None  # the all-to-all
        self.gather: Any = None  # the gather of the summed chunks to every rank, into out
        self.out = torch.empty(0)


class GradientBuckets:
    """The send buffers and collectives of ``CanonicalGradients``' combine over W > 1 processes.

    Per step: ``pack(j, ...)`` each parameter's local sum (in any order, from a hook or after the
    backward), ``pack_extra`` once, ``start_ready`` as often as wanted (it starts every bucket that is
    complete and next in order), then ``finish`` for the reduced gradients.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        *,
        world_size: int,
        group: object = None,
        first_bucket_elements: int = FIRST_BUCKET_ELEMENTS,
        bucket_elements: int = BUCKET_ELEMENTS,
    ) -> None:
        self.params, self.world_size, self.group = params, world_size, group
        self.buckets: list[_Bucket] = []
        self.where: list[tuple[_Bucket, int]] = [None] * len(params)  # type: ignore[list-item]
        cap, members, offsets, size = first_bucket_elements, [], [], 0
        for j in reversed(range(len(params))):  # the backward produces the last parameters first
            if members and size + params[j].numel() > cap:
                self.buckets.append(_Bucket(members, offsets, size))
                cap, members, offsets, size = bucket_elements, [], [], 0
            members.append(j)
            offsets.append(size)
            size += params[j].numel()
        self.buckets.append(_Bucket(members, offsets, size))
        for bucket in self.buckets:
            for j, offset in zip(bucket.params, bucket.offsets):
                self.where[j] = (bucket, offset)
        self.bytes_sent = 0
        self._allocate(self.buckets[-1], extra=1)
        for bucket in self.buckets[:-1]:
            self._allocate(bucket, extra=0)
        self._reset()

    def _allocate(self, bucket: _Bucket, extra: int) -> None:
        w = self.world_size
        dtype, device = self.params[0].dtype, self.params[0].device
        bucket.extra = extra
        bucket.chunk = -(-(bucket.numel + extra) // w)
        old, bucket.send = bucket.send, torch.zeros(bucket.chunk * w, dtype=dtype, device=device)
        kept = min(old.numel(), bucket.numel)
        bucket.send[:kept] = old[:kept]  # the parameters packed already
        bucket.recv = torch.empty_like(bucket.send)

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.waiting = len(bucket.params) + (bucket is self.buckets[-1])
            bucket.work = bucket.gather = None
        self._packed = [False] * len(self.params)  # which parameters are packed this step
        self._started = 0  # buckets whose all-to-all started this step
        self._summed = 0  # buckets whose chunks are summed and gathering

    def pack(self, j: int, counter: BinaryCounter, leaf: torch.Tensor | None) -> None:
        """Writes parameter ``j``'s local sum (``counter``'s partial sums of it and ``leaf``, its last
        gradient; None sums as zeros) into its bucket.

        Raises:
            RuntimeError: the parameter's gradient grew again after its bucket was sent (a second
                backward through it in the last microbatch); ``CanonicalGradients(overlap=False)`` waits
                for the whole backward.
        """
        bucket, offset = self.where[j]
        if self._packed[j] and bucket.work is not None:
            shape = tuple(self.params[j].shape)
            raise RuntimeError(
                f"the gradient of parameter {j} (shape {shape}) was accumulated again after its "
                f"bucket was sent to the other processes: the last microbatch ran backward through "
                f"it twice. Use CanonicalGradients(overlap=False), which combines after the backward"
            )
        n = self.params[j].numel()
        counter.fold_into(bucket.send[offset : offset + n], None if leaf is None else leaf.reshape(-1), index=j)
        if not self._packed[j]:
            self._packed[j] = True
            bucket.waiting -= 1

    def pack_extra(self, counter: BinaryCounter, leaf: torch.Tensor) -> None:
        """Writes the extra's local sum (its index in the counter's leaves is after the parameters')."""
        bucket = self.buckets[-1]
        if leaf.numel() != bucket.extra:
            self._allocate(bucket, extra=leaf.numel())
        counter.fold_into(bucket.send[bucket.numel : bucket.numel + bucket.extra], leaf, index=len(self.params))
        bucket.waiting -= 1

    @property
    def started(self) -> int:
        """How many buckets have started this step."""
        return self._started

    def unpacked(self) -> list[int]:
        """The parameters not packed yet this step."""
        return [j for j, done in enumerate(self._packed) if not done]

    def start_ready(self) -> None:
        """Starts, in bucket order, the all-to-all of each bucket that is completely packed and next in line.
        Nothing here waits for another rank: one that holds a bucket back to its backward's end and runs a
        collective of its own before it gets there must not find this rank waiting inside its backward."""
        import torch.distributed as dist

        while self._started < len(self.buckets) and self.buckets[self._started].waiting == 0:
            bucket = self.buckets[self._started]
            bucket.work = dist.all_to_all_single(bucket.recv, bucket.send, group=self.group, async_op=True)
            self._started += 1

    def _sum_and_gather(self) -> None:
        """The next bucket's all-to-all done, sums its W chunk copies in rank order and starts the gather."""
        import torch.distributed as dist

        bucket, w = self.buckets[self._summed], self.world_size
        bucket.work.wait()  # row r: rank r's local sum of my chunk
        rows = BinaryCounter()
        for row in bucket.recv.view(w, bucket.chunk):
            rows.push(row)  # summed in place: the receive buffer is ours and refilled next step
        mine = rows.result()
        bucket.out = torch.empty_like(bucket.send)
        # The gather as an all-to-all of W copies (the same bytes): on gloo it costs half an all_gather.
        bucket.gather = dist.all_to_all_single(bucket.out, mine.repeat(w), group=self.group, async_op=True)
        self.bytes_sent += 2 * (w - 1) * bucket.chunk * bucket.send.element_size()
        self._summed += 1

    def local(self, j: int) -> torch.Tensor:
        """Parameter ``j``'s local sum as packed (flat); ``j`` = the number of parameters: the extra's."""
        if j == len(self.params):
            last = self.buckets[-1]
            return last.send[last.numel : last.numel + last.extra]
        bucket, offset = self.where[j]
        return bucket.send[offset : offset + self.params[j].numel()]

    def finish(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Completes every bucket (all must have started). Returns each parameter's reduced gradient
        (flat, in parameter order) and the reduced extra."""
        if self._started != len(self.buckets):
            raise RuntimeError(
                f"finish() with {len(self.buckets) - self._started} of {len(self.buckets)} gradient "
                f"buckets not started: parameters {self.unpacked()[:5]} were never packed"
            )
        while self._summed < len(self.buckets):
            self._sum_and_gather()
        reduced: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            bucket.gather.wait()
            for j, offset in zip(bucket.params, bucket.offsets):
                reduced[j] = bucket.out[offset : offset + self.params[j].numel()]
        last = self.buckets[-1]
        extra = last.out[last.numel : last.numel + last.extra]
        self._reset()
        return reduced, extra

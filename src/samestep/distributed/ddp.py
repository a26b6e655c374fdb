"""DDP with the canonical reduction, as a communication hook: the user keeps ``DistributedDataParallel``, and
its gradients come out with the bits of one process on any number of processes (docs/layouts.md).

    ddp = DistributedDataParallel(model)
    state = CanonicalDdpState(microbatches_per_process=k)
    ddp.register_comm_hook(state, canonical_ddp_hook)
    state.watch(optimizer)                                # an update before the last microbatch is refused
    for step in steps:
        for i in state.microbatches:                      # this rank's global microbatch indices
            with state.microbatch(ddp, i):                # no_sync() for the first of each pair
                loss = loss_of(ddp, batch(step, i)) / (k * world_size)   # a sum over the global batch
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

DDP hands the hook each bucket after every backward. The hook keeps each parameter's gradient of every
microbatch pair (keyed by the parameter, so DDP's rebuild of its buckets after the first backward moves
nothing) and folds them along the canonical tree as they come (``BinaryCounter``, as ``CanonicalGradients``
does): the first of a pair stays in ``p.grad`` for the next backward to add into, after the second DDP gets
negative zeros, the exact additive identity, so the next pair starts alone in ``p.grad``. At the last
microbatch each bucket's local sums are combined across ranks in rank order (``PendingCombine``, as
``combine_across_ranks``: the bytes of a ring all-reduce): its all-to-all starts as DDP hands the bucket
over, and the sums and all-gathers run at DDP's last bucket; DDP writes the result into ``p.grad``. The
hook sums: it does not divide by the world size as DDP's own hook does, so the loss is normalised by the
global batch, which the number of processes does not change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import torch

from samestep.distributed.reduce import PendingCombine
from samestep.distributed.tree import BinaryCounter, validate_layout

__all__ = ["CanonicalDdpState", "canonical_ddp_hook"]


class CanonicalDdpState:
    """The state of ``canonical_ddp_hook`` (``ddp.register_comm_hook(state, canonical_ddp_hook)``, as DDP's
    own stateful hooks take theirs): each parameter's gradients reduced along the canonical tree over this
    process's ``microbatches_per_process`` microbatches, then across ranks in rank order.
    ``microbatches``: this rank's global microbatch indices. ``bytes_sent``: what the combine sent.

    Raises:
        ValueError: a layout the canonical tree cannot make invariant (``validate_layout``), naming one it can.
    """

    def __init__(
        self,
        microbatches_per_process: int,
        *,
        world_size: int | None = None,
        rank: int | None = None,
        group: Any = None,
    ) -> None:
        import torch.distributed as dist

        self.group = group
        self.world_size = dist.get_world_size(group) if world_size is None else world_size
        self.rank = dist.get_rank(group) if rank is None else rank
        self.k = microbatches_per_process
        validate_layout(self.world_size, self.k)
        self.bytes_sent = 0
        self._sums: dict[int, BinaryCounter] = {}
        self._seen: dict[int, int] = {}
        self._started: list[tuple[PendingCombine, torch.futures.Future]] = []
        self._carried = False  # the first of a pair ran under no_sync(): p.grad holds it, the hook never saw it

    @property
    def microbatches(self) -> range:
        """The global microbatch indices this process owns."""
        return range(self.rank * self.k, (self.rank + 1) * self.k)

    @contextlib.contextmanager
    def microbatch(self, ddp: Any, microbatch: int) -> Generator[None, None, None]:
        """Around a microbatch's forward and backward (global index ``microbatch``, of this process's range): the
        first of each pair runs under ``ddp.no_sync()``, so DDP neither copies its gradients into its buckets
        nor calls the hook, and the next backward adds into ``p.grad`` (the tree's first level, the same bits
        as without this context, at DDP's own cost). Optional: without it every backward reaches the hook."""
        j = microbatch - self.microbatches.start
        if not 0 <= j < self.k:
            raise ValueError(
                f"CanonicalDdpState.microbatch({microbatch}): rank {self.rank} owns "
                f"{self.microbatches.start}..{self.microbatches.stop - 1}"
            )
        if j % 2 == 0 and j + 1 < self.k:
            with ddp.no_sync():
                yield
            self._carried = True
            return
        try:
            yield
        finally:
            self._carried = False

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuses an update made before this process's last microbatch of the step (a step pre-hook): its
        gradients would be the negative zeros handed to DDP meanwhile, not the step's."""
        optimizer.register_step_pre_hook(self._check_complete)

    def _check_complete(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._seen or self._carried:
            done = max(self._seen.values(), default=0) + self._carried
            raise RuntimeError(
                f"canonical_ddp_hook: the optimizer stepped after {done} of the {self.k} microbatches "
                "this process owns in a step; run backward on all of them first (the gradients are "
                "reduced at the last)"
            )

    def reduce_bucket(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], buffer: torch.Tensor, last: bool = True
    ) -> torch.futures.Future:
        """What DDP writes back into the bucket after a backward (``grads``: views of ``buffer``). The tree's
        first level adds microbatches in pairs, as ``CanonicalGradients`` does: after the first of a pair the
        bucket goes back as it is, and the next backward adds into ``p.grad`` (autograd's in-place add, the
        bits of ``left + right``); after the second the pair's sum joins each parameter's tree and DDP gets
        negative zeros; after the process's last microbatch, the canonical sums across ranks: each bucket's
        all-to-all starts as DDP hands it over (the rest of the backward runs meanwhile), and at DDP's
        ``last`` bucket every started bucket is summed over ranks and gathered, in bucket order."""
        counts = set()
        ran = 2 if self._carried else 1  # a pair whose first ran under no_sync() (``microbatch``) comes whole
        for p in params:
            self._seen[id(p)] = self._seen.get(id(p), 0) + ran
            counts.add(self._seen[id(p)])
        if len(counts) != 1:
            raise RuntimeError(
                "canonical_ddp_hook: a bucket's parameters got gradients in different numbers of "
                "microbatches (a parameter unused in some); give every parameter a gradient in "
                "every microbatch"
            )
        done = counts.pop()
        fut: torch.futures.Future = torch.futures.Future()
        if done % 2 == 1 and done < self.k:
            fut.set_result(buffer)  # the first of a pair: kept, the next backward adds into it
            return fut
        for p, g in zip(params, grads):
            self._sums.setdefault(id(p), BinaryCounter()).push(g.detach().clone(), size=2 if done % 2 == 0 else 1)
        if done < self.k:
            # -0.0 + x is x for every x (+0.0 + -0.0 would not be): the next backward's gradient alone
            fut.set_result(torch.full_like(buffer, -0.0))
            return fut
        for p, g in zip(params, grads):
            g.copy_(self._sums.pop(id(p)).result())
            del self._seen[id(p)]
        if self.world_size == 1:
            fut.set_result(buffer)
            return fut
        self._started.append((PendingCombine(buffer.detach(), self.world_size, self.group), fut))
        if last:
            started, self._started = self._started, []
            for combine, _ in started:
                combine.gather()
            for combine, pending in started:
                self.bytes_sent += combine.sent
                pending.set_result(combine.wait())
        return fut


# No annotations on bucket and the return: DDP refuses any but dist.GradBucket and Future[Tensor] as objects,
# and this module's annotations are strings
def canonical_ddp_hook(state, bucket):  # noqa: ANN001, ANN201
    """DDP's communication hook for a ``CanonicalDdpState`` (the module docstring says what it does)."""
    return state.reduce_bucket(bucket.parameters(), bucket.gradients(), bucket.buffer(), bucket.is_last())

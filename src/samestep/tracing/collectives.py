"""Collectives at the step level: PyTorch DDP's bucket all-reduces and FSDP2's gradient reduce-scatters,
each recorded as its input (copied before) and its output (taken when it completes), in bucket or call
order, never in the order they finished. With them, a rank whose gradients differ only because another
rank's did is a receiver in ``samestep diff``, not an origin.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from samestep.tracing.staging import RecorderView

__all__ = ["Collectives", "FsdpReduceScatter"]

_first = operator.itemgetter(0)


class Collectives:
    """The reductions seen in this step, until the recorder records them (``record_done``)."""

    def __init__(self, rec: RecorderView) -> None:
        self.rec = rec
        self._done: list[tuple[int, str, torch.Tensor, torch.Tensor]] = []  # (order, op, input, output)
        self._lock = threading.Lock()  # a communication thread may complete a reduction
        self.calls = 0  # FsdpReduceScatter's calls in this step (their order)

    @property
    def pending(self) -> bool:
        return bool(self._done)

    def new_step(self) -> None:
        self.calls = 0

    def reduced(self, index: int, name: str, before: torch.Tensor, out: torch.Tensor) -> None:
        """A reduction seen by ``ddp_comm_hook`` or ``FsdpReduceScatter``, for ``record_done``."""
        with self._lock:
            self._done.append((index, name, before, out))

    def record_done(self) -> None:
        """The reductions seen since the last call, as records in their order (bucket, or call)."""
        with self._lock:
            done, self._done = sorted(self._done, key=_first), []
        for _, name, before, out in done:
            self.rec.record(name, [out], [before], scope="collective")

    def ddp_comm_hook(self, inner: Callable | None = None) -> Callable:
        """A communication hook for DDP (see ``Recorder.ddp_comm_hook``)."""
        if inner is None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook as inner

            name = "ddp.allreduce"
        else:
            name = f"ddp.{getattr(inner, '__name__', type(inner).__name__)}"
        rec = self.rec

        # No annotations on bucket and return: DDP refuses any but dist.GradBucket and Future[Tensor] as
        # objects, and this module's annotations are strings
        def hook(state, bucket):  # noqa: ANN001, ANN202
            if not rec.active:
                return inner(state, bucket)
            with _disable_current_modes():  # at op level: our copy is not one of the model's ops
                index, before = bucket.index(), bucket.buffer().detach().clone()

            def done(fut: Any) -> torch.Tensor:
                out = fut.value()
                out = out[0] if isinstance(out, (list, tuple)) else out
                self.reduced(index, name, before, out)
                return out

            return inner(state, bucket).then(done)

        return hook


class FsdpReduceScatter:
    """FSDP2's ``ReduceScatter`` comm interface (``allocate`` and the call), recording (see
    ``Recorder.fsdp_reduce_scatter``)."""

    def __init__(self, rec: RecorderView, collectives: Collectives) -> None:
        self._rec, self._collectives = rec, collectives

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        import torch.distributed as dist

        if not self._rec.active:
            return dist.reduce_scatter_single(
                output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
            )
        seen = self._collectives
        index, seen.calls = seen.calls, seen.calls + 1
        with _disable_current_modes():  # at op level: our copies are not the model's ops
            before = input_tensor.detach().clone()

        def done(_: Any = None) -> None:
            with _disable_current_modes():  # a copy: FSDP2 divides the output in place afterwards
                seen.reduced(index, "fsdp.reduce_scatter", before, output_tensor.detach().clone())

        work = dist.reduce_scatter_single(
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
        )
        if work is None:
            done()
        else:
            work.get_future().then(done)
        return work

"""Pipeline parallelism on the canonical tree: ``torch.distributed.pipelining`` runs the stages and its schedule
(GPipe, 1F1B) orders the microbatches' forwards and backwards; samestep replaces only the sums it leaves open
(docs/layouts.md, "Pipeline parallelism").

- Each stage's gradients: pipelining adds every microbatch's backward into ``p.grad`` (``((m0+m1)+m2)+m3``);
  ``CanonicalStage`` hands each microbatch's gradients to the stage's ``CanonicalGradients`` as its backward
  ends, which sums them along the canonical tree, over the stage's data ranks too.
- A weight two stages use (the GPT's head, tied to the first stage's embedding): ``TiedWeight`` sends the last
  stage's gradient of each microbatch to the first, which adds it to the embedding's before that microbatch is
  accumulated, as autograd adds the two uses in one process; after each update the first stage sends the
  weight back.
- The loss and the norm: the loss is the last stage's, sent to every stage; the norm's row sums are gathered
  in stage order (``canonical_grad_norm(over=...)``), the vector one process sums.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CanonicalStage", "TiedWeight", "broadcast_from"]


def _stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage


class CanonicalStage:
    """A ``PipelineStage`` whose every microbatch's backward ends with ``after_backward(chunk, loss)`` (the
    schedule's chunk index; the loss the last stage's backward started from, None elsewhere), where the
    gradients of that microbatch alone lie in ``p.grad`` added to what the tree left there. Only the schedules
    that run one full backward per microbatch in chunk order (GPipe, 1F1B) call it so; ``make`` builds one."""

    @staticmethod
    def make(module: torch.nn.Module, stage_index: int, num_stages: int, device: torch.device, group: Any,
             after_backward: Callable[[int, torch.Tensor | None], None], inputs: tuple[torch.Tensor, ...],
             outputs: tuple[torch.Tensor, ...]) -> Any:
        """``inputs`` and ``outputs``: a microbatch's (meta tensors will do), so that pipelining takes the
        shapes as given instead of running a forward on placeholders to infer them."""
        base = _stage_class()

        class _Stage(base):  # type: ignore[misc, valid-type]
            def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                                   last_backward: bool = False) -> None:
                if not full_backward:
                    raise RuntimeError("CanonicalStage: a schedule that splits the backward (input, then weight "
                                       "gradients) is not supported; use parallel.pp_schedule=gpipe or 1f1b")
                super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=True, last_backward=last_backward)
                after_backward(bwd_chunk_id, None if loss is None else loss.detach())

        return _Stage(module, stage_index, num_stages, device, input_args=inputs, output_args=outputs, group=group)


class TiedWeight:
    """One weight used on the first stage (``first``: that rank's parameter) and the last (``last``: that
    rank's copy), over a process group of the two (``group``; ``peer``: the other rank's global rank).

    On the last stage each microbatch's gradient of the copy is sent (``send``) and the copy's ``.grad``
    cleared; on the first, a hook adds the received one to the parameter's gradient of the same microbatch
    before autograd accumulates it: the sum of the two uses that one process's autograd forms (two terms: in
    either order the same bits). ``sync()`` after each optimizer step sends the updated weight to the copy.

    ``per_microbatch=False`` is the usual way instead (Megatron's embedding all-reduce, for the loop with
    deterministic mode off): each side accumulates its own gradient over the microbatches, and ``add_step()``
    adds the copy's sum to the first stage's once a step: a step's bytes once, other bits."""

    def __init__(self, weight: torch.nn.Parameter, *, is_first: bool, peer: int, group: Any,
                 per_microbatch: bool = True) -> None:
        self.weight, self.is_first, self.peer, self.group = weight, is_first, peer, group
        self.per_microbatch = per_microbatch
        self._sends: list[Any] = []
        if is_first and per_microbatch:
            weight.register_hook(self._add_received)

    def _add_received(self, grad: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        local = _local(grad)  # a tensor-parallel weight: this tensor rank's shard, the copy's alike
        other = torch.empty_like(local)
        dist.recv(other, src=self.peer, group=self.group)
        if local is grad:
            return grad + other
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local + other, grad.device_mesh, grad.placements,  # type: ignore[attr-defined]
                                  run_check=False, shape=grad.shape, stride=grad.stride())

    def send(self) -> None:
        """The last stage, after a microbatch's backward: its gradient of the copy to the first stage (once a
        step, by ``add_step``, where not ``per_microbatch``)."""
        import torch.distributed as dist

        if not self.per_microbatch:
            return
        grad, self.weight.grad = self.weight.grad, None
        local = _local(grad) if grad is not None else torch.zeros_like(_local(self.weight))
        local = local.contiguous()
        self._sends.append((dist.isend(local, dst=self.peer, group=self.group), local))

    def add_step(self) -> None:
        """Not ``per_microbatch``, after the step's last backward: the copy's accumulated gradient added to the
        first stage's (on both: a send and a receive)."""
        import torch.distributed as dist

        if self.per_microbatch:
            return
        if self.is_first:
            local = _local(self.weight.grad)
            other = torch.empty_like(local)
            dist.recv(other, src=self.peer, group=self.group)
            local.add_(other)
        else:
            grad, self.weight.grad = self.weight.grad, None
            dist.send(_local(grad).contiguous(), dst=self.peer, group=self.group)

    def sync(self) -> None:
        """After the optimizer step, on both: the sends done, the first stage's weight copied to the last's."""
        import torch.distributed as dist

        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        with torch.no_grad():
            local = _local(self.weight)
            if self.is_first:
                dist.send(local.detach().contiguous(), dst=self.peer, group=self.group)
            else:
                received = torch.empty_like(local)
                dist.recv(received, src=self.peer, group=self.group)
                local.copy_(received)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    return t.to_local() if type(t).__name__ == "DTensor" else t  # type: ignore[attr-defined]


def broadcast_from(value: torch.Tensor, src: int, group: Any) -> torch.Tensor:
    """``value`` of global rank ``src``, on every rank of ``group`` (a copy: the same bits)."""
    import torch.distributed as dist

    out = value.detach().clone()
    dist.broadcast(out, src=src, group=group)
    return out

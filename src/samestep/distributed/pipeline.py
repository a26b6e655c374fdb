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

from samestep.distributed.shards import local_shard

__all__ = ["CanonicalStage", "TiedWeight", "broadcast_from", "canonical_stage", "canonical_stage_of"]


def _stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage


class CanonicalStage:
    """A ``PipelineStage`` whose every microbatch's backward ends with ``after_backward(chunk, loss)`` (the
    schedule's chunk index; the loss the last stage's backward started from, None elsewhere), where the
    gradients of that microbatch alone lie in ``p.grad`` added to what the tree left there. Only the schedules
    that run one full backward per microbatch in chunk order (GPipe, 1F1B) call it so; ``make`` builds one,
    ``adopt`` turns a stage a framework built into one. Each chunk's forward and backward run inside
    ``scope(chunk)`` (a trace recorder's microbatch)."""

    @staticmethod
    def make(
        module: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        group: Any,
        after_backward: Callable[[int, torch.Tensor | None], None],
        inputs: tuple[torch.Tensor, ...],
        outputs: tuple[torch.Tensor, ...],
        scope: Callable[[int], Any],
    ) -> Any:
        """``inputs`` and ``outputs``: a microbatch's (meta tensors will do), so that pipelining takes the
        shapes as given instead of running a forward on placeholders to infer them."""
        stage = _stage_class()(
            module, stage_index, num_stages, device, input_args=inputs, output_args=outputs, group=group
        )
        return CanonicalStage.adopt(stage, after_backward, scope)

    @staticmethod
    def adopt(
        stage: Any, after_backward: Callable[[int, torch.Tensor | None], None], scope: Callable[[int], Any]
    ) -> Any:
        """``stage`` (a ``PipelineStage``), its chunk methods wrapped in place (the schedule calls them through
        the instance), returned. A stage module that FSDP2 wraps whole gets FSDP2's post-backward after each
        microbatch, where pipelining defers it to the step's end (``perform_reduce_grad``)."""
        from torch.distributed.fsdp import FSDPModule

        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
        # a stage module FSDP2 wraps whole (torchtitan's, a shard degree of 1 included): its post-backward, which
        # puts the microbatch's gradients in p.grad, run after each microbatch as a plain backward() runs it
        fsdp = isinstance(stage.submod, FSDPModule)

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            with scope(fwd_chunk_id):
                return forward(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(
            bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
        ) -> None:
            if not full_backward:
                raise RuntimeError(
                    "CanonicalStage: a schedule that splits the backward (input, then weight "
                    "gradients) is not supported; use a GPipe or 1F1B schedule"
                )
            with scope(bwd_chunk_id):
                backward(bwd_chunk_id, loss=loss, full_backward=True, last_backward=last_backward)
                if fsdp:  # see above
                    stage.perform_reduce_grad(1)
            after_backward(bwd_chunk_id, None if loss is None else loss.detach())

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
        return stage


def canonical_stage(
    module: torch.nn.Module,
    stage_index: int,
    num_stages: int,
    device: torch.device,
    *,
    grads: Any,
    group: Any = None,
    input_args: Any = None,
    output_args: Any = None,
    scope: Callable[[int], Any] | None = None,
) -> Any:
    """A ``torch.distributed.pipelining.PipelineStage`` of a loop of one's own whose microbatch gradients are
    summed in the order one process sums them: after each microbatch's backward, ``grads`` (a
    ``CanonicalGradients`` over this stage's parameters, over its data ranks where there are several; or
    ``FsdpGradients``) takes them as that microbatch's (``grads.microbatches[chunk]``, the last stage's loss as
    its extra). Run it with ``ScheduleGPipe`` or ``Schedule1F1B`` (``scale_grads=False``, the loss normalised by
    the whole step's size as one process normalises it); after ``schedule.step`` every stage calls
    ``grads.reduce()``, the last stage's result being the step's loss sum (``broadcast_from`` sends it to the
    others), and ``clip_grad_norm_(params, max_norm, over=pipe_group)`` gives one process's norm.
    ``input_args``, ``output_args``: a microbatch's inputs and outputs of this stage (meta tensors will do; as
    ``PipelineStage`` takes them). ``scope(i)``: a context around microbatch i's forward and backward (a
    ``samestep.trace`` recorder's ``microbatch``), or None. docs/layouts.md, "Pipeline parallelism"."""
    after_backward, in_scope = _handing(grads, lambda chunk: grads.microbatches[chunk], scope)
    return CanonicalStage.make(
        module, stage_index, num_stages, device, group, after_backward, input_args, output_args, in_scope
    )


def canonical_stage_of(
    stage: Any, *, grads: Any, microbatch: Callable[[int], int] | None = None, scope: Callable[[int], Any] | None = None
) -> Any:
    """``canonical_stage`` for a ``PipelineStage`` already built (a framework's, such as torchtitan's
    pipelining function makes): its microbatch gradients handed to ``grads`` as their backwards end.
    ``microbatch(chunk)``: the global microbatch index of the schedule's chunk (default
    ``grads.microbatches[chunk]``; a step of several ``schedule.step`` calls numbers each call's chunks on)."""
    index = microbatch or (lambda chunk: grads.microbatches[chunk])
    after_backward, in_scope = _handing(grads, index, scope)
    return CanonicalStage.adopt(stage, after_backward, in_scope)


def _handing(grads: Any, index: Callable[[int], int], scope: Callable[[int], Any] | None) -> tuple[Any, Any]:
    """The stage's callbacks: each chunk's gradients to ``grads`` as microbatch ``index(chunk)``, and each chunk's
    forward and backward inside ``scope(index(chunk))``."""
    import contextlib

    def after_backward(chunk: int, loss: torch.Tensor | None) -> None:
        grads.accumulate(index(chunk), extra=loss)

    def in_scope(chunk: int) -> Any:
        return scope(index(chunk)) if scope is not None else contextlib.nullcontext()

    return after_backward, in_scope


class TiedWeight:
    """One weight used on the first stage and the last (the GPT's embedding and head), over a process group of the
    two (``group``; ``peer``: the other rank's global rank). ``weight``: this rank's parameter.

    ``per_microbatch`` (the canonical path): one process's autograd adds the two uses' gradients of each
    microbatch (two terms: either order, the same bits) before accumulating them, so the stages do the same,
    and the last stage owns the weight: after each microbatch's backward the first stage sends the rows of its
    gradient that are not +0.0 (an embedding's: the microbatch's tokens' rows, a microbatch's tokens x width at
    most), and at the step's end (``add_step``) the last stage adds each to its own gradient of that microbatch,
    sums them along the canonical tree and over ``data_group`` (the stage's data ranks) as the canonical
    reduction does, and sets its ``.grad``. Otherwise the usual way (Megatron's embedding all-reduce, for the
    loop with deterministic mode off): the first stage owns it, each side accumulates over the microbatches,
    and ``add_step`` adds the last stage's sum to the first's once a step: other bits. After each optimizer
    step ``sync`` sends the owner's weight to the other."""

    def __init__(
        self,
        weight: torch.nn.Parameter,
        *,
        is_first: bool,
        peer: int,
        group: Any,
        per_microbatch: bool = True,
        data_group: Any = None,
    ) -> None:
        self.weight, self.is_first, self.peer, self.group = weight, is_first, peer, group
        self.per_microbatch, self.data_group = per_microbatch, data_group
        self.owns = is_first != per_microbatch
        self._sends: list[Any] = []
        self._pending: list[torch.Tensor | None] = []  # the last stage's gradient of each microbatch
        if is_first and per_microbatch:
            weight.register_hook(self._send_rows)

    def _send_rows(self, grad: torch.Tensor) -> None:
        import torch.distributed as dist

        local = local_shard(grad).contiguous()  # a tensor-parallel weight: this tensor rank's shard, the copy's alike
        held = local.view(local.shape[0], -1).view(torch.uint8).ne(0).any(1)  # rows with a bit set
        index = held.nonzero().view(-1)
        rows = local.index_select(0, index)
        count = torch.tensor([index.numel()], dtype=torch.int64, device=local.device)
        for t in (count, index, rows):
            self._sends.append((dist.isend(t, dst=self.peer, group=self.group), t))

    def after_backward(self) -> None:
        """After a microbatch's backward on this stage: the copy's gradient dropped (its rows went in the hook),
        or the owner's kept as that microbatch's (``per_microbatch``)."""
        if not self.per_microbatch:
            return
        if not self.is_first:
            self._pending.append(self.weight.grad)
        self.weight.grad = None

    def add_step(self) -> None:
        """After the step's last backward, on both: the owner's ``.grad`` made (see the class docstring)."""
        import torch.distributed as dist

        if not self.per_microbatch:
            if self.is_first:
                local = local_shard(self.weight.grad)
                other = torch.empty_like(local)
                dist.recv(other, src=self.peer, group=self.group)
                local.add_(other)
            else:
                grad, self.weight.grad = self.weight.grad, None
                dist.send(local_shard(grad).contiguous(), dst=self.peer, group=self.group)
            return
        if self.is_first:
            return
        from samestep.distributed.reduce import tree_across_ranks
        from samestep.distributed.tree import BinaryCounter

        counter, like = BinaryCounter(), local_shard(self.weight)
        for grad in self._pending:
            count = torch.empty(1, dtype=torch.int64, device=like.device)
            dist.recv(count, src=self.peer, group=self.group)
            index = torch.empty(int(count), dtype=torch.int64, device=like.device)
            rows = torch.empty((int(count), *like.shape[1:]), dtype=like.dtype, device=like.device)
            for t in (index, rows):
                dist.recv(t, src=self.peer, group=self.group)
            first = torch.zeros_like(like).index_copy_(0, index, rows)  # the first stage's, bit for bit
            counter.push((local_shard(grad) if grad is not None else torch.zeros_like(like)).add(first))
        self._pending.clear()
        total = tree_across_ranks([counter.result()], self.data_group)
        self.weight.grad = _like(total, self.weight)

    def sync(self) -> None:
        """After the optimizer step, on both: the sends done, the owner's weight copied to the other."""
        import torch.distributed as dist

        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        with torch.no_grad():
            local = local_shard(self.weight)
            if self.owns:
                dist.send(local.detach().contiguous(), dst=self.peer, group=self.group)
            else:
                received = torch.empty_like(local)
                dist.recv(received, src=self.peer, group=self.group)
                local.copy_(received)


def _like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's part) placed as ``p`` where ``p`` is a DTensor."""
    if type(p).__name__ != "DTensor":
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        p.device_mesh,
        p.placements,
        run_check=False,  # type: ignore[attr-defined]
        shape=p.shape,
        stride=p.stride(),
    )


def broadcast_from(value: torch.Tensor, src: int, group: Any) -> torch.Tensor:
    """``value`` of global rank ``src``, on every rank of ``group`` (a copy: the same bits)."""
    import torch.distributed as dist

    out = value.detach().clone()
    dist.broadcast(out, src=src, group=group)
    return out

"""The recorder: the capture ladder (step, module, op) written as one ordered stream per rank.

    rec = samestep.trace(run_dir, level="op", steps={1, 2, 3}, rank=rank)
    rec.attach(model)
    ddp.register_comm_hook(None, rec.ddp_comm_hook())   # under PyTorch DDP: its reductions recorded too
    fsdp_module.set_custom_reduce_scatter(rec.fsdp_reduce_scatter())   # under FSDP2, likewise
    for step in ...:
        with rec.step(step):
            for i in my_microbatches:
                with rec.microbatch(i):
                    loss = model(...); loss.backward()
            rec.grads(model.named_parameters())
            optimizer.step()
            rec.state(model, optimizer)
    rec.close()

Levels (each includes the ones before):
- ``step``: loss and grad-norm bits, each parameter's gradient after reduction, parameters, buffers
  and optimizer state after the update, each collective's input and output;
- ``module``: every module's forward output and the gradient arriving at it in backward, by path;
- ``op``: every ATen op's input and output digests (a TorchDispatchMode), scoped by module; the
  scope follows the op into backward through hooks on module outputs.

Observing never perturbs (docs/design.md, invariant 3): what is recorded is digested later in batches,
by a worker (``process_worker.py``, a child process on Linux CPU, else ``thread_worker.py``) while
training continues; nothing
the model computes is changed, unless a ``Perturb`` is given on purpose. Op outputs and gradients are
copied into reused chunks (and buffers, which a forward may change); parameters and optimizer state
are digested where they lie before the next update may change them, by their state checksum (the pass
the receipts share, ``checksums.StepChecksums``); module outputs and their
gradients too, and each is checked unchanged (its version counter) once its digest is done: a change
in place raises, naming the record (``copy=True`` copies them instead); so are parameter gradients
with ``grads(..., copy="checked")``. Records are kept in flat columns (``batch.py``), digests are
computed for a whole batch at once (``digests.lanes_packed``), and the stream gets one record batch per
flush.

This class is the protocol; each level makes its records in a file of its own (``step_level.py``,
``module_level.py``, ``op_level.py``, ``collectives.py``) through ``staging.py``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from samestep.determinism.mode import active_report
from samestep.hashing.checksums import StepChecksums
from samestep.hashing.state import persistent_buffers
from samestep.tracing.collectives import Collectives, FsdpReduceScatter
from samestep.tracing.handoff import Handoff
from samestep.tracing.hooks import module_paths, outside_compile
from samestep.tracing.knob_watch import KnobWatch
from samestep.tracing.module_level import ModuleRecords
from samestep.tracing.op_level import OpMode, Scopes
from samestep.tracing.perturb import Perturb
from samestep.tracing.selection import LEVELS, WORKERS
from samestep.tracing.staging import Staging
from samestep.tracing.step_level import StepRecords
from samestep.tracing.stream import END

__all__ = ["Recorder"]

_MODULE = LEVELS.index("module")
_OP = LEVELS.index("op")


class Recorder:
    """Writes this rank's trace stream; see the module docstring for the protocol."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        level: str = "op",
        steps: set[int] | None = None,
        ranks: set[int] | None = None,
        rank: int = 0,
        perturb: Perturb | None = None,
        meta: dict[str, Any] | None = None,
        copy: bool = False,
        worker: str = "auto",
    ) -> None:
        if level not in LEVELS:
            raise ValueError(f"trace level {level!r} is unknown; use one of {', '.join(LEVELS)}")
        if worker not in WORKERS:
            raise ValueError(f"trace worker {worker!r} is unknown; use one of {', '.join(WORKERS)}")
        self.level, self.steps, self.rank, self.perturb = level, steps, rank, perturb
        # "auto" is a thread: the child process measured no cheaper here (docs/performance.md, Tracing),
        # so it is opt-in.
        self.worker = "thread" if worker == "auto" else worker
        self.enabled = level != "off" and (ranks is None or rank in ranks)
        # what a gradient changed in place after rec.grads() is reported as (samestep.Run: its loop's mistake)
        self.grads_changed: Callable[[int, str], Exception] | None = None
        self._paused = False
        self._rank_level = LEVELS.index(level)
        self.run_dir = Path(run_dir)
        self._meta = {"rank": rank, "level": level, **(meta or {})}
        self._staging = Staging()
        self._staging.full = self.flush
        self._scopes = Scopes(self)
        self._modules = ModuleRecords(self, self._staging, copy)
        self._steps = StepRecords(self, self._staging)
        # Each step's pass over the state tensors for their records: a RunProtocol hands its own, which its
        # receipts share (each tensor hashed once a step for both).
        self.checksums = StepChecksums()
        self._collectives = Collectives(self)
        self._hooks: list[Any] = []
        # the digest worker, handed each flush's batch; it opens the stream at the first flush (nothing is
        # written before)
        self._handoff = Handoff(self.run_dir, rank, self._meta, self.worker, self._staging)
        self._handoff.grads_changed = lambda step, name: (
            self.grads_changed(step, name) if self.grads_changed is not None else None
        )
        # The enable() in force (None if none): a knob it set that no longer holds at a step is recorded in
        # numerics_changed (the first such step), and on_close (samestep.trace's) puts it in run.json.
        self._knobs = KnobWatch(active_report())
        self.failed_step: int | None = None  # the last step whose context raised
        self.on_close: Callable[[Recorder], None] | None = None
        if self.enabled and self.worker == "process":
            # Started now: the child imports torch (about 1.5 s) while the model is built and the first
            # step runs, instead of after the first flush, which would then wait for it.
            self._handoff.start()

    @property
    def numerics_changed(self) -> dict[str, Any] | None:
        """The first step at which a knob enable() set no longer held (``KnobWatch.changed``), or None."""
        return self._knobs.changed

    # -- selection -------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether the current step is recorded."""
        return self.enabled and not self._paused and (self.steps is None or self._staging.step in self.steps)

    @property
    def records(self) -> int:
        """The records made so far: what the stream holds once the recorder has closed."""
        return self._staging.seq

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing inside is recorded (a check that runs a microbatch again is not the run's computation)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    @property
    def modules_on(self) -> bool:
        """Whether module records are taken now (checked in every module hook)."""
        return self._rank_level >= _MODULE and self.active

    @property
    def reads_in_place(self) -> bool:
        """Whether the worker reads tensors where they lie from their descriptions (the process worker)."""
        return self._handoff.in_process

    # -- records and flushes ---------------------------------------------------------------------------
    def record(
        self,
        op: str,
        outputs: Iterable[torch.Tensor],
        inputs: Iterable[torch.Tensor] = (),
        scope: str = "",
        phase: str = "step",
        copy: bool | str = True,
    ) -> None:
        """Records one named event with its tensors (used by the step level and by user code).

        ``copy=False`` digests the live tensors instead of copies: only for tensors that stay unchanged
        until the next ``grads()`` call (see ``state``). ``copy="checked"`` digests the live tensors and
        raises at the next ``grads()``, ``flush()`` or ``close()`` if one was changed in place before.
        """
        if not self.active:
            return
        self._modules.drain()
        st = self._staging
        occurrence = st.occurrence(phase, scope, op)
        st.append(
            phase,
            scope,
            op,
            occurrence,
            [st.stage(t, copy=copy) for t in inputs],
            [st.stage(t, copy=copy) for t in outputs],
        )

    def flush(self) -> None:
        """Hands everything staged to the digest worker, which digests it (batched) and appends the
        records to the stream while training goes on. At most one batch is in flight: this waits for
        the previous one first, so the staging memory stays bounded."""
        self._modules.drain()
        if self._collectives.pending:
            self._collectives.record_done()
        self._handoff.wait()
        batch = self._staging.take()
        if not batch.step:
            self._staging.free(batch.packs)
            return
        self._handoff.send(batch)

    def sync(self) -> None:
        """Makes every record of the steps closed so far durable: written and fsync'ed. Call it before
        a checkpoint commits (``samestep train`` does), so a crash right after the commit cannot lose
        the trace of a step the checkpoint holds."""
        self._handoff.sync()

    # -- the protocol ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Everything inside belongs to optimizer step ``step`` (1-based); flushed at the end. A step whose
        context closes normally ends with a ``step.end`` record: one that raised, or a run killed inside
        it, has none (``samestep trace certify`` reports it)."""
        self._modules.drain()
        st = self._staging
        st.new_step(step)
        self._collectives.new_step()
        # DTensor if torch.distributed.tensor was imported (else no DTensor exists): see Staging.shards
        st.dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        if self._knobs.report is not None:
            self._knobs.look(step)
        finished = False
        try:
            yield
            finished = True
        except BaseException:
            self.failed_step = step
            raise
        finally:
            if self.active:
                if finished:
                    if self._collectives.pending:
                        self._collectives.record_done()
                    self.record(END, [])
                self.flush()
        if self.perturb is not None:  # one that never fired is an error (a rank or step not traced at op level too)
            self.perturb.check_fired(step, self.rank)

    @contextlib.contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        """Everything inside belongs to global microbatch ``index``; at op level, ATen ops are recorded."""
        self._modules.drain()
        st = self._staging
        st.mb = index
        token = self._scopes.enter_microbatch()
        knobs = self._knobs.look if self._knobs.report is not None else None
        mode = (
            OpMode(st, self._scopes, self.perturb, self.rank, knobs)
            if self._rank_level >= _OP and self.active
            else None
        )
        try:
            if mode is not None:
                with mode:
                    yield
            else:
                yield
        finally:
            self._modules.drain()
            self._scopes.leave_microbatch(token)
            st.mb = -1

    def attach(self, model: torch.nn.Module) -> None:
        """Module hooks: scopes for the op level, forward outputs and backward gradients for the module level.

        A ``torch.compile``'d module (an ``OptimizedModule``) is the module it wraps: its scopes are the
        uncompiled model's (no ``_orig_mod``), and the wrapper itself gets no hooks (it would record the
        root twice). The hooks run eagerly where compiled code calls them (see ``hooks.outside_compile``)."""
        if not self.enabled or self._rank_level < _MODULE:
            return
        # Code torch.compile compiled before would not call hooks added now (Dynamo skips guards on module
        # hooks by default): its caches are dropped, so the model is compiled anew, with the hooks.
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        for path, module in module_paths(model):
            if self._rank_level >= _OP:
                self._hooks.append(module.register_forward_pre_hook(outside_compile(self._scopes.pre_hook(path))))
                self._hooks.append(module.register_forward_hook(outside_compile(self._scopes.post_hook(path))))
            else:  # module level: no scopes to follow (only ops use them), so fewer hooks
                self._hooks.append(module.register_forward_hook(outside_compile(self._modules.hook(path))))

    def detach(self) -> None:
        """Removes the module hooks that ``attach`` added."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- step level ------------------------------------------------------------------------------------
    def metric(self, name: str, value: float | torch.Tensor) -> None:
        """A scalar of the step (loss, grad norm), recorded as its exact bits."""
        if not self.active:
            return
        if not isinstance(value, torch.Tensor):
            self.record(name, [torch.tensor(value, dtype=torch.float64)], copy=False)  # a tensor of its own
        elif torch._C._len_torch_dispatch_stack():  # inside a mode (op level): copied past it
            self.record(name, [value])
        else:  # a scalar's own copy is cheaper than a place in a staging chunk
            self.record(name, [value.detach().clone()], copy=False)

    def grads(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], copy: bool | str = True) -> None:
        """Every parameter's gradient after the cross-process reduction (call it before the update).

        It first waits for the previous step's digests, which read the parameters and optimizer state
        that ``state`` recorded without copying: the update that follows may change them.
        ``copy="checked"`` digests the gradients where they lie instead of a copy, and raises at the next
        ``grads()``, ``flush()`` or ``close()`` if one was changed in place before: for a loop that changes
        them no more (it clips out of place, or is called after clipping) and gives the next step new ones
        (``zero_grad(set_to_none=True)``). The reference loop does so at step level, where it spares
        copying them (see ``loop.py`` for the module level).
        """
        if copy not in (True, "checked"):
            raise ValueError(f"grads(copy={copy!r}): use True (copies) or 'checked' (the gradients themselves)")
        self._handoff.wait()
        if not self.active:
            return
        if self._collectives.pending:
            self._collectives.record_done()
        self._modules.drain()  # pending module records first: the grad records follow them
        self._steps.grads(named_params, copy)

    def state(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        named_params: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        named_buffers: Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> None:
        """Parameters, buffers and optimizer state after the update.

        Parameters and optimizer state are digested in place, without a copy, so they must not change
        before the next ``grads()`` call (a training loop changes them only in its next update, which
        comes after). Buffers (running statistics, say) are copied: the next forward may change them.
        Only persistent buffers are model state (those in ``state_dict``, which a checkpoint keeps); a
        non-persistent one (an attention mask) is a constant or derived from the state.
        ``named_params``, ``named_buffers``: ``model.named_parameters()`` and
        ``Recorder.persistent_buffers(model)`` as the caller already has them (lists kept from step to
        step spare walking the modules).
        """
        if not self.active:
            return
        self._modules.drain()
        self._steps.state(model, optimizer, named_params, named_buffers)

    @staticmethod
    def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """The model's buffers that are part of its ``state_dict``, by name, each tensor once."""
        return persistent_buffers(model)

    # -- collectives -----------------------------------------------------------------------------------
    def collective(self, name: str, inp: torch.Tensor, out: torch.Tensor) -> None:
        """A collective's input and output (the canonical combine calls this as its observer)."""
        self.record(name, [out], [inp], scope="collective")

    def ddp_comm_hook(self, inner: Callable | None = None) -> Callable:
        """A communication hook for ``torch.nn.parallel.DistributedDataParallel`` that records each
        gradient bucket's reduction as a step-level collective record (scope ``collective``, op
        ``ddp.allreduce``, or ``ddp.<inner's name>``)::

            ddp.register_comm_hook(None, rec.ddp_comm_hook())

        ``inner`` does the reduction (default: DDP's own ``allreduce_hook``, so the gradients are the
        ones DDP computes without a hook) and gets the state given to ``register_comm_hook``. On a traced
        step the bucket is copied before ``inner`` runs and its reduced buffer is taken when the
        reduction completes; both are recorded at the next ``grads()`` (or the step's end) in bucket
        order, so the order in which buckets finish never reaches the stream. Untraced steps only call
        ``inner``.
        """
        return self._collectives.ddp_comm_hook(inner)

    def fsdp_reduce_scatter(self) -> FsdpReduceScatter:
        """A gradient reduce-scatter for FSDP2 (``fully_shard``) that records each call as a step-level
        collective record (scope ``collective``, op ``fsdp.reduce_scatter``): its input (this rank's
        unsharded gradients, copied before) and its output (this rank's reduced shard, copied when it is
        done), recorded at the next ``grads()`` (or the step's end) in call order::

            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_custom_reduce_scatter(rec.fsdp_reduce_scatter())

        It reduces as FSDP2's default does (``torch.distributed.reduce_scatter_single`` into a new buffer),
        so the gradients are the same bits as without it; untraced steps only reduce. With it, a rank whose
        gradients differ only because another rank's did is a receiver in ``samestep diff``, not an origin.
        """
        return FsdpReduceScatter(self, self._collectives)

    def close(self) -> None:
        """Flushes and closes the stream; removes hooks. A closed recorder records nothing (a DDP hook
        of its own only reduces)."""
        self.detach()
        try:
            if self.enabled:
                self.flush()
            self._handoff.wait()
        finally:
            self.enabled = False
            try:
                self._handoff.close()
            finally:
                on_close, self.on_close = self.on_close, None
                if on_close is not None:
                    on_close(self)

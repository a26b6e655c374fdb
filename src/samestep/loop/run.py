"""``samestep.Run``: the whole protocol for a training loop of your own, in one object.

    with samestep.Run("runs/mine", model=model, optimizer=optimizer, data_cursor=cursor) as run:
        for step in run.steps(1000):          # 1-based; a resumed run starts after its newest checkpoint
            for i in range(accumulation):
                with run.microbatch(i):       # global microbatch index (module/op level name records by it)
                    loss = compute_loss(model, cursor.batch(step, i)) / accumulation
                    loss.backward()
            run.metric("loss", loss)
            optimizer.step()                  # the gradients are recorded before it, the state after
            optimizer.zero_grad(set_to_none=True)

It turns deterministic mode on (``samestep.enable``), resumes from the newest intact checkpoint, traces
every step (``samestep.trace``), records the gradients and the state through the optimizer's own step
hooks, makes the trace durable before each checkpoint, saves checkpoints, and on a stop signal finishes
the step, saves, and ends the loop, on every rank after the same step (``run.stopped`` names the
signal; exit with ``samestep.preempt.EXIT_PREEMPTED``). A loop that finishes writes final.json, the digest
of its whole state as one process holds it, the same on any layout. What stays the loop's: the data must be a
pure function of where the run stands (the step and microbatch, or a ``data_cursor`` whose ``state_dict``
holds its position).

On several processes it takes the model as the loop built it: replicated (DDP, or a plain module), rank 0
saves and receipts the whole state; sharded by FSDP2 or split by tensor parallelism (its parameters are
DTensors), every rank saves and receipts its own shards, through the model's own ``state_dict`` and
``load_state_dict`` (their hooks run on every rank), and a checkpoint resumes on any number of processes where
the loop's randomness is keyed (``rng="keyed"``). Every rank calls what may be a collective at the same
points. The protocol itself is ``protocol.RunProtocol``'s. The mistakes a loop makes first (``loop_checks``)
end the program with one line and exit 2.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch

from samestep.checkpoint import LoadedCheckpoint, committed_steps, load_checkpoint, save_checkpoint
from samestep.determinism import mode, preempt
from samestep.distributed.agree import any_rank
from samestep.distributed.fsdp import ShardedModel, ShardedOptimizer
from samestep.distributed.group import rank_and_world
from samestep.distributed.placement import is_sharded, model_layout, refuse_split_heads
from samestep.hashing.checksums import state_hash_for
from samestep.hashing.state import persistent_buffers
from samestep.loop.final_state import write_whole_final
from samestep.loop.protocol import RunProtocol
from samestep.loop.start_checks import (
    check_arguments,
    checkpoints_held,
    declare,
    loader_generators,
    refuse_changes,
    refuse_foreign_parameters,
    refuse_rng_change,
    resume_epoch,
    warn_unheld_scheduler,
)
from samestep.loop.step_checks import (
    GlobalDraws,
    StaleGradients,
    grads_changed_after_update,
    left_inside_a_step,
    second_loop,
    warn_loose_loaders,
)
from samestep.records.receipt_state import state_tree
from samestep.records.receipts import genesis
from samestep.records.rundir import checked_run_dir, checkpoints_dir, holds_run, record_declared
from samestep.replay import program
from samestep.replay.request import ReplayRequest

__all__ = ["Run"]


class Run:
    """A training run of your own loop: deterministic, traced, checkpointed and resumable to the bit.

    Args:
        run_dir: the run directory (``trace/``, ``run.json`` and ``checkpoints/`` go there).
        model, optimizer, scheduler, data_cursor: what a checkpoint holds and a resume restores
            (``scheduler`` and ``data_cursor``: anything with ``state_dict``/``load_state_dict``).
        level: the trace level, ``"step"``, ``"module"``, ``"op"`` or ``"off"``.
        trace_steps: the 1-based steps to trace (a set, or text like ``"1-5"``); ``None`` traces all.
        threads: the intra-op thread count that deterministic mode pins (the bits depend on it).
        kernels: route racy ops through samestep's deterministic kernels (``enable(kernels=...)``).
        checkpoint_every: save every this many steps (and at the last step, and on a stop signal).
        keep: keep only this many newest checkpoints (``None`` keeps all).
        resume: ``"auto"`` resumes when ``run_dir`` holds a checkpoint; ``False`` refuses a run directory
            that holds one (start a new run elsewhere); ``True`` requires one.
        stop_signals: the signals that ask the loop to stop at the next step boundary.
        strict_env: an environment fingerprint at resume that differs in a field that can change a bit is an
            error, not a warning (``checkpoint.load_checkpoint``).
        copy: digest copies of gradients (and, at module level, of module outputs) instead of the tensors
            themselves. Without it they are digested where they lie and checked unchanged until then (a
            change in place, such as ``zero_grad(set_to_none=False)`` before they were digested, raises and
            names this option): what the reference loop does, and cheaper.
        receipts: append a receipt of every step to ``receipts/rank_RRRRR.jsonl`` (rank 0's, of the whole state;
            of a sharded model every rank's, of its own shards; see ``samestep.records.receipts``): the checksum of the
            model, optimizer, scheduler and data cursor state after the update, the bits of the step's ``loss``
            and ``grad_norm`` metrics (NaN where the loop records none), chained by hash. ``samestep receipts
            verify`` checks the chain and the checkpoints.
        config: what else the run holds fixed (a seed, a batch size: any JSON-able dict). With the model's
            parameter names, shapes and dtypes, the optimizer's class and hyperparameters, the scheduler's and
            data cursor's state as built, and the step count given to ``steps()``, it is recorded in run.json
            at the start; a run directory continued under other values is refused, naming them.
        deterministic: turn deterministic mode on (``samestep.enable``); False runs with PyTorch's defaults
            (the other half of an A/B), recorded as such in run.json.
        rng: ``"restore"``: a resume restores each rank's generator states (python, numpy, torch's, the data
            cursor's), and one on another number of processes is refused; ``"keyed"``: every random draw of
            the loop comes from ``samestep.rng.generator`` (keyed by seed, step and microbatch, the same on any
            layout), so a resume on another number of processes, or on another layout, restores none.
        perturb: fault injection for checking ``samestep diff`` and ``bisect``: one ULP planted in the output of
            the op ``"rank=R,step=S,microbatch=M,phase=forward|backward,scope=MODULE.PATH,op=OP"`` where that
            step is traced at op level (``tracing.perturb.Perturb``); a replay plants it again.

    Replayed by ``samestep verify`` or ``bisect`` (a ``SAMESTEP_REPLAY`` request, ``replay_request``), the Run
    works in the request's scratch directory instead of ``run_dir``, traces as the request asks, keeps
    receipts, saves no checkpoint, and ends the process (exit 0) after the request's last step.

    Attributes:
        start: the step the run resumed after (0: a new run). stopped: the signal that stopped the loop, or
            None. sharded: FSDP2 shards the model (each rank saves and receipts its own shards).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        data_cursor: Any = None,
        level: str = "step",
        trace_steps: set[int] | str | None = None,
        threads: int | None = 1,
        kernels: bool = False,
        checkpoint_every: int = 1,
        keep: int | None = None,
        resume: bool | str = "auto",
        stop_signals: tuple[str, ...] = preempt.DEFAULT_SIGNALS,
        strict_env: bool = False,
        copy: bool = False,
        receipts: bool = True,
        config: dict[str, Any] | None = None,
        deterministic: bool = True,
        perturb: str | None = None,
        rng: str = "restore",
    ) -> None:
        check_arguments(checkpoint_every, resume, rng)
        refuse_foreign_parameters(model, optimizer)  # before anything is made or written
        warn_unheld_scheduler(optimizer, scheduler)
        refuse_split_heads(model)
        self._replay = ReplayRequest.for_run(run_dir, "samestep.Run")
        if self._replay is not None:  # the scratch directory, traced as asked, receipted; see replay_request
            run_dir, level, trace_steps = self._replay.into, self._replay.level, self._replay.trace_steps
            receipts, resume = True, "auto"
        self.run_dir = checked_run_dir(run_dir)
        self._generators = loader_generators(data_cursor)
        self.model, self.optimizer, self.scheduler, self.data_cursor = model, optimizer, scheduler, data_cursor
        self.checkpoints = checkpoints_dir(self.run_dir)
        self.checkpoint_every, self.keep = checkpoint_every, keep
        self.stopped: str | None = None  # the signal that stopped the loop, if one did
        self.start = 0  # the step the run resumed after (0: a new run)
        self._signals = stop_signals
        self._hooks: list[Any] = []
        self._stale: StaleGradients | None = None
        self._step: int | None = None
        self._loop: Generator[int, None, None] | None = None
        self._stepped = False  # steps() begins the one loop a run is
        self._total: int | None = None  # the step count given to steps()
        self._implicit: contextlib.ExitStack | None = None  # microbatch 0 of a step, until the loop names one
        self._metrics: dict[str, float] = {}
        self._draws = GlobalDraws(rng)  # draws from the global generator that no checkpoint carries
        held = checkpoints_held(self.checkpoints, resume)
        # one writer per run directory, as samestep train and samestep.trace take it (refused before anything)
        rank, world = rank_and_world()
        self.sharded = is_sharded(model)
        self._proto = RunProtocol(self.run_dir, hold_dir=rank == 0)
        try:
            self._declared = declare(
                self.run_dir, (model, optimizer, scheduler, data_cursor), config, self.sharded, resume
            )
            self.report = (
                self._proto.enable(threads=threads, kernels=kernels, who="samestep.Run")
                if deterministic
                else mode.active_report()
            )
            loaded = self._restore(strict_env, world, rng) if held else None
            # kept from step to step, as the reference loop keeps them: a model gains or loses no parameter
            self._params = list(model.named_parameters())
            self._buffers = persistent_buffers(model)
            # rank 0's receipts of the whole state; sharded, every rank's of its own shards
            keeps_receipts = receipts and RunProtocol.keeps_receipts(rank, self.sharded)
            if receipts:  # a resume that cannot go on fails before anything is written
                self._proto.check_receipts(
                    rank,
                    self.start,
                    (lambda: self._state_tree(self.start)) if keeps_receipts else None,
                    checkpoint=loaded,
                    sharded_over=world if self.sharded else None,
                    agree=any_rank,
                )
            self._trace(level, trace_steps, resume, copy, perturb)
            if rank == 0:
                record_declared(self.run_dir, self._declared)
                # what `samestep verify` and `bisect` run again; a replay's, what it ran (checked against the run's)
                program.record(self.run_dir, self.start, program.describe(self.run_dir))
            self._watch_updates(copy, level)
            if keeps_receipts:
                self._open_receipts(rank, check=deterministic)
        except BaseException:
            self.close()
            raise

    # -- the steps of __init__, in its order ----------------------------------------------------------------
    def _restore(self, strict_env: bool, world: int, rng: str) -> LoadedCheckpoint:
        """The newest intact checkpoint restored: whole tensors, whichever layout wrote them (a sharded model
        takes its shards of them), and the generators where ``rng`` and the process count allow."""
        loaded = load_checkpoint(
            self.checkpoints,
            model=ShardedModel(self.model) if self.sharded else self.model,
            optimizer=ShardedOptimizer(self.optimizer) if self.sharded else self.optimizer,
            scheduler=self.scheduler,
            data_cursor=self.data_cursor,
            fallback=True,
            strict_env=strict_env,
            generators=self._generators,
            restore_rng="same_world_size",
        )
        refuse_rng_change(loaded, world, rng, self._generators)
        self.start = loaded.step
        if self._generators:
            resume_epoch(self.data_cursor, self._generators)
        return loaded

    def _trace(
        self, level: str, trace_steps: set[int] | str | None, resume: bool | str, copy: bool, perturb: str | None
    ) -> None:
        """The trace started; a run killed before its first checkpoint goes on from step 0, in a new segment."""
        continues = self.start > 0 or (resume is not False and holds_run(self.run_dir))
        from samestep.tracing.perturb import Perturb  # the tracing layer loads when a run traces

        self._proto.trace(
            self.model,
            level=level,
            steps=trace_steps,
            resume=continues,
            copy=copy,
            perturb=Perturb.parse(perturb) if perturb else None,
            layout=model_layout(self.model),
            resumed_from=self.start,
        )
        self.recorder.grads_changed = grads_changed_after_update

    def _watch_updates(self, copy: bool, level: str) -> None:
        """The optimizer's hooks that close each step's microbatches and catch stale gradients."""
        self._grad_copy: bool | str = True if copy or level != "step" else "checked"
        self._op_level = level == "op"  # a step that names no microbatch is microbatch 0 (``_implicit``)
        self._hooks = [
            self.optimizer.register_step_pre_hook(self._before_update),
            self.optimizer.register_step_post_hook(self._after_update),
        ]
        self._stale = StaleGradients(self._params)

    def _open_receipts(self, rank: int, check: bool) -> None:
        """The receipts of this rank's state, taken at each step's end (a scheduler may change the optimizer's
        groups before the next update; the next update waits for the receipt of the last). ``check``: the steps
        a resume computes again are checked against the killed segment's receipts."""
        where = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        self._proto.open_receipts(
            rank,
            self.start,
            genesis({}, "samestep.Run"),
            optimizer=self.optimizer,
            state=lambda step: lambda tree=self._state_tree(step): tree,
            hash=state_hash_for(where),
            sharded=self.sharded,
            check_resume=check,
        )

    @property
    def recorder(self) -> Any:
        """The ``samestep.trace`` recorder (for a collective, a DDP hook, or a further record)."""
        return self._proto.recorder

    def _before_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._close_implicit()  # the update and what follows are the step's, outside any microbatch
        if self._step is not None:
            self._stale.check(self._step)  # before the update it would take on two steps' gradients
            self.recorder.grads(self._params, copy=self._grad_copy)

    def _after_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._step is not None:
            self.recorder.state(self.model, optimizer, named_params=self._params, named_buffers=self._buffers)
            self._stale.updated(self._step, self._params)
            self._draws.updated()

    def steps(self, total: int) -> Generator[int, None, None]:
        """Yields the steps ``start + 1`` .. ``total`` (1-based), each inside the recorder's step; after each,
        saves a checkpoint every ``checkpoint_every`` steps and at the last. A stop signal ends the loop
        after the step it arrives in, with a checkpoint of it. A step whose body raises (or leaves the loop
        with ``break``) is recorded as failed when the run closes, and nothing of it is saved. Called once a
        ``Run``: a second call raises ``LoopError`` before it takes a step."""
        if self._stepped:
            raise second_loop(self.run_dir)
        self._stepped, self._total = True, total
        self._loop = self._steps(total)
        return self._loop

    def _steps(self, total: int) -> Generator[int, None, None]:
        refuse_changes(self.run_dir, {"steps": total})
        if rank_and_world()[0] == 0:
            record_declared(self.run_dir, {"steps": total})
        proto = self._proto
        last = total if self._replay is None else min(total, self._replay.stop_after)
        with proto.watching(self._signals):
            for step in range(self.start + 1, last + 1):
                self._step = step
                self._draws.before()
                with self.recorder.step(step):
                    self._open_implicit()
                    try:
                        yield step
                    finally:
                        self._close_implicit()
                self._step = None
                self._draws.after(step)
                if step == self.start + 1:  # once: the names of the loop's frame (this generator's caller)
                    warn_loose_loaders(self.data_cursor, sys._getframe(1))
                if proto.receipts is not None:  # the metrics' bits read only for a receipt (a device sync)
                    proto.receipt(step, *(float(self._metrics.get(k, float("nan"))) for k in ("loss", "grad_norm")))
                loss = self._metrics.get("loss", float("nan"))
                self._metrics.clear()
                if self._replay is not None:  # its receipts are all a replay keeps
                    continue
                stop = proto.agreed_stop(any_rank)  # so every rank reaches the checkpoint's barriers
                if stop is not None or step == total or step % self.checkpoint_every == 0:
                    proto.save(
                        lambda: save_checkpoint(
                            self.checkpoints,
                            step,
                            model=self.model,
                            optimizer=self.optimizer,
                            scheduler=self.scheduler,
                            data_cursor=self.data_cursor,
                            keep=self.keep,
                            sharded=self.sharded,
                            generators=self._generators,
                        )
                    )
                if stop is not None:
                    self.stopped = stop
                    return
                if step == total:
                    self._write_final(step, float(loss))
        if self._replay is not None:  # the replay ends here: the program's code after its loop is the run's
            self._loop = None
            self.close()
            raise SystemExit(0)

    def microbatch(self, index: int) -> contextlib.AbstractContextManager[None]:
        """Everything inside belongs to global microbatch ``index`` (the same index whatever the number of
        processes): module and op records are named by it. At op level, a step's ops before the loop names a
        microbatch (all of them, in a loop that names none) are microbatch 0's, up to the update."""
        self._close_implicit()
        return self.recorder.microbatch(index)

    def _open_implicit(self) -> None:
        """At op level, opens microbatch 0 for the step's ops until the loop names a microbatch or updates: a
        loop that never calls ``microbatch()`` would otherwise record no op, and bisect could name none."""
        if self._op_level:
            stack = contextlib.ExitStack()
            stack.enter_context(self.recorder.microbatch(0))
            self._implicit = stack

    def _close_implicit(self) -> None:
        stack, self._implicit = self._implicit, None
        if stack is not None:
            stack.close()

    def metric(self, name: str, value: float | torch.Tensor) -> None:
        """A scalar of the step (a loss, a gradient norm), recorded as its exact bits."""
        self.recorder.metric(name, value)
        if name in ("loss", "grad_norm"):
            self._metrics[name] = value.detach() if isinstance(value, torch.Tensor) else value

    def _write_final(self, step: int, loss: float) -> None:
        write_whole_final(
            self.run_dir,
            step,
            loss,
            self.model,
            self.optimizer,
            self.scheduler,
            self.data_cursor,
            self._proto.receipts,
            self.sharded,
        )

    def _state_tree(self, step: int) -> dict[str, Any]:
        """The state after ``step`` as a receipt digests it: every part a checkpoint of it holds."""
        return state_tree(
            step,
            self.model,
            self.optimizer,
            buffers=self._buffers,
            scheduler=self.scheduler,
            data_cursor=self.data_cursor,
        )

    def close(self) -> None:
        """Closes the trace, removes the hooks, and turns deterministic mode off if this run turned it on."""
        if self._loop is not None:  # a step left unfinished (its body raised) closes as failed
            self._loop.close()
            self._loop = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._stale is not None:
            self._stale.remove()
        self._proto.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        """Closes the run (the receipts' close checks the last step a resume computed again: a ``ResumeDiverged``).
        A refusal (``exit_codes.Refusal``: a ``LoopError``, a mistake in the loop, docs/api.md; a resume that lost
        state; Run's own checks before the loop) left uncaught ends the program with its one line and exit code.
        A loop left inside a step without an error (a ``break``) is said on stderr: what was not saved, and where
        a resume goes on from."""
        left = self._step if self._loop is not None and error is None else None  # a break or return inside a step
        try:
            self.close()
        finally:
            if left is not None and rank_and_world()[0] == 0:
                newest = max((step for step, _ in committed_steps(self.checkpoints)), default=0)
                print(left_inside_a_step(left, self._total, newest), file=sys.stderr)

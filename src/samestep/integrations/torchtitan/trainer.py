"""torchtitan's trainer on samestep's numerical path: ``SamestepTrainer``, a ``torchtitan.trainer.Trainer``
whose ``Config`` builds it, as torchtitan builds a trainer of an extension module.

What it changes of torchtitan's step, on one process or FSDP2 over every process (torchtitan's
``data_parallel_shard_degree``):

- deterministic mode (``samestep.enable``) from before torchtitan makes its process group;
- the gradients of a step's microbatches summed along the canonical tree across the data ranks
  (``CanonicalGradients`` on one process, ``FsdpGradients`` in place of FSDP2's reduce-scatter), and the loss
  with them, so one process and any number of data ranks give the same bits (docs/layouts.md);
- the gradient norm and its clipping by ``samestep.distributed.clip_grad_norm_``;
- a trace of every step into the run directory (``samestep.level``) and a receipt of every step (rank 0's of
  the whole state, or every rank's of its own shards), continued on a resume through torchtitan's checkpoint,
  which is refused where the restored state is not the receipt of its step;
- every rank's RNG states in torchtitan's checkpoint (the trainer's ``train_state``), as tensors;
- the program in run.json (``samestep.replay.program``), so ``samestep verify`` and ``bisect`` run the job again: under
  their replay request (``samestep.replay.request``) the job's dump folder is the request's scratch directory,
  holding the copy of torchtitan's checkpoint the replay starts from (``resume_points``), it traces as asked,
  and it ends after the request's last step.

Tensor parallelism (``parallelism.tensor_parallel_degree``, FSDP2 over it included) runs through torchtitan's
own parallelize function with samestep's canonical styles in place of its tensor-parallel step
(``tensor_parallel``), given ``samestep.tp_chunks`` on every layout; pipeline parallelism (a 1F1B or GPipe
schedule, stages alone) through its pipelining function, each stage's microbatch gradients on the canonical
tree (``pipeline``); other parallelisms (context, expert, replicated data, stages beside data or tensor ranks)
are refused by name before the model is built. Run it as torchtitan runs an extension
module::

    torchrun --nproc_per_node 2 -m torchtitan.train --module samestep.integrations.torchtitan \\
        --config llama3_debugmodel --training.global_batch_size 16
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils
from torchtitan.trainer import Trainer

from samestep.determinism.rng import capture_rng, restore_rng
from samestep.distributed.agree import any_rank
from samestep.integrations.steps import HookedSteps
from samestep.integrations.torchtitan.data import CorpusLoader
from samestep.integrations.torchtitan.pipeline import SCHEDULES, Pipelined
from samestep.integrations.torchtitan.tensor_parallel import with_canonical_tp
from samestep.loop.protocol import RunProtocol
from samestep.records.receipts import ReceiptError
from samestep.replay import program
from samestep.replay.request import ReplayRequest
from samestep.replay.resume_points import TORCHTITAN, resumes

__all__ = ["Samestep", "SamestepTrainer"]

_RNG_BYTES = 16384  # the JSON of a process's RNG metadata, padded: DCP loads into tensors of the saved shapes


@dataclass(kw_only=True, slots=True)
class Samestep:
    """samestep's options (``--samestep.level op`` on torchtitan's command line)."""

    run_dir: str = ""
    """Where the trace, the receipts and run.json go (default: the job's ``dump_folder``)."""
    level: str = "step"
    """The trace level: ``step``, ``module``, ``op`` or ``off``."""
    steps: str = ""
    """The 1-based steps to trace (``1-5``; empty: all)."""
    threads: int = 1
    """The intra-op thread count that deterministic mode pins (the bits depend on it)."""
    kernels: bool = False
    """Route racy ops through samestep's deterministic kernels."""
    receipts: bool = True
    """A receipt of every step; a resume whose restored state is not its step's receipt is refused."""
    canonical: bool = True
    """False: torchtitan's own accumulation, reduction, norm and tensor parallelism (the other half of an A/B),
    traced alike."""
    tp_chunks: int = 0
    """The canonical tensor-parallel layers' fixed chunk count (a power of two that every degree used divides),
    the same on every layout, one process included; 0: plain layers, tensor parallelism refused."""


class SamestepTrainer(Trainer):
    """torchtitan's ``Trainer`` with samestep's deterministic mode, canonical reduction and norm, trace,
    receipts and RNG in the checkpoint (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        samestep: Samestep = field(default_factory=Samestep)

    def __init__(self, config: Config) -> None:
        opts = config.samestep
        self.rank = int(os.environ.get("RANK", "0"))
        # the checkpoints' folder, as the run wrote it (a replay's is its scratch directory's)
        self._checkpoints = Path(config.dump_folder) / config.checkpoint.folder
        self._replay = ReplayRequest.for_run(opts.run_dir or config.dump_folder, "SamestepTrainer")
        if self._replay is not None:  # the scratch directory, traced as asked, receipted; see replay_request
            config.dump_folder = opts.run_dir = self._replay.into
            opts.level, opts.steps, opts.receipts = self._replay.level, self._replay.trace_steps or "", True
        self._proto = RunProtocol(Path(opts.run_dir or config.dump_folder), hold_dir=self.rank == 0)
        self._hooked: HookedSteps | None = None
        self._rng: dict[str, torch.Tensor] | None = None  # the checkpoint's, until the first step restores it
        try:
            # before torchtitan's process group and model exist
            if config.debug.seed is None:
                raise ValueError(
                    "SamestepTrainer: debug.seed is unset, so torchtitan draws the initial weights from a "
                    "seed of its own choosing each run; fix: --debug.seed 0"
                )
            _refuse_layout(config)
            if opts.canonical and opts.tp_chunks:
                config.model_spec = with_canonical_tp(config.model_spec, opts.tp_chunks)
            self._proto.enable(threads=opts.threads, kernels=opts.kernels, who="SamestepTrainer")
            if isinstance(config.dataloader, CorpusLoader.Config) and not config.dataloader.global_batch_size:
                config.dataloader.global_batch_size = config.training.global_batch_size
            super().__init__(config)
            if len(self.model_parts) != 1:
                raise ValueError(f"SamestepTrainer: {len(self.model_parts)} model parts; it trains one")
            dims = self.parallel_dims
            # each rank keeps receipts of its own part where the state is split (FSDP2, tensor ranks, stages)
            self.sharded = dims.fsdp_enabled or dims.tp_enabled or dims.pp_enabled
            self._pipe = (
                Pipelined(self, canonical=opts.canonical, scope=self._microbatch_scope) if dims.pp_enabled else None
            )
            self._grads = None if self._pipe is not None else self._gradients(opts.canonical)
        except BaseException:
            self._proto.close()
            raise

    def _gradients(self, canonical: bool) -> Any:
        """The rank's gradient accumulation and combine: samestep's canonical tree, or torchtitan's own order."""
        from samestep.distributed import CanonicalGradients, FsdpGradients
        from samestep.distributed.fsdp import FsdpDefaultGradients
        from samestep.distributed.reduce import AllReduceGradients

        model, k = self.model_parts[0], self.gradient_accumulation_steps
        if self.parallel_dims.fsdp_enabled:
            mesh = self.parallel_dims.get_mesh("batch")
            kind = FsdpGradients if canonical else FsdpDefaultGradients
            return kind(
                model,
                microbatches_per_process=k,
                world_size=mesh.size(),
                rank=mesh.get_local_rank(),
                group=mesh.get_group(),
            )
        kind = CanonicalGradients if canonical else AllReduceGradients
        return kind(model.parameters(), microbatches_per_process=k)

    @contextlib.contextmanager
    def _microbatch_scope(self, index: int) -> Any:
        """Microbatch ``index`` in the trace: a step's forward and backward of it, or a pipeline stage's forward or
        backward of it."""
        hooked = self._hooked
        if hooked is not None:
            hooked.begin_microbatch(index)
        try:
            yield
        finally:
            if hooked is not None:
                hooked.end_microbatch()

    # -- the protocol, from the first step (torchtitan has restored its checkpoint by then) ----------------
    def _begin(self) -> HookedSteps:
        opts, start = self.config.samestep, self.step - 1
        if self._rng is not None:  # the RNG states as the checkpoint holds them, before anything draws
            _restore_rng(self._rng)
            self._rng = None
        model = self.model_parts[0]
        if opts.receipts and start:
            self._refuse_another_layout(start)
        records = self._replay is None and self.rank == 0  # what samestep verify and bisect run again
        refusing = self._replay.refusing(ReceiptError) if self._replay else contextlib.nullcontext()
        with refusing:  # a replay's resume refused: its checkpoint is not the run's (the verdict says so)
            self._hooked = HookedSteps.start(
                self._proto,
                self._proto.run_dir,
                level=opts.level,
                steps=opts.steps or None,
                resume=start > 0,
                model=model,
                how_to_resume="torchtitan's checkpoint (checkpoint.enable, the same dump_folder)",
                receipts=opts.receipts and RunProtocol.keeps_receipts(self.rank, self.sharded),
                start=start,
                optimizer=self.optimizers,
                scheduler=self.lr_schedulers,
                source="torchtitan",
                rank=self.rank,
                sharded=self.sharded,
                agree=any_rank if opts.receipts else None,
                program=program.describe(
                    self._proto.run_dir, resumes(TORCHTITAN, self._proto.run_dir, self._checkpoints)
                )
                if records
                else None,
            )
        self._params = list(model.named_parameters())
        return self._hooked

    def _refuse_another_layout(self, start: int) -> None:
        """A resume's receipts check compares each rank's restored state with its own receipt of ``start``; on
        another layout than the one that wrote the checkpoint they are of other shards, and torchtitan's checkpoint
        holds nothing samestep could check against them: refused, naming both layouts."""
        from samestep.records.receipts import read_run_receipts

        def layout(ranks: list[int], sharded: bool) -> str:
            return f"{len(ranks)} process(es) keeping receipts of {'their shards' if sharded else 'the whole state'}"

        chains = read_run_receipts(self._proto.run_dir)
        wrote = {
            rank: r.get("state_of") == "rank"
            for rank, (_, receipts) in chains.items()
            for r in receipts
            if r["step"] == start
        }
        if not wrote:
            return  # nothing to compare (HookedSteps refuses receipts that lack the step)
        keeping = list(range(torch.distributed.get_world_size())) if self.sharded else [0]
        if sorted(wrote) != keeping or any(sharded != self.sharded for sharded in wrote.values()):
            writer = layout(sorted(wrote), any(wrote.values()))
            raise ValueError(
                f"SamestepTrainer: the checkpoint of step {start} was written by {writer}, and this "
                f"job has {layout(keeping, self.sharded)}: "
                "the receipts of that step cannot check the state torchtitan restored. Resume on the "
                "layout that wrote it, or without receipts (--samestep.no-receipts)"
            )

    def train_step(self, data_iterator: Any) -> None:
        """torchtitan's step (its data, forward, loss and backward, optimizer, scheduler and metrics) with the
        microbatches summed by ``self._grads`` and the norm clipped by samestep's."""
        hooked = self._hooked or self._begin()
        step, grads = self.step, self._grads
        hooked.begin_step(step)
        rec = hooked.rec
        self.optimizers.zero_grad(set_to_none=True)
        lr_metrics = self.lr_schedulers.get_metrics()
        pipe = self._pipe
        batches = [next(data_iterator) for _ in range(pipe.microbatches if pipe else self.gradient_accumulation_steps)]
        local_tokens = sum(((labels != IGNORE_INDEX).sum() for _, labels in batches), torch.tensor(0))
        # an integer sum across ranks: exact in any order
        tokens = (
            dist_utils.dist_sum_tensor(local_tokens.to(self.device), self.parallel_dims.get_mesh("batch"))
            if self.parallel_dims.dp_enabled
            else local_tokens.to(self.device)
        )
        if pipe is not None:
            loss = pipe.step(self, batches, tokens)
        else:
            for i, (input_dict, labels) in zip(grads.microbatches, batches):
                inputs = {key: v.to(self.device) if isinstance(v, torch.Tensor) else v for key, v in input_dict.items()}
                with self._microbatch_scope(i):
                    loss = self.forward_backward_step(
                        input_dict=inputs, labels=labels.to(self.device), global_valid_tokens=tokens
                    )
                grads.accumulate(i, extra=loss.detach())
            loss = grads.reduce().reshape(())
        params = [p for _, p in self._params]
        if pipe is not None:
            grad_norm = pipe.clip(self, params, self.config.training.max_norm)
        elif self.config.samestep.canonical:
            from samestep.distributed import clip_grad_norm_

            grad_norm = clip_grad_norm_(params, self.config.training.max_norm)
        else:
            grad_norm = dist_utils.clip_grad_norm_(params, self.config.training.max_norm, foreach=True)
        rec.metric("loss", loss)
        rec.metric("grad_norm", grad_norm)
        rec.grads(self._params)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        rec.state(self.model_parts[0], self.optimizers, named_params=self._params)
        loss_value, norm_value = float(loss), float(grad_norm)  # one device sync each
        hooked.end_step(loss_value, norm_value)
        if self._saves(step):
            hooked.sync()  # the steps the checkpoint holds are durable first
        if self.metrics_processor.should_log(step):
            self.metrics_processor.log(
                step,
                loss_value,
                loss_value,
                norm_value,
                extra_metrics={"n_tokens_seen": self.ntokens_seen, **lr_metrics},
            )

    def should_continue_training(self) -> bool:
        """torchtitan's rule; a replay also ends after the request's last step (the schedule stays the run's)."""
        return super().should_continue_training() and (self._replay is None or self.step < self._replay.stop_after)

    def _saves(self, step: int) -> bool:
        ck = self.config.checkpoint
        return bool(ck.enable) and (step % ck.interval == 0 or step == self.config.training.steps)

    # -- torchtitan's checkpoint: the trainer's train_state --------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torchtitan's ``step`` and ``ntokens_seen``, and this rank's RNG states (``samestep.rng_rank_R``)."""
        return {**super().state_dict(), f"samestep.rng_rank_{self.rank}": _rng_tensors()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._rng = state_dict.get(f"samestep.rng_rank_{self.rank}")

    def close(self) -> None:
        try:
            super().close()
        finally:
            hooked, self._hooked = self._hooked, None
            try:
                if hooked is not None:
                    hooked.close()
            finally:
                self._proto.close()


def _refuse_layout(config: Any) -> None:
    """The layouts it cannot keep on samestep's path, refused from the config, before anything is built."""
    par, opts = config.parallelism, config.samestep
    other = {
        "context_parallel_degree": "context",
        "expert_parallel_degree": "expert",
        "data_parallel_replicate_degree": "replicated data",
    }
    used = [
        f"parallelism.{field} = {getattr(par, field)} ({kind} parallelism)"
        for field, kind in other.items()
        if getattr(par, field) > 1
    ]
    if used:
        raise ValueError(
            f"SamestepTrainer: {', '.join(used)} is not supported yet; it runs on one process, FSDP2 "
            "over the data ranks (parallelism.data_parallel_shard_degree), tensor parallelism and "
            "pipeline parallelism. Fix: set it to 1"
        )
    _refuse_pipeline(par)
    if opts.tp_chunks and (opts.tp_chunks & (opts.tp_chunks - 1) or opts.tp_chunks < 0):
        raise ValueError(
            f"SamestepTrainer: samestep.tp_chunks = {opts.tp_chunks} is not a power of two. Fix: "
            "--samestep.tp_chunks 8 (any power of two that every tensor-parallel degree used divides)"
        )
    tp = par.tensor_parallel_degree
    if not opts.canonical or (tp <= 1 and not opts.tp_chunks):
        return
    if not opts.tp_chunks:
        raise ValueError(
            f"SamestepTrainer: parallelism.tensor_parallel_degree = {tp} needs samestep's canonical "
            "tensor-parallel layers, cut alike on every layout. Fix: --samestep.tp_chunks 8 on every "
            "layout (one process included), or --samestep.no-canonical for torchtitan's own"
        )
    if par.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"SamestepTrainer: samestep.tp_chunks takes parallelism.spmd_backend = partial_dtensor "
            f"(DTensor over the tensor ranks, as PyTorch's parallel styles place it), not "
            f"{par.spmd_backend}. Fix: --parallelism.spmd_backend partial_dtensor"
        )


def _refuse_pipeline(par: Any) -> None:
    """Pipeline stages it can keep: a schedule of one full backward per microbatch, in order, with no other
    parallelism beside it (the stages' data ranks and tensor ranks are not supported yet)."""
    pp = par.pipeline_parallel_degree
    if pp <= 1:
        return
    if par.pipeline_parallel_schedule not in SCHEDULES or par.pipeline_parallel_schedule_csv:
        schedule = par.pipeline_parallel_schedule_csv or par.pipeline_parallel_schedule
        raise ValueError(
            f"SamestepTrainer: parallelism.pipeline_parallel_schedule = {schedule} is not supported: "
            "its microbatch gradients are not one full backward each, in order. Fix: "
            "--parallelism.pipeline_parallel_schedule 1F1B (or GPipe)"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    others = pp * par.tensor_parallel_degree * par.context_parallel_degree * par.data_parallel_replicate_degree
    shard = par.data_parallel_shard_degree if par.data_parallel_shard_degree > 0 else max(world // others, 1)
    beside = [
        f"parallelism.{name} = {value}"
        for name, value in (
            ("data_parallel_shard_degree", shard),
            ("tensor_parallel_degree", par.tensor_parallel_degree),
        )
        if value > 1
    ]
    if beside:
        raise ValueError(
            f"SamestepTrainer: parallelism.pipeline_parallel_degree = {pp} with {', '.join(beside)} "
            "is not supported yet (pipeline stages run alone). Fix: as many processes as stages "
            f"(torchrun --nproc_per_node {pp}), or pipeline_parallel_degree 1"
        )


def _rng_tensors() -> dict[str, torch.Tensor]:
    """This process's RNG states as tensors of fixed shapes (their metadata as padded JSON bytes)."""
    meta, tensors = capture_rng()
    text = json.dumps(meta, sort_keys=True).encode()
    if len(text) > _RNG_BYTES:
        raise ValueError(f"the RNG metadata takes {len(text)} bytes, more than the {_RNG_BYTES} kept for it")
    padded = torch.full((_RNG_BYTES,), ord(" "), dtype=torch.uint8)
    padded[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return {"meta": padded, **{name: t.clone() for name, t in tensors.items()}}


def _restore_rng(saved: dict[str, torch.Tensor]) -> None:
    meta = json.loads(bytes(saved["meta"].tolist()).decode())
    restore_rng(meta, {name: t for name, t in saved.items() if name != "meta"})

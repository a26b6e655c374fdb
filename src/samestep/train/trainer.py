"""One process of the reference run: its parts (data cursor, model, optimizer, schedule, gradient reduction,
trace recorder; a pipeline stage's) built from the config, and one optimizer step over them (``Trainer.step``).
``train/loop.py`` runs the steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from samestep.determinism import rng
from samestep.distributed import CanonicalGradients, any_rank
from samestep.distributed.fsdp import (
    FsdpDefaultGradients,
    FsdpGradients,
    Held,
    ShardedModel,
    ShardedOptimizer,
    full_state,
    shard_model,
)
from samestep.distributed.norm import clip_grad_norm_
from samestep.distributed.reduce import AllReduceGradients
from samestep.distributed.shard_adamw import ShardAdamW
from samestep.loop.data import DataCursor, load_corpus
from samestep.records.receipt_state import buffers_now, model_state
from samestep.tracing import Perturb, Recorder, parse_selection
from samestep.train.capacity import check_capacity
from samestep.train.checks import RecomputeCheck, check_finite
from samestep.train.config import Config
from samestep.train.config_values import not_with
from samestep.train.expert_parallel import ExpertLayout, check_ep
from samestep.train.faults import Fault
from samestep.train.llama import Llama
from samestep.train.model import GPT
from samestep.train.pipeline import Pipeline, check_pp
from samestep.train.schedule import WarmupCosine
from samestep.train.tensor_parallel import apply_tp, check_tp, data_ranks

__all__ = ["Trainer", "build"]


def _make_optimizer(
    model: torch.nn.Module, cfg: Config, params: list[torch.nn.Parameter] | None = None
) -> torch.optim.AdamW:
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    t = cfg.train
    # AdamW's single-tensor update, on a DTensor parameter's shard (distributed/shard_adamw.py): AdamW's bits
    return ShardAdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
    )


@dataclass(slots=True)
class Trainer:
    """Everything one process of the run holds, and one optimizer step over it."""

    cfg: Config
    corpus: Any
    model: GPT | Llama
    optimizer: torch.optim.AdamW
    schedule: WarmupCosine
    cursor: DataCursor
    grads: CanonicalGradients | AllReduceGradients | FsdpGradients
    device: torch.device
    recorder: Recorder
    named_params: list[tuple[str, torch.nn.Parameter]]  # the model's, once: it gains or loses none
    named_buffers: list[tuple[str, torch.Tensor]]  # its persistent buffers, likewise (none: its masks are not)
    fault: Fault | None = None  # train.fault: a bit flip planted to test the checks
    recompute: RecomputeCheck | None = None  # train.sdc_check_every
    reduced: list[tuple[str, torch.Tensor]] | None = None  # the last reduced gradients, if kept (cross-rank check)
    # the sets of ranks that hold the same tensors (unsharded: all of them; under tensor parallelism: each tensor
    # rank's data ranks; under FSDP2: none), which the cross-rank check compares
    peers: list[list[int]] = field(default_factory=list)
    rank: int = 0  # this process's rank (the gradients' is its data rank's)
    pipeline: Pipeline | None = None  # parallel.pp > 1: this rank's stage and what joins it to the others
    experts: ExpertLayout | None = None  # parallel.ep > 1: this rank's experts and what joins them to the others

    @property
    def whole(self) -> Pipeline | ExpertLayout | None:
        """What gathers the whole state from the ranks that hold parts of the model (pipeline stages, experts),
        and loads it back into each part; None where every rank holds all of it (or its shards)."""
        return self.pipeline if self.pipeline is not None else self.experts

    @property
    def sharded(self) -> bool:
        """Whether checkpoints and receipts hold each rank's shards of DTensor parameters: FSDP2 (parallel.fsdp on
        more than one process) or tensor parallelism (parallel.tp_chunks, a mesh of one included); a pipeline's
        hold the whole state, gathered from its stages (and their tensor ranks)."""
        if self.whole is not None:  # its checkpoints and receipts hold the whole state, gathered
            return False
        return isinstance(self.grads, FsdpGradients) or self.cfg.parallel.tp_chunks > 0

    def savable(self) -> tuple[Any, Any]:
        """What the final digest reads ``state_dict()`` from: the model and optimizer, or of a sharded run
        their unsharded state, gathered now (a collective: every rank calls it)."""
        if self.whole is not None:
            model_sd, optim_sd = self.whole.whole_state(self.model, self.optimizer, self.device)
            return Held(model_sd), Held(optim_sd)
        if not self.sharded:
            return self.model, self.optimizer
        model_sd, optim_sd = full_state(self.model, self.optimizer)
        return Held(model_sd), Held(optim_sd)

    def loadable(self) -> tuple[Any, Any]:
        """What a checkpoint (loaded as whole tensors, whoever wrote it) is loaded into: of a sharded run,
        each rank's shards of them; of a pipeline stage or a rank's experts, its part of them."""
        if self.whole is not None:
            return self.whole.loaders(self.model, self.optimizer)
        if not self.sharded:
            return self.model, self.optimizer
        return ShardedModel(self.model), ShardedOptimizer(self.optimizer)

    def receipt_state(self, step: int) -> Callable[[], dict[str, Any]]:
        """The state tree after ``step`` as ``run_state`` makes it, made on the receipt thread. The
        optimizer's is taken here (the next step sets its groups' lr before its update); the model's there,
        but for a sharded run: FSDP2's ``state_dict`` swaps the module's parameters, which the next forward
        must not see. Of a model in parts (``whole``), the whole state, gathered now from the parts (a collective:
        every rank of them calls it, at the same steps). The model's buffers are copied here (``buffers_now``):
        the next forward may change them."""
        if self.whole is not None:
            model_sd, optim_sd = self.whole.whole_state(self.model, self.optimizer, self.device)
            tree = {"model": model_sd, "optimizer": optim_sd, "data_cursor": self.cursor.state_dict(), "step": step}
            return lambda: tree
        cursor, model, optim = self.cursor.state_dict(), self.model, self.optimizer.state_dict()
        buffers = buffers_now(self.named_buffers)
        if self.sharded:
            tree = {"model": model_state(model, buffers), "optimizer": optim, "data_cursor": cursor, "step": step}
            return lambda: tree
        return lambda: {"model": model_state(model, buffers), "optimizer": optim, "data_cursor": cursor, "step": step}

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch * self.cfg.model.block_size

    def forward(self, step: int, i: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Microbatch ``i``'s loss at step ``step`` (0-based), normalised by the global token count."""
        t = self.cfg.train
        gen = rng.generator(t.seed, step, i, "dropout", self.device)
        # bf16: autocast's casts inside the forward; weights, gradients and the loss stay fp32
        with torch.autocast(self.device.type, torch.bfloat16, enabled=t.precision == "bf16"):
            _, loss = self.model(x.to(self.device), y.to(self.device), gen)
        return loss / self.tokens_per_step  # layout-free

    def step(self, step: int) -> tuple[float, float, float]:
        """Runs optimizer step ``step`` (0-based); returns (loss, grad norm before clipping, lr)."""
        t, rec = self.cfg.train, self.recorder
        lr = self.schedule(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with rec.step(step + 1):  # traces and metrics number steps from 1
            picked = self.recompute.pick(step) if self.recompute is not None else None
            pipe = self.pipeline
            for i in self.grads.microbatches if pipe is None else ():
                x, y = self.cursor.samples(self.cursor.position + i * t.micro_batch, t.micro_batch)
                if self.fault is not None:
                    self.fault.at(step, i)
                with rec.microbatch(i):
                    loss = self.forward(step, i, x, y)
                    loss.backward()
                if i == picked:  # before the tree takes p.grad: it holds this microbatch's gradient alone
                    with rec.paused():
                        self.recompute.compare(step, i, x, y, loss)
                self.grads.accumulate(i, extra=loss.detach())
                if self.experts is not None:
                    self.experts.after_microbatch()
            if self.recompute is not None:
                self.recompute.settle(step, picked)
            if pipe is None:
                loss_sum = self.grads.reduce()[0]
                if self.experts is not None:
                    self.experts.reduce()
            else:  # the stages' forwards and backwards, by the schedule
                loss_sum = pipe.run(
                    step,
                    t.seed,
                    lambda i: self.cursor.samples(self.cursor.position + i * t.micro_batch, t.micro_batch),
                    self.device,
                )[0]
            # The reduced gradients, recorded before clipping (out of place, which leaves them as they are): at
            # step level digested where they lie, which spares copying them; at module level copied, which
            # measures faster there (bench_trace.py --levels module, with and without trace.copy).
            rec.grads(self.named_params, copy="checked" if rec.level == "step" and not self.cfg.trace.copy else True)
            if self.fault is not None:
                self.fault.after("reduce", step, self.named_params, self.rank)
            if self.reduced is not None:  # clipping out of place leaves these tensors as they are
                self.reduced = [(n, p.grad) for n, p in self.named_params if p.grad is not None]
            max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
            grad_norm = clip_grad_norm_(
                self.grads.params if self.experts is None else self.experts.params,
                max_norm,
                out_of_place=True,
                over=None if pipe is None else pipe.pipe_group,
                lead=() if pipe is None else pipe.lead,
                norm=None if self.experts is None else self.experts.grad_norm(self.model),
            )
            rec.metric("loss", loss_sum)
            rec.metric("grad_norm", grad_norm)
            check_finite(step + 1, float(loss_sum), float(grad_norm), t.nonfinite)  # before the update
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if pipe is not None:
                pipe.after_update()
            if self.fault is not None:
                self.fault.after("update", step, self.named_params, self.rank)
            rec.state(self.model, self.optimizer, named_params=self.named_params, named_buffers=self.named_buffers)
        self.cursor.advance(t.global_batch)
        return float(loss_sum), float(grad_norm), lr


def build(
    cfg: Config,
    *,
    world: int = 1,
    rank: int = 0,
    device: torch.device | str = "cpu",
    corpus: Any = None,
    run_dir: Path | None = None,
) -> Trainer:
    """Builds the data cursor, model, optimizer, schedule, gradient reduction and trace recorder of one process.

    Without ``run_dir`` nothing is traced (there is nowhere to write).
    """
    t = cfg.train
    corpus = corpus if corpus is not None else load_corpus(cfg.data.source, cfg.data.path or None)
    vocab = cfg.model.vocab_size or corpus.vocab_size
    if vocab < corpus.vocab_size:
        raise ValueError(
            f"model.vocab_size={vocab} is smaller than the data's largest token + 1 = "
            f"{corpus.vocab_size}; raise it or set 0"
        )
    device = torch.device(device)
    check_capacity(cfg, vocab, int(corpus.tokens.size), device, world)
    arch = Llama if cfg.model.arch == "llama" else GPT
    model = arch(cfg.model, vocab, t.seed, deterministic=cfg.determinism.enabled).to(device)
    check_tp(cfg, world, vocab)
    check_pp(cfg, world)
    check_ep(cfg, world)
    pipeline = Pipeline.build(model, cfg, world, rank, device) if cfg.parallel.pp > 1 else None
    experts = ExpertLayout.build(model, cfg, world, rank, device) if cfg.parallel.ep > 1 else None
    data_mesh = (
        apply_tp(model, cfg, world, rank, device.type, None if pipeline is None else pipeline.tensor_meshes)
        if cfg.parallel.tp_chunks
        else None
    )
    data_group = data_mesh.get_group() if data_mesh is not None else None
    sharded = cfg.parallel.fsdp and world > 1
    if sharded:
        not_with("parallel.fsdp=true", {"train.compile=true": t.compile})
    fault = Fault.parse(t.fault) if t.fault else None
    if fault is not None:
        fault.install(model, rank)
    if t.sdc_check_every:
        not_with("train.sdc_check_every", {"parallel.fsdp=true": sharded})
    if t.compile:
        model.compile()  # in place: the state_dict keys stay the model's own
    data_world = data_ranks(cfg, world)
    data_rank = rank // (world // data_world)  # a data rank's tensor ranks are consecutive
    k = t.microbatches // data_world
    sharded = sharded and data_world > 1  # FSDP2 shards over the data ranks
    if pipeline is not None:  # each stage's data ranks reduce (and shard) it
        data_group = pipeline.data_group
    if sharded:
        shard_model(model, data_world, data_mesh if pipeline is None else pipeline.data_mesh)
    if pipeline is not None:  # over the stage as tensor parallelism and FSDP2 left it
        pipeline.join(model, cfg, device, t.global_batch * cfg.model.block_size)
    if sharded:
        kind = FsdpGradients if cfg.determinism.enabled else FsdpDefaultGradients
        grads: Any = kind(model, microbatches_per_process=k, world_size=data_world, rank=data_rank, group=data_group)
    else:
        params = (
            pipeline.reduced if pipeline is not None else experts.shared if experts is not None else model.parameters()
        )
        grads = (
            CanonicalGradients(
                params,
                microbatches_per_process=k,
                world_size=data_world,
                rank=data_rank,
                group=data_group,
                overlap=cfg.parallel.overlap,
            )
            if cfg.determinism.enabled
            else AllReduceGradients(
                params, microbatches_per_process=k, world_size=data_world, rank=data_rank, group=data_group
            )
        )
    if pipeline is not None:
        pipeline.grads = grads
    tc = cfg.trace
    recorder = Recorder(
        run_dir if run_dir is not None else ".",
        level=tc.level if run_dir is not None else "off",
        steps=parse_selection(tc.steps, "trace.steps"),
        ranks=parse_selection(tc.ranks, "trace.ranks"),
        rank=rank,
        perturb=Perturb.parse(tc.perturb) if tc.perturb else None,
        copy=tc.copy,
        worker=tc.worker,
    )
    recorder.attach(model)
    if pipeline is not None and recorder.enabled:
        pipeline.recorder = recorder
    if recorder.enabled:
        grads.observer = recorder.collective
    trainer = Trainer(
        cfg=cfg,
        corpus=corpus,
        model=model,
        optimizer=_make_optimizer(
            model, cfg, pipeline.params if pipeline is not None else experts.params if experts is not None else None
        ),
        schedule=WarmupCosine(t.lr, t.min_lr, t.warmup_steps, t.steps),
        cursor=DataCursor(corpus, cfg.model.block_size, t.seed),
        grads=grads,
        device=device,
        recorder=recorder,
        named_params=list(model.named_parameters()),
        named_buffers=Recorder.persistent_buffers(model),
        fault=fault,
        rank=rank,
        pipeline=pipeline,
        experts=experts,
    )
    if pipeline is not None and not sharded:  # each stage's (and tensor rank's) data ranks hold the same tensors
        pp, tp = cfg.parallel.pp, world // data_world // cfg.parallel.pp
        trainer.peers = [[(d * pp + s) * tp + r for d in range(data_world)] for s in range(pp) for r in range(tp)]
    elif experts is not None:  # the ranks at one place of their expert-parallel groups hold the same tensors
        ep = cfg.parallel.ep
        trainer.peers = [[g * ep + j for g in range(world // ep)] for j in range(ep)]
    elif cfg.parallel.tp_chunks and not sharded:
        tp = cfg.parallel.tp
        trainer.peers = [[d * tp + r for d in range(data_world)] for r in range(tp)]
    elif not sharded:
        trainer.peers = [list(range(world))]
    if t.sdc_check_every:  # the first of each pair of the canonical tree; of plain accumulation, the first
        # a data rank's microbatches: its tensor ranks recompute the same one together (their layers' collectives)
        firsts = list(range(data_rank * k, (data_rank + 1) * k, 2 if cfg.determinism.enabled else k))
        trainer.recompute = RecomputeCheck(
            t.sdc_check_every,
            trainer.forward,
            trainer.named_params,
            firsts,
            rank,
            run_dir or Path("."),
            t.sdc_action,
            lambda flag: flag if world == 1 else any_rank(flag, device),
        )
    return trainer

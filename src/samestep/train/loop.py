"""The reference pretraining loop: a user of samestep's public layers, single process or torchrun.

    samestep train --run-dir runs/a --set train.steps=100
    torchrun --standalone --nproc_per_node 2 -m samestep train --run-dir runs/b

Each step: for every global microbatch this process owns, read its samples from the data cursor,
forward with a dropout generator keyed by (seed, step, microbatch), backward, and push the gradient
into the canonical reduction; then reduce across processes, clip, and take an AdamW step (one process's
parts and its step: ``train/trainer.py``). Checkpoints hold everything a bit-exact resume needs; ``final.json``
holds the digest of the final state.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from samestep.checkpoint import save_checkpoint
from samestep.determinism.preempt import parse_signals
from samestep.distributed import validate_layout
from samestep.hashing.checksums import state_checksum, state_hash_for
from samestep.hashing.state import state_digest
from samestep.loop.data import DataCursor
from samestep.loop.protocol import RunProtocol
from samestep.records.final import final_doc, write_final
from samestep.records.metrics import logged_loss, metrics_line, truncate_metrics
from samestep.records.receipts import genesis, read_header, receipts_path, state_hash_of
from samestep.records.rundir import (
    checked_run_dir,
    checkpoints_dir,
    holds_run,
    metrics_path,
    new_run,
    record_resume,
    write_run,
)
from samestep.train.checks import CrossRankCheck, NonFinite
from samestep.train.config import Config
from samestep.train.expert_parallel import check_ep
from samestep.train.layout import job_layout, written_layout
from samestep.train.llama import Llama
from samestep.train.pipeline import check_pp
from samestep.train.processes import Processes, device_kind
from samestep.train.progress import Progress
from samestep.train.resume import check_run_files, restore_run
from samestep.train.tensor_parallel import check_tp, data_ranks
from samestep.train.trainer import Trainer, build

__all__ = ["Preempted", "Trainer", "build", "check_layout", "train"]


class Preempted(Exception):
    """The run stopped at a signal (``train.exit_signals``) after a step, with a checkpoint of that step:
    ``--resume`` continues it bit for bit."""

    def __init__(self, step: int, signal: str) -> None:
        super().__init__(f"stopped by {signal} after step {step}, with a checkpoint; continue with --resume")
        self.step, self.signal = step, signal


def train(
    cfg: Config,
    run_dir: str | os.PathLike[str],
    *,
    resume: bool = False,
    stop_after: int | None = None,
    out: Callable[[str], None] = print,
) -> dict[str, Any] | None:
    """Runs (or resumes) the reference pretraining run into ``run_dir``.

    Args:
        cfg: the run's configuration.
        run_dir: the run directory (format "samestep.run", version 1).
        resume: continue from the newest intact checkpoint in ``run_dir`` (from scratch if none).
        stop_after: leave after this many steps of this invocation, with a checkpoint, so that a
            scheduler can pre-empt the job and ``--resume`` it later (Megatron's exit interval).
        out: where human-readable lines go (rank 0 only).

    Returns:
        The contents of ``final.json``; ``None`` when ``stop_after`` ended the invocation early.

    Raises:
        ValueError: a bad config, an unsupported layout, a run directory that already holds a run
            (without ``resume``), or a resume under a config that would change the bits.
    """
    run_dir = checked_run_dir(run_dir)
    # One writer per run directory: a second trainer (a requeued job beside the live one) is refused
    # before it touches anything; rank 0 holds it for the whole job.
    proto = RunProtocol(run_dir, hold_dir=int(os.environ.get("RANK", "0")) == 0)
    try:
        if cfg.determinism.enabled:
            # Before any process group exists: NCCL reads NCCL_ALGO when its communicator starts.
            proto.enable(
                threads=cfg.determinism.threads, warn_only=cfg.determinism.warn_only, who="determinism.threads"
            )
        dist_ = Processes(device_kind(cfg), group_of_one=cfg.parallel.tp_chunks > 0)
        try:
            with proto.watching(parse_signals(cfg.train.exit_signals)):
                return _train(cfg, run_dir, resume, stop_after, out, dist_, proto)
        finally:
            dist_.close()
    finally:
        proto.close()


def check_layout(cfg: Config, world: int) -> None:
    """Refuses a process count the run's microbatches do not split over (or, in deterministic mode, one
    whose split the canonical tree does not support), naming the ones that work. The launcher asks before
    it starts any process, each process again for itself."""
    t = cfg.train
    check_tp(cfg, world)
    check_pp(cfg, world)
    check_ep(cfg, world)
    world = data_ranks(cfg, world)
    if t.microbatches % world:
        raise ValueError(
            f"train.global_batch={t.global_batch} / train.micro_batch={t.micro_batch} = "
            f"{t.microbatches} microbatches do not split over {world} processes; use a process count "
            f"that divides {t.microbatches}"
        )
    if cfg.determinism.enabled:
        validate_layout(world, t.microbatches // world)


def _train(
    cfg: Config,
    run_dir: Path,
    resume: bool,
    stop_after: int | None,
    out: Callable[[str], None],
    dist_: Processes,
    proto: RunProtocol,
) -> dict[str, Any] | None:
    t, world, rank, report = cfg.train, dist_.world, dist_.rank, proto.report
    check_layout(cfg, world)
    say = out if rank == 0 else (lambda _msg: None)
    mixed = dist_.compare_environments(cfg.determinism.env_mismatch)
    trainer = build(cfg, world=world, rank=rank, device=dist_.device, run_dir=run_dir)
    start, loaded = restore_run(trainer, run_dir, resume, world, say)
    layout = job_layout(cfg, world)
    same = loaded is None or written_layout(loaded) == layout
    # a model in parts (pipeline stages, experts): its ranks gather the state rank 0's receipts checksum together
    state = (
        trainer.receipt_state(start)
        if _writes_receipts(trainer, dist_) or (trainer.whole is not None and t.receipts)
        else None
    )
    check_run_files(
        proto, start, rank, state if _writes_receipts(trainer, dist_) else None, checkpoint=loaded, same_layout=same
    )
    dist_.barrier()  # every rank has checked the run directory before rank 0 changes it
    if rank == 0:
        truncate_metrics(run_dir, start)  # first: a damaged metrics.jsonl refuses the resume before run.json records it
        if holds_run(run_dir):
            record_resume(
                run_dir,
                {
                    "step": start,
                    **layout,
                    "checkpoint": loaded.path.name if loaded else None,
                    "skipped": [p.name for p, _ in loaded.skipped] if loaded else [],
                    "env_diff": sorted(loaded.env_diff) if loaded else [],
                    **({"rank_env_diff": mixed} if mixed else {}),
                },
            )
        else:
            corpus = trainer.corpus
            extra = (
                {"attention_backend": trainer.model.attention_backend(t.micro_batch, trainer.device, t.precision)}
                if isinstance(trainer.model, Llama)
                else {}
            )
            if mixed:
                extra["rank_env_diff"] = mixed
            write_run(
                run_dir,
                new_run(
                    cfg.to_dict(),
                    layout,
                    report.to_dict() if report is not None else None,
                    data={
                        "source": corpus.description,
                        "fingerprint": corpus.fingerprint,
                        "tokens": int(corpus.tokens.size),
                    },
                    **extra,
                ),
            )
    dist_.barrier()
    end = t.steps if stop_after is None else min(t.steps, start + stop_after)
    t0 = time.perf_counter()
    # a resume from the last step trains nothing: the last loss is the one logged for it
    loss_value, stopped = _run_steps(
        trainer,
        run_dir,
        start,
        end,
        rank == 0,
        out,
        logged_loss(run_dir, start) if start else float("nan"),
        proto,
        dist_,
    )
    if stopped is not None:
        dist_.barrier()
        raise Preempted(stopped, proto.stop.requested or "a signal to another rank")
    if end < t.steps:
        say(f"stopped after step {end} of {t.steps} (--stop-after); continue with --resume")
        return None
    tree = run_state(*trainer.savable(), trainer.cursor, t.steps)
    checksum = None
    if rank == 0 and t.receipts:  # by the hash of rank 0's receipts: receipts verify compares the two
        hash_ = _receipt_hash(trainer, run_dir)
        checksum = {hash_: state_checksum(tree, hash_)}
    final = final_doc(t.steps, state_digest(tree), loss_value, world, checksum)
    if rank == 0:
        write_final(run_dir, final)
        elapsed = time.perf_counter() - t0
        say(
            f"done: {t.steps} steps ({t.steps - start} here, {elapsed:.1f}s, "
            f"{(t.steps - start) * trainer.tokens_per_step / max(elapsed, 1e-9):,.0f} tok/s), final loss "
            f"{loss_value:.4f}, state digest {final['state_digest'][:16]}"
        )
    dist_.barrier()
    return final


def _run_steps(
    trainer: Trainer,
    run_dir: Path,
    start: int,
    end: int,
    writer: bool,
    out: Callable[[str], None],
    loss_value: float,
    proto: RunProtocol,
    dist_: Processes,
) -> tuple[float, int | None]:
    """Trains steps ``start`` to ``end`` (0-based, end excluded), logging metrics (if ``writer``) and
    saving checkpoints; returns the last step's loss (``loss_value`` if there is no step to train) and
    the step after which a stop request ended it early, with a checkpoint (None if none did). The
    protocol's recorder and receipts are closed at the end."""
    t = trainer.cfg.train
    tokens_per_step = trainer.tokens_per_step
    progress = Progress(writer, start, t.steps, t.log_every, out)
    metrics = open(metrics_path(run_dir), "a", encoding="utf-8") if writer else None
    trainer.model.train()
    t0, start_timed = time.perf_counter(), start
    proto.adopt(trainer.recorder)
    cross = _receipts(trainer, proto, start, dist_)

    # a model in parts: each rank's part of each receipt's state, which rank 0's gather collects
    gathers = trainer.whole is not None and t.receipts and not _writes_receipts(trainer, dist_)

    def save(done: int) -> None:
        # a sharded run: each rank writes its own shards, nothing gathered; a model in parts, the whole state gathered
        proto.save(
            lambda: save_checkpoint(
                checkpoints_dir(run_dir),
                done,
                **_saved_state(trainer),
                scheduler=trainer.schedule,
                data_cursor=trainer.cursor,
                config=trainer.cfg.to_dict(),
                keep=t.keep_checkpoints,
                sharded=trainer.sharded,
            ),
            metrics,
        )

    saved = start
    try:
        for step in range(start, end):
            try:
                loss_value, grad_norm, lr = trainer.step(step)
            except NonFinite:
                if step > saved:  # the update was not applied: the state is step ``step``'s, saved whole
                    save(step)
                raise
            done = step + 1
            if gathers:
                trainer.receipt_state(done)
            # the state as final.json digests it, on the receipt thread
            proto.receipt(
                done,
                loss_value,
                grad_norm,
                None if cross is None else {"grads": trainer.reduced, "params": trainer.named_params},
            )
            if metrics is not None:
                metrics.write(metrics_line(done, loss_value, grad_norm, lr, done * tokens_per_step))
                metrics.flush()
            if t.compile and step == start:  # the first step compiles: its warm-up is not the step time
                t0, start_timed = time.perf_counter(), done
            elapsed = time.perf_counter() - t0
            progress.update(done, loss_value, (done - start_timed) * tokens_per_step / max(elapsed, 1e-9))
            stopping = done < end and proto.agreed_stop(dist_.any) is not None
            if done == end or stopping or (t.checkpoint_every and done % t.checkpoint_every == 0):
                save(done)
                saved = done
            if cross is not None and (stopping or done == end):
                cross.final()
            if stopping:
                return loss_value, done
    finally:
        if cross is not None:
            cross.close()
        progress.close()
        proto.end()
        if metrics is not None:
            metrics.close()
    return loss_value, None


def _saved_state(trainer: Trainer) -> dict[str, Any]:
    """The model and optimizer a checkpoint saves: the trainer's own, or of a model in parts the whole state
    (gathered now: every rank of the parts calls it)."""
    model, optimizer = trainer.savable() if trainer.whole is not None else (trainer.model, trainer.optimizer)
    return {"model": model, "optimizer": optimizer}


def _writes_receipts(trainer: Trainer, dist_: Processes) -> bool:
    """Whether this rank keeps receipts (train.receipts): rank 0, or under sharding every rank."""
    return trainer.cfg.train.receipts and RunProtocol.keeps_receipts(dist_.rank, trainer.sharded)


def _receipts(trainer: Trainer, proto: RunProtocol, start: int, dist_: Processes) -> CrossRankCheck | None:
    """Opens this rank's receipts (train.receipts) in ``proto`` (a RunProtocol): rank 0's, of the whole state, or under
    sharding every rank's, of its shards; the receipts of steps after ``start`` (of a killed run) are dropped.
    With the cross-rank check (several ranks that hold the same tensors: ``Trainer.peers``), every rank digests
    its state and reduced gradients (a rank that keeps no receipts writes none) and the returned check compares
    them among its peers."""
    t = trainer.cfg.train
    cross = t.cross_rank_check and any(len(ranks) > 1 for ranks in trainer.peers)
    writes = _writes_receipts(trainer, dist_)
    if not (writes or cross):
        return None
    first = genesis(trainer.cfg.to_dict(), trainer.corpus.fingerprint)
    # a rank that keeps no receipts: a writer of no file, for the check's sums alone
    writer = proto.open_receipts(
        dist_.rank,
        start,
        first,
        state=trainer.receipt_state,
        optimizer=trainer.optimizer,
        sharded=trainer.sharded,
        keep_file=writes,
        hash=_configured_hash(trainer),
    )
    if not cross:
        return None
    trainer.reduced = []
    check = CrossRankCheck(writer, dist_.device, run_dir=proto.run_dir, action=t.sdc_action, peers=trainer.peers)
    check.watch(trainer.optimizer)  # after the writer's wait
    return check


def run_state(model: Any, optimizer: Any, cursor: DataCursor, step: int) -> dict[str, Any]:
    """The state that ``final.json`` digests: parameters, optimizer state, data cursor and step (of a sharded
    run: its unsharded state, ``Trainer.savable``)."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "data_cursor": cursor.state_dict(),
        "step": step,
    }


def _configured_hash(trainer: Trainer) -> str:
    """train.receipt_hash ('auto': by where the state lies): a new receipts file's, and every rank's for the
    cross-rank check."""
    chosen = trainer.cfg.train.receipt_hash
    return state_hash_for(trainer.device) if chosen == "auto" else chosen


def _receipt_hash(trainer: Trainer, run_dir: Path) -> str:
    """The state hash of rank 0's receipts: its file's (a resumed run keeps it), else the configured one."""
    path = receipts_path(run_dir, 0)
    if path.exists() and path.stat().st_size:
        return state_hash_of(read_header(path))
    return _configured_hash(trainer)

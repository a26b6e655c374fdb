"""samestep in PyTorch Lightning, as one callback.

    trainer = lightning.Trainer(callbacks=[samestep.integrations.lightning.SamestepCallback("runs/pl")], ...)
    trainer.fit(module, DataLoader(data, batch_size=8, sampler=KeyedSampler(len(data))), ckpt_path=...)

What it does:

- deterministic mode (``samestep.enable``) from ``fit`` on, recorded in run.json;
- a trace of every optimizer step (or ``steps=``) for ``samestep diff``: the batches of a gradient
  accumulation as microbatches 0, 1, ..., every gradient before the update (before clipping), the
  parameters and optimizer state after it, and the step's loss;
- a receipt of every optimizer step (``receipts/rank_00000.jsonl``, ``samestep receipts verify``): the
  checksum of the model, optimizer and scheduler state after the update and the step's loss bits,
  chained by hash;
- in each of Lightning's checkpoints (its callback state): every RNG state of the process, which
  Lightning does not save, and the digests of the model, optimizer and scheduler, with the trace and the
  receipts made durable before the checkpoint is written;
- on ``fit(..., ckpt_path=...)``: the digests compared with what Lightning restored, the RNG states
  restored before the first resumed step, and the data position: a ``KeyedSampler`` is moved to the
  first sample the checkpoint had not consumed; a mid-epoch resume with a loader that can do neither
  (Lightning would restart the epoch's data, and only warn) is refused.

run.json records the program (``samestep.replay.program``) and each checkpoint Lightning's ``ModelCheckpoint`` wrote
with its step (``resume_points.index``), so that ``samestep verify`` and ``samestep bisect`` run the program
again: under their replay request (``samestep.replay.request``) the callback traces into the request's
scratch directory, points every ``ModelCheckpoint`` there, has ``Trainer.fit`` resume from the copy of the
checkpoint in it (whatever ``ckpt_path`` the program passes), traces as asked, and ends the process (exit 0)
after the request's last step.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from samestep.determinism.rng import capture_rng, restore_rng
from samestep.distributed.agree import any_rank
from samestep.integrations.fingerprint import ResumeMismatch, check_resume, state_fingerprint
from samestep.integrations.sampler import KeyedSampler
from samestep.integrations.steps import HookedSteps, refuse_processes
from samestep.loop.protocol import RunProtocol
from samestep.records.receipts import ReceiptError
from samestep.replay import program
from samestep.replay.request import ReplayRequest
from samestep.replay.resume_points import LIGHTNING, index, resumes

__all__ = ["KeyedSampler", "ResumeMismatch", "SamestepCallback"]


class SamestepCallback(pl.Callback):
    """Deterministic mode, a trace, exact and checked resumes for ``lightning.pytorch.Trainer``.

    Args:
        run_dir: where the trace and run.json go.
        level: the trace level, ``"step"``, ``"module"``, ``"op"`` or ``"off"``.
        steps: the 1-based optimizer steps to trace (a set, or text like ``"1-5"``); ``None`` traces all.
        threads: the intra-op thread count that deterministic mode pins.
        kernels: route racy ops through samestep's deterministic kernels.
        receipts: write a receipt of every optimizer step (global rank 0's); a resume whose restored state is
            not its step's receipt is refused.
        multiprocess: accept a Trainer on several processes, whose DDP gives the bits of that process count,
            not one process's; without it such a fit is refused at its setup (``steps.refuse_processes``).
        config: what else the run holds fixed that its checkpoint does not (a seed the data is made from, a
            corpus's name), JSON-able: recorded in run.json, and a resume under other values refused before
            anything is written, naming them (as ``samestep.Run``'s ``config``).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        level: str = "step",
        steps: set[int] | str | None = None,
        threads: int | None = 1,
        kernels: bool = False,
        receipts: bool = True,
        multiprocess: bool = False,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.config = config
        self.level, self.steps, self.threads, self.kernels = level, steps, threads, kernels
        self.receipts, self.multiprocess = receipts, multiprocess
        self._proto = RunProtocol()  # deterministic mode from fit's setup; the trace from training's start
        self._rec: Any = None
        self._hooked: HookedSteps | None = None
        self._saved: dict[str, Any] | None = None  # the state a resume loaded, until its first step
        self._mb = 0
        self._trainer: pl.Trainer | None = None  # state_dict() is given no trainer: fit's, from on_fit_start
        self._quiet: list[Any] = []  # warning filters this callback added, removed at the end
        self._saving: int | None = None  # the step of the checkpoint being written, until its file is known
        self._indexed: set[str] = set()  # the checkpoint files run.json holds (or held when this process began)
        self._replay = ReplayRequest.for_run(self.run_dir, "SamestepCallback")
        if self._replay is not None:  # the scratch directory, traced as asked, receipted; see replay_request
            self.run_dir = Path(self._replay.into)
            self.level, self.steps, self.receipts = self._replay.level, self._replay.trace_steps, True
            _replaying_fit()

    @property
    def state_key(self) -> str:
        return "samestep"

    # -- start and end -----------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        refuse_processes(trainer.world_size, "SamestepCallback", self.multiprocess)
        if stage == "fit":
            self._proto.enable(threads=self.threads, kernels=self.kernels, who="SamestepCallback")
        if self._replay is not None:  # the run's checkpoints stay as they are: a replay's go to its scratch directory
            for cb in trainer.checkpoint_callbacks:
                cb.dirpath = str(Path(self._replay.into) / "lightning_checkpoints")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        refusing = self._replay.refusing(ResumeMismatch, ReceiptError) if self._replay else contextlib.nullcontext()
        with refusing:  # a replay's resume refused: its checkpoint is not the run's (the verdict says so)
            self._start(trainer, pl_module)

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        resumed = self._saved is not None and trainer.global_step > 0
        if resumed:
            saved = self._saved
            check_resume(saved["fingerprint"], self._fingerprint(trainer, pl_module), "the checkpoint's samestep state")
            self._position_data(trainer)
        configs = trainer.lr_scheduler_configs
        self._hooked = HookedSteps.start(
            self._proto,
            self.run_dir,
            level=self.level,
            steps=self.steps,
            resume=resumed,
            model=pl_module,
            how_to_resume="trainer.fit(..., ckpt_path=...)",
            receipts=self.receipts and trainer.is_global_zero,
            start=trainer.global_step if resumed else 0,
            optimizer=trainer.optimizers[0] if trainer.optimizers else None,
            scheduler=configs[0].scheduler if configs else None,
            source="lightning.Trainer",
            agree=any_rank if self.receipts else None,
            program=program.describe(self.run_dir, resumes(LIGHTNING, self.run_dir))
            if trainer.is_global_zero
            else None,
            config=self.config,
        )  # a replay's: what it ran
        self._rec = self._hooked.rec
        if self._indexes(trainer):
            self._indexed = _saved_files(trainer)  # a resumed ModelCheckpoint knows the files before this process
            if resumed and trainer.ckpt_path:
                index(self.run_dir, trainer.global_step, Path(trainer.ckpt_path))

    def _indexes(self, trainer: pl.Trainer) -> bool:
        """Whether this process records the checkpoints in run.json (global rank 0's, no replay)."""
        return self._replay is None and trainer.is_global_zero

    def _note_saved(self, trainer: pl.Trainer) -> None:
        """Indexes the files Lightning's ModelCheckpoint wrote since the callback's state was saved into one."""
        step, self._saving = self._saving, None
        if step is None or not self._indexes(trainer):
            return
        for path in sorted(_saved_files(trainer) - self._indexed):
            if Path(path).is_file():
                index(self.run_dir, step, Path(path))
                self._indexed.add(path)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note_saved(trainer)
        self._end()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._end()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._end()
        if stage == "fit":
            self._proto.close()

    def _end(self) -> None:
        hooked, self._hooked, self._rec = self._hooked, None, None
        if hooked is not None:
            hooked.close()
        for entry in self._quiet:
            if entry in warnings.filters:
                warnings.filters.remove(entry)
        self._quiet.clear()

    # -- each step -----------------------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._note_saved(trainer)
        if self._saved is not None:  # the first resumed step: the RNG as it stood after the checkpoint's step
            if not self._saved.get("epoch_end"):
                meta, tensors = self._saved["rng"]
                restore_rng(meta, tensors)
            self._saved = None
        if self._hooked is None:
            return
        if self._hooked.step is None:
            self._hooked.begin_step(trainer.global_step + 1)
            self._mb = 0
        else:
            self._mb += 1
        self._hooked.begin_microbatch(self._mb)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._hooked is not None and self._hooked.step is not None:
            self._hooked.end_microbatch()
            self._rec.grads(pl_module.named_parameters())

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        hooked = self._hooked
        if hooked is None or hooked.step is None:
            return
        hooked.end_microbatch()
        if trainer.global_step < hooked.step:
            return  # accumulating: the step goes on with the next batch
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
            self._rec.metric("loss", loss)
        self._rec.state(pl_module, trainer.optimizers[0] if trainer.optimizers else None)
        # the update and the scheduler's step are made (Lightning steps it before this hook): the receipt's state
        hooked.end_step(float(loss) if isinstance(loss, torch.Tensor) else math.nan)
        if self._replay is not None and trainer.global_step >= self._replay.stop_after:
            trainer.should_stop = True  # the replay's last step

    # -- Lightning's checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Saved in Lightning's checkpoint (after the step's update): the RNG states and the state's digests.
        The trace of the steps it holds is made durable first."""
        if self._hooked is not None:
            self._hooked.sync()
        trainer = self._trainer
        if trainer is None:
            raise RuntimeError("SamestepCallback.state_dict() outside Trainer.fit: nothing to fingerprint")
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        self._saving = trainer.global_step
        return {
            "rng": capture_rng(),
            "fingerprint": self._fingerprint(trainer, trainer.lightning_module),
            "epoch_end": done >= trainer.num_training_batches,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not {"rng", "fingerprint"} <= state_dict.keys():
            raise ResumeMismatch(
                "the checkpoint's samestep state lacks 'rng' or 'fingerprint': it was not saved by "
                "this SamestepCallback; resume from a checkpoint it saved"
            )
        self._saved = state_dict
        if state_dict.get("epoch_end"):
            # After an epoch's last step the run went on to a new epoch, whose data loader draws its base
            # seed from the RNG before the first batch: restored now, before Lightning makes that loader, the
            # draw is the straight run's. Mid-epoch the loader went on, so the RNG waits for the first batch.
            meta, tensors = state_dict["rng"]
            restore_rng(meta, tensors)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer

    @staticmethod
    def _fingerprint(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        opt = trainer.optimizers[0] if trainer.optimizers else None
        configs = trainer.lr_scheduler_configs
        return state_fingerprint(trainer.global_step, pl_module, opt, configs[0].scheduler if configs else None)

    def _position_data(self, trainer: pl.Trainer) -> None:
        """Moves the training data to the first batch the checkpoint had not consumed."""
        # processed: the batches whose step ran (the checkpoint is written before Lightning counts its
        # last one completed); a checkpoint that ended its epoch leaves the next epoch to start at its first
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        if done >= trainer.num_training_batches:
            done = 0
        loader = trainer.train_dataloader
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, KeyedSampler):
            sampler.resume_at(min(done * loader.batch_size, sampler.n))
            # Lightning warns that a plain loader cannot resume mid-epoch; this one can, and just did
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
            self._quiet.append(warnings.filters[0])
            return
        if done == 0 or (hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")):
            return  # at an epoch's start, or a loader that Lightning itself resumes
        raise ResumeMismatch(
            f"the checkpoint stands {done} batch(es) into an epoch, and the training DataLoader "
            f"({type(loader).__name__} with {type(sampler).__name__}) cannot start there: Lightning "
            "would restart the epoch's data. Give it sampler=samestep.integrations.lightning."
            "KeyedSampler(len(dataset), seed), or a stateful loader (state_dict/load_state_dict)"
        )


def _saved_files(trainer: pl.Trainer) -> set[str]:
    """The checkpoint files Lightning's ModelCheckpoint callbacks know of (best, last, the top k kept)."""
    out: set[str] = set()
    for cb in trainer.checkpoint_callbacks:
        out.update(
            p
            for p in (
                getattr(cb, "best_model_path", ""),
                getattr(cb, "last_model_path", ""),
                *getattr(cb, "best_k_models", {}),
            )
            if p
        )
    return {str(Path(p).resolve()) for p in out}


def _replaying_fit() -> None:
    """Makes ``Trainer.fit`` of a Trainer whose SamestepCallback replays resume from the request's checkpoint
    (from scratch without one) and end the process (exit 0) once training stops: the program's code after it
    is the run's. Installed once, in a replaying process only."""
    if getattr(pl.Trainer.fit, "samestep_replay", False):
        return
    original = pl.Trainer.fit
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(self: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
        mine = next((cb for cb in self.callbacks if isinstance(cb, SamestepCallback) and cb._replay is not None), None)
        if mine is None:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["ckpt_path"] = mine._replay.resume_from
        original(*bound.args, **bound.kwargs)
        raise SystemExit(0)

    fit.samestep_replay = True  # type: ignore[attr-defined]
    pl.Trainer.fit = fit

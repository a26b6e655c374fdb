"""samestep in the Hugging Face ``transformers`` Trainer, as one callback.

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[samestep.integrations.huggingface.SamestepCallback()])
    trainer.train(resume_from_checkpoint=...)

What it does:

- deterministic mode (``samestep.enable``) from the Trainer's construction on, recorded in run.json;
- a trace of every step (or ``steps=``) into ``args.output_dir`` (or ``run_dir``), for ``samestep diff``:
  microbatches numbered by their place in the gradient accumulation, every gradient after clipping and
  before the update, the parameters and optimizer state after it;
- a receipt of every step (``receipts/rank_00000.jsonl``, ``samestep receipts verify``): the checksum of
  the model, optimizer and scheduler state after the update, chained by hash (no loss bits: the Trainer
  gives its callbacks none per step);
- beside each of the Trainer's checkpoints, ``samestep.json``: the digests of the model, optimizer,
  scheduler and every RNG state as saved, and the trace and receipts made durable before it;
- on ``resume_from_checkpoint``, every digest compared with what the Trainer restored, before the first
  resumed step runs: a resume that would leave the checkpointed run's numerical path (its RNG file gone,
  say, which the Trainer only warns about) stops with ``ResumeMismatch`` naming the part.

The Trainer's own resume restores the data position (it skips the batches its checkpoint consumed) and
the RNG states; this callback checks that it did, and the trace shows the rest.

run.json records the program (``samestep.replay.program``), so that ``samestep verify`` and ``samestep bisect`` run
it again: under their replay request (``samestep.replay.request``) the callback points the Trainer's output
directory and the trace at the request's scratch directory, has ``Trainer.train`` resume from the copy of
the checkpoint there (whatever the program passes it), traces as asked, saves no checkpoint, and ends the
process (exit 0) after the request's last step.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from samestep.distributed.agree import any_rank
from samestep.integrations.fingerprint import ResumeMismatch, check_resume, rng_digest, state_fingerprint
from samestep.integrations.steps import HookedSteps, refuse_processes
from samestep.loop.protocol import RunProtocol
from samestep.records.durable import read_file, write_durable
from samestep.records.receipts import ReceiptError
from samestep.replay import program
from samestep.replay.request import ReplayRequest
from samestep.replay.resume_points import HF, HF_FINGERPRINT, resumes

__all__ = ["FINGERPRINT", "ResumeMismatch", "SamestepCallback"]

FINGERPRINT = HF_FINGERPRINT  # in each checkpoint-N directory

# The TrainingArguments that change a step's bits and that no checkpoint holds (the data order's seeds, the
# schedule's closures, the batch), held fixed across a resume as run.json's declared config
HELD_ARGS = (
    "seed",
    "data_seed",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "warmup_ratio",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "optim",
    "bf16",
    "fp16",
    "dataloader_drop_last",
)


class SamestepCallback(TrainerCallback):
    """Deterministic mode, a trace, and checked resumes for ``transformers.Trainer``.

    Args:
        run_dir: where the trace and run.json go (default: the Trainer's ``output_dir``).
        level: the trace level, ``"step"``, ``"module"``, ``"op"`` or ``"off"``.
        steps: the 1-based optimizer steps to trace (a set, or text like ``"1-5"``); ``None`` traces all.
        threads: the intra-op thread count that deterministic mode pins.
        kernels: route racy ops through samestep's deterministic kernels.
        receipts: write a receipt of every step (the process that saves, as the Trainer's checkpoints); a
            resume whose restored state is not its step's receipt is refused.
        multiprocess: accept a Trainer on several processes, whose DDP gives the bits of that process count,
            not one process's; without it such a Trainer is refused at its construction
            (``steps.refuse_processes``).
        config: what else the run holds fixed that its checkpoint does not (a seed the data is made from, a
            corpus's name), JSON-able: recorded in run.json with the TrainingArguments in ``HELD_ARGS``, and a
            resume under other values of either refused before anything is written, naming them (as
            ``samestep.Run``'s ``config``).
    """

    def __init__(
        self,
        run_dir: str | Path | None = None,
        *,
        level: str = "step",
        steps: set[int] | str | None = None,
        threads: int | None = 1,
        kernels: bool = False,
        receipts: bool = True,
        multiprocess: bool = False,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.config = config
        self.level, self.steps, self.threads, self.kernels = level, steps, threads, kernels
        self.receipts, self.multiprocess = receipts, multiprocess
        self._proto = RunProtocol()  # deterministic mode from the Trainer's construction; the trace from train()
        self._rec: Any = None
        self._hooked: HookedSteps | None = None
        self._pending: tuple[dict[str, Any], str] | None = None  # a resume's RNG digest, checked at its first step
        self._replay: ReplayRequest | None = None  # samestep verify's or bisect's, from the Trainer's construction

    # -- start and end -----------------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        refuse_processes(args.world_size, "SamestepCallback", self.multiprocess)
        self._replay = ReplayRequest.for_run(self.run_dir or Path(args.output_dir), "SamestepCallback")
        if self._replay is not None:  # the scratch directory, traced as asked, receipted; see replay_request
            self.run_dir = Path(self._replay.into)
            args.output_dir = self._replay.into  # the Trainer's own files too (the arguments are the Trainer's)
            self.level, self.steps, self.receipts = self._replay.level, self._replay.trace_steps, True
            _replaying_train()
        self._proto.enable(threads=self.threads, kernels=self.kernels, who="SamestepCallback")

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        **kwargs: Any,
    ) -> None:
        self._end()
        refusing = self._replay.refusing(ResumeMismatch, ReceiptError) if self._replay else contextlib.nullcontext()
        with refusing:  # a replay's resume refused: its checkpoint is not the run's (the verdict says so)
            self._start(args, state, model, optimizer, lr_scheduler)

    def _start(self, args: Any, state: Any, model: Any, optimizer: Any, lr_scheduler: Any) -> None:
        run_dir = self.run_dir or Path(args.output_dir)
        resumed = state.global_step > 0
        if resumed:  # the Trainer has restored the model, the optimizer and the scheduler by now
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            saved = _read_fingerprint(checkpoint / FINGERPRINT)
            check_resume(
                saved,
                state_fingerprint(state.global_step, model, optimizer, lr_scheduler),
                str(checkpoint / FINGERPRINT),
            )
            if float(state.epoch or 0).is_integer():
                # at an epoch's end: the Trainer restores the RNG before the next epoch's sampler draws its
                # order, so at the first step it has moved on (in the straight run too); the RNG file it
                # restores from must be there
                _check_rng_file(checkpoint, args)
            else:  # mid-epoch: the Trainer restores the RNG right before the first resumed step
                self._pending = (saved, str(checkpoint / FINGERPRINT))
        if not args.should_save and self.level != "off":
            self.level = "off"  # a process that saves nothing writes no trace (the Trainer's rank rule)

        self._hooked = HookedSteps.start(
            self._proto,
            run_dir,
            level=self.level,
            steps=self.steps,
            resume=resumed,
            model=model,
            how_to_resume="trainer.train(resume_from_checkpoint=...)",
            receipts=self.receipts and args.should_save,
            start=state.global_step if resumed else 0,
            optimizer=getattr(optimizer, "optimizer", optimizer),  # accelerate wraps it; the update is the inner one's
            scheduler=lr_scheduler,
            source="transformers.Trainer",
            agree=any_rank if self.receipts else None,
            program=None
            if not args.should_save
            else program.describe(  # a replay's: what it ran
                run_dir, resumes(HF, run_dir, Path(args.output_dir))
            ),
            config={"TrainingArguments": {k: getattr(args, k) for k in HELD_ARGS if hasattr(args, k)}}
            | (self.config or {}),
        )
        self._rec = self._hooked.rec

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end()

    def _end(self) -> None:
        hooked, self._hooked, self._rec = self._hooked, None, None
        if hooked is not None:
            hooked.close()

    def close(self) -> None:
        """Closes the trace and turns deterministic mode off if this callback turned it on (for a process
        that goes on after training; the Trainer itself does not call it)."""
        self._end()
        self._proto.close()

    # -- each step -----------------------------------------------------------------------------------------
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending is not None:
            saved, where = self._pending
            self._pending = None
            check_resume(saved, {"rng": rng_digest()}, where, parts=("rng",))
        if self._hooked is not None:
            self._hooked.begin_step(state.global_step + 1)
            self._hooked.begin_microbatch(0)

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hooked is not None and self._hooked.microbatch is not None:
            self._hooked.begin_microbatch(self._hooked.microbatch + 1)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self._hooked is not None and self._hooked.step is not None:
            self._hooked.end_microbatch()
            self._rec.grads(model.named_parameters())

    def on_optimizer_step(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        if self._hooked is not None and self._hooked.step is not None:
            self._rec.state(model, optimizer)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._replay is not None:  # its receipts are all a replay keeps; it ends after its last step
            control.should_save = False
            control.should_training_stop = control.should_training_stop or state.global_step >= self._replay.stop_after
        if self._hooked is not None:
            self._hooked.end_step()  # the update and the scheduler's step are made: the receipt's state
            if control.should_save:
                self._hooked.sync()  # the steps the checkpoint holds are on disk first

    def on_save(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        **kwargs: Any,
    ) -> None:
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not args.should_save or not checkpoint.is_dir():
            return
        if self._hooked is not None and self._hooked.proto.receipt_holds(state.global_step) is False:
            raise ValueError(
                f"{checkpoint}: the Trainer saved another state than samestep's receipt of step "
                f"{state.global_step} records: something changed the model, optimizer or scheduler "
                "between SamestepCallback's on_step_end and the save (a callback listed after it, in "
                "its on_step_end), so no resume from this checkpoint would pass its check. Fix: make "
                "that change before the step's update ends (on_pre_optimizer_step, or in the "
                "optimizer), or list SamestepCallback after that callback"
            )
        doc = {**state_fingerprint(state.global_step, model, optimizer, lr_scheduler), "rng": rng_digest()}
        write_durable(checkpoint / FINGERPRINT, json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n")


def _replaying_train() -> None:
    """Makes ``Trainer.train`` of a Trainer whose SamestepCallback replays resume from the request's checkpoint
    (from scratch without one), close the callback and end the process (exit 0) once training stops: the
    program's code after it is the run's. Installed once, in a replaying process only."""
    from transformers import Trainer

    if getattr(Trainer.train, "samestep_replay", False):
        return
    original = Trainer.train

    @functools.wraps(original)
    def train(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        mine = next(
            (
                cb
                for cb in self.callback_handler.callbacks
                if isinstance(cb, SamestepCallback) and cb._replay is not None
            ),
            None,
        )
        if mine is None:
            return original(self, resume_from_checkpoint, *args, **kwargs)
        try:
            original(self, mine._replay.resume_from, *args, **kwargs)
        finally:
            mine.close()
        raise SystemExit(0)

    train.samestep_replay = True  # type: ignore[attr-defined]
    Trainer.train = train


def _check_rng_file(checkpoint: Path, args: Any) -> None:
    """The Trainer's RNG file for this process is in the checkpoint (the Trainer only warns without it)."""
    rank = getattr(args, "process_index", 0)
    names = ("rng_state.pth",) if getattr(args, "world_size", 1) <= 1 else (f"rng_state_{rank}.pth",)
    if not any((checkpoint / name).is_file() for name in names):
        raise ResumeMismatch(
            f"{checkpoint}: holds no {names[0]}, so the Trainer cannot restore the RNG states it "
            "saved: the rng differs from the checkpoint's, and the resume would not continue on "
            "the checkpointed run's numerical path; restore the file, or resume from another "
            "checkpoint"
        )


def _read_fingerprint(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(read_file(path))
    except FileNotFoundError:
        raise ResumeMismatch(
            f"{path}: missing, so the resume cannot be checked; resume from a checkpoint that a "
            "run with SamestepCallback saved, or start a new run"
        ) from None
    except (OSError, ValueError) as e:
        raise ResumeMismatch(f"{path}: unreadable ({e}); resume from another checkpoint") from None
    if not isinstance(doc, dict):
        raise ResumeMismatch(f"{path}: not a JSON table; resume from another checkpoint")
    return doc

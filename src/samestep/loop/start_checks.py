"""What ``samestep.Run`` checks and fixes before it restores or writes anything: the settings a run holds fixed
(run.json's ``declared``) and a resume's changes to them, the models on the ranks, the generator states a
resume on another number of processes cannot carry, and a DataLoader data cursor's own generators (refused
where it draws from torch's global RNG; the ones a checkpoint holds and a resume puts back). Each refusal is
raised on every rank alike (docs/api.md, ``samestep.Run``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from samestep.checkpoint import committed_steps
from samestep.exit_codes import Refusal
from samestep.hashing.state import state_digest
from samestep.records.rundir import declared_changes

__all__ = [
    "check_arguments",
    "checkpoints_held",
    "declare",
    "declared",
    "declared_config",
    "loader_generators",
    "refuse_changes",
    "refuse_foreign_parameters",
    "refuse_parts",
    "refuse_rng_change",
    "resume_epoch",
    "warn_unheld_scheduler",
]


def declared(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data_cursor: Any,
    config: dict[str, Any] | None,
) -> dict[str, Any]:
    """What a run holds fixed, as built (before a resume restores anything): JSON, for run.json."""
    shapes = [[name, list(t.shape), str(t.dtype)] for name, t in model.state_dict().items()]
    groups = {
        str(i): {k: v for k, v in group.items() if k != "params"} | {"params": len(group["params"])}
        for i, group in enumerate(optimizer.param_groups)
    }  # by index: a change is named by its field
    out: dict[str, Any] = {
        "model": state_digest({"shapes": shapes}),
        "optimizer": json.loads(json.dumps({"class": type(optimizer).__qualname__, "groups": groups}, default=repr)),
        "config": declared_config(config),
    }
    for name, obj in (("scheduler", scheduler), ("data_cursor", data_cursor)):
        if obj is not None:
            out[name] = state_digest(obj.state_dict())
    return out


def declared_config(config: dict[str, Any] | None) -> dict[str, Any]:
    """What else a run holds fixed (a seed, a batch size), as run.json records it: JSON, unknown types by repr."""
    return json.loads(json.dumps(config or {}, default=repr))


def refuse_foreign_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuses an optimizer that updates tensors which are not ``model``'s parameters: one built before
    ``fully_shard`` or ``parallelize_module`` replaced them (it updates the old tensors, and the model trains
    nothing), or a tensor kept outside the model (its value is in no checkpoint, so a resume loses it).

    Raises:
        ValueError: names how many, the first one's shape, and the fix.
    """
    own = {id(p) for p in model.parameters()}
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
    if foreign:
        raise Refusal(
            f"samestep.Run: the optimizer updates {len(foreign)} tensor(s) that are not the model's "
            f"parameters (the first of shape {list(foreign[0].shape)}): it was built before "
            "fully_shard or parallelize_module replaced them, or holds a tensor kept outside the model, "
            "whose value no checkpoint would hold. Fix: build the optimizer from model.parameters() "
            "after sharding or parallelizing the model, and keep every trained tensor in the model"
        )


def warn_unheld_scheduler(optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    """Warns, one line, where an LR scheduler steps ``optimizer`` (PyTorch's schedulers wrap its ``step``) but
    Run was given none: no checkpoint holds its state, so a resume starts it over, and the steps computed again
    are checked against their receipts and stop the run (``records.resume_check``)."""
    if scheduler is None and hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        warnings.warn(
            "samestep.Run: an LR scheduler steps this optimizer, but Run was not given it: no checkpoint holds "
            "its state, so a resume would start it over on other bits (and stop at the first step computed "
            "again). Fix: samestep.Run(..., scheduler=scheduler)",
            UserWarning,
            stacklevel=3,
        )


def refuse_changes(run_dir: Path, settings: dict[str, Any], who: str = "samestep.Run") -> None:
    """Refuses to continue ``run_dir`` with other ``settings`` (``declared``'s, or a part of them) than it holds;
    ``who``: what the line names (samestep.Run, a callback)."""
    changed = declared_changes(run_dir, settings)
    if changed:
        raise Refusal(
            f"{who}: {run_dir} holds a run started with other settings ({'; '.join(changed)}); "
            "continuing it would change its bits: continue it as it started, or use a new run directory"
        )


def refuse_parts(model_digest: str) -> None:
    """Rank 0 saves and receipts the whole state of a model that no DTensor splits: refused, on every rank alike,
    where the ranks hold other models (their parameter names, shapes or dtypes), as pipeline stages or experts
    placed by the loop do, whose checkpoint would hold rank 0's part alone."""
    from samestep.distributed.agree import ranks_unlike_rank_0

    unlike = ranks_unlike_rank_0(model_digest)
    if unlike:
        raise Refusal(
            f"samestep.Run: rank(s) {', '.join(map(str, unlike))} hold another model than rank 0 (other "
            "parameter names, shapes or dtypes): a model in parts across ranks (pipeline stages, "
            "experts a loop places) is not one state that rank 0 can save, and a resume from rank 0's "
            "part would leave the run. Fix: the same model on every rank (replicated, DDP), or split "
            "by DTensors (FSDP2, tensor parallelism), which each rank saves its shards of"
        )


def refuse_rng_change(loaded: Any, world: int, rng: str, generators: dict[str, torch.Generator] | None) -> None:
    """A checkpoint written by another number of processes holds no generator states for this layout's ranks:
    its resume is the run's only where the loop's randomness is keyed by where the run stands (``rng="keyed"``;
    docs/api.md), and a DataLoader cursor's generators, saved per rank, cannot follow. Raised on every rank
    alike, before anything is written."""
    if loaded.world_size == world:
        return
    where = f"{loaded.path} was written by {loaded.world_size} process(es), this run has {world}"
    if rng == "restore":
        raise Refusal(
            f"samestep.Run: {where}, so each rank's generator states cannot carry over. Fix: resume "
            f"on {loaded.world_size} process(es), or, where every random draw of the loop comes from "
            "samestep.rng.generator(seed, step, microbatch, ...) (no global RNG: no dropout drawn from "
            "torch's generator), pass samestep.Run(..., rng='keyed')"
        )
    if generators:
        raise Refusal(
            f"samestep.Run: {where}, and its DataLoader data cursor's generators are saved per rank. "
            "Fix: resume on as many processes, or make the data a pure function of the step and "
            "microbatch (samestep.rng.generator)"
        )


def loader_generators(data_cursor: Any) -> dict[str, torch.Generator] | None:
    """The generators a DataLoader data cursor (torchdata's StatefulDataLoader is one) draws from, for each
    checkpoint to hold and a resume to restore: its own and its sampler's. Its state dict alone leaves them
    where the new loader's construction put them.

    Raises:
        ValueError: it draws from torch's global RNG each time an iterator starts (the workers' seed without a
            ``generator``, the shuffle order of a sampler without one of its own). A resume starts its iterator
            mid-epoch, where the run it continues drew nothing, so every later draw of the global RNG (dropout,
            the next epoch's order) would differ; names the fix.
    """
    from torch.utils.data import DataLoader

    if not isinstance(data_cursor, DataLoader):
        return None
    sampler = getattr(data_cursor, "sampler", None)
    shuffled = type(sampler).__name__ == "RandomSampler"  # torch's, or torchdata's stateful one
    if data_cursor.generator is None or (shuffled and getattr(sampler, "generator", None) is None):
        raise Refusal(
            f"samestep.Run(data_cursor={type(data_cursor).__name__}(...)): it draws from torch's global "
            "RNG each time an iterator starts (its workers' seed, and a shuffle order without a "
            "generator of its own), which a resume does where the run it continues drew nothing, so "
            "the bits would differ from the resume on. Fix: pass the loader (and any RandomSampler) "
            "generator=torch.Generator().manual_seed(SEED)"
        )
    own = {"samestep.data_cursor": data_cursor.generator}
    if shuffled and sampler.generator is not data_cursor.generator:
        own["samestep.data_cursor.sampler"] = sampler.generator
    return own


def resume_epoch(loader: Any, generators: dict[str, torch.Generator]) -> None:
    """Makes a restored DataLoader's iterator of the epoch it resumes now (its ``state_dict`` does, and its
    next ``iter`` takes that one), then puts its generators back where the checkpoint had them: making it draws
    from them, and the run it continues drew that when the epoch began, not here."""
    states = {name: g.get_state() for name, g in generators.items()}
    loader.state_dict()
    for name, g in generators.items():
        g.set_state(states[name])


def check_arguments(checkpoint_every: int, resume: bool | str, rng: str) -> None:
    """``samestep.Run``'s arguments that no run can take, refused before anything is made."""
    if checkpoint_every < 1:
        raise Refusal(f"samestep.Run(checkpoint_every={checkpoint_every!r}): save at least every step count >= 1")
    if resume not in ("auto", True, False):
        raise Refusal(f"samestep.Run(resume={resume!r}): use 'auto', True or False")
    if rng not in ("restore", "keyed"):
        raise Refusal(
            f"samestep.Run(rng={rng!r}): use 'restore' (each rank's generator states carry over) "
            "or 'keyed' (the loop's randomness is keyed by step and microbatch)"
        )


def checkpoints_held(checkpoints: Path, resume: bool | str) -> bool:
    """Whether ``checkpoints`` holds a committed checkpoint, refused where ``resume`` says it must not (or must)."""
    held = bool(committed_steps(checkpoints))
    if held and resume is False:
        raise Refusal(
            f"samestep.Run: {checkpoints} already holds checkpoints; pass "
            "resume='auto' to continue that run, or use a new run directory"
        )
    if not held and resume is True:
        raise Refusal(f"samestep.Run: resume=True, but {checkpoints} holds no checkpoint")
    return held


def declare(
    run_dir: Path, parts: tuple[Any, Any, Any, Any], config: dict[str, Any] | None, sharded: bool, resume: bool | str
) -> dict[str, Any]:
    """What a run holds fixed (run.json's ``declared``) of its (model, optimizer, scheduler, data cursor) and
    ``config``; a plain model's parts, and a resume's changes to what it holds fixed, refused before anything is
    restored or written."""
    held = declared(*parts, config)
    if not sharded:
        refuse_parts(held["model"])
    if resume is not False:
        refuse_changes(run_dir, held)
    return held

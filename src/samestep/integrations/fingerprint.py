"""What a resume must restore, as digests: the model's and optimizer's state and every RNG of the process.

A framework callback stores them beside the framework's own checkpoint and, when a run resumes from it,
compares them with what the framework restored, before the first resumed step runs: a resume that would
continue on another numerical path (an RNG file missing, a state the framework left out) is refused by
name instead of training on.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from samestep.determinism.rng import capture_rng
from samestep.hashing.state import sha256_tensor, state_digest

__all__ = ["FORMAT", "VERSION", "ResumeMismatch", "check_resume", "rng_digest", "state_fingerprint"]

FORMAT = "samestep.resume-fingerprint"
VERSION = 1


class ResumeMismatch(RuntimeError):
    """A resumed run does not stand where its checkpoint's run stood."""


def rng_digest() -> str:
    """SHA-256 over every RNG state of this process (python, numpy, torch CPU and CUDA, registered)."""
    meta, tensors = capture_rng()
    h = hashlib.sha256(repr(sorted((k, v) for k, v in meta.items())).encode())
    for name in sorted(tensors):
        h.update(name.encode() + b"\0" + sha256_tensor(tensors[name]).encode())
    return h.hexdigest()


def state_fingerprint(
    step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any = None
) -> dict[str, Any]:
    """The digests of the training state at ``step`` (after its update), JSON-able, with format and version."""
    doc: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "model": state_digest(model.state_dict()),
    }
    if optimizer is not None:
        doc["optimizer"] = state_digest(optimizer.state_dict())
    if scheduler is not None and hasattr(scheduler, "state_dict"):
        doc["scheduler"] = state_digest(scheduler.state_dict())
    return doc


def check_resume(
    saved: dict[str, Any],
    now: dict[str, Any],
    where: str,
    parts: tuple[str, ...] = ("step", "model", "optimizer", "scheduler", "rng"),
) -> None:
    """Compares a checkpoint's fingerprint with the state a resume restored: the ``parts`` both hold.

    Raises:
        ResumeMismatch: names ``where`` (the checkpoint), the part that differs, and what to check.
    """
    if saved.get("format") != FORMAT or saved.get("version") != VERSION:
        raise ResumeMismatch(
            f"{where}: not a {FORMAT} version {VERSION} document (format "
            f"{saved.get('format')!r}, version {saved.get('version')!r})"
        )
    fixes = {
        "model": "the framework restored other weights than it saved",
        "optimizer": "the optimizer state was not restored (or another optimizer was built)",
        "scheduler": "the learning-rate scheduler was not restored",
        "rng": "the RNG states were not restored as saved (is the framework's RNG file missing?)",
    }
    for part in parts:
        if part in saved and part in now and saved[part] != now[part]:
            fix = fixes.get(part, "the run resumed from another step than the checkpoint's")
            raise ResumeMismatch(
                f"{where}: the resumed run's {part} differs from the checkpoint's "
                f"({str(now[part])[:16]} vs {str(saved[part])[:16]}): {fix}; it would not "
                "continue on the checkpointed run's numerical path"
            )

"""The reference run's learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["WarmupCosine"]


@dataclass(slots=True)
class WarmupCosine:
    """Linear warmup to ``lr``, then cosine decay to ``min_lr`` at ``steps``: a pure function of the step."""

    lr: float
    min_lr: float
    warmup_steps: int
    steps: int

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(self.steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - self.min_lr)

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The schedule has no hidden state; a saved one that differs means a changed config.
        if state != self.state_dict():
            raise ValueError(f"LR schedule: saved {state} but this run has {self.state_dict()}")

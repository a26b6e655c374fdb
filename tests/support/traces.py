"""What the trace tests share: a tiny model, a two-step recording of it at a level, a stream less its step ends,
a run directory described by a minimal run.json."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import torch

from samestep.tracing import Recorder
from samestep.tracing.stream import END

__all__ = ["Tiny", "described", "record", "without_ends"]


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x)).sum()


def without_ends(table: pa.Table) -> pa.Table:
    """A stream's records less the step.end records that close its steps."""
    return table.filter(pc.not_equal(table.column("op"), END))


def record(run: Path, level: str, scale: float = 1.0, copy: bool = False, steps: set[int] | None = None) -> Recorder:
    torch.manual_seed(0)
    model = Tiny()
    rec = Recorder(run, level=level, copy=copy, steps=steps)
    rec.attach(model)
    for step in (1, 2):
        with rec.step(step):
            for mb in (0, 1):
                with rec.microbatch(mb):
                    (model(torch.ones(2, 4) * scale * (mb + 1)) * 1.0).backward()
            rec.grads(model.named_parameters())
            rec.metric("loss", 1.5)
    rec.close()
    return rec


def described(run: Path, trace: dict | None = None, config: dict | None = None, world: int = 1) -> Path:
    """``run`` with a minimal run.json: ``config``, or just a ``trace`` section."""
    config = config if config is not None else {"trace": trace} if trace else {}
    (run / "run.json").write_text(
        json.dumps(
            {
                "format": "samestep.run",
                "version": 1,
                "config": config,
                "determinism": {},
                "environment": {"torch.version": "x"},
                "layout": {"world_size": world},
            }
        )
    )
    return run

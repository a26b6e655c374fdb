"""samestep: bitwise-deterministic PyTorch pretraining.

    import samestep
    samestep.enable()                       # deterministic mode, validated, reversible
    samestep.save_checkpoint(root, step, model=model, optimizer=opt, data_cursor=cursor)
    samestep.load_checkpoint(root, model=model, optimizer=opt, data_cursor=cursor, fallback=True)
    rec = samestep.trace(run_dir, level="step")   # per-rank trace streams for samestep diff
    with samestep.Run(run_dir, model=model, optimizer=opt) as run:   # all of it, for a loop of your own
        for step in run.steps(total): ...

``samestep.trace`` loads the recorder (and pyarrow) when first used: ``import samestep`` stays light.
"""

import sys
from typing import Any

from samestep.checkpoint import CheckpointError, LoadedCheckpoint, load_checkpoint, save_checkpoint, verify_checkpoint
from samestep.determinism import preempt, rng
from samestep.determinism.env import compare_environments, environment
from samestep.determinism.mode import DeterminismReport, disable, enable, is_enabled
from samestep.determinism.rng import capture_rng, restore_rng
from samestep.digests import digest, digest_many
from samestep.loop.run import Run
from samestep.version import __version__

__all__ = [
    "CheckpointError",
    "DeterminismReport",
    "Run",
    "LoadedCheckpoint",
    "__version__",
    "capture_rng",
    "compare_environments",
    "digest",
    "digest_many",
    "disable",
    "enable",
    "environment",
    "is_enabled",
    "load_checkpoint",
    "preempt",
    "restore_rng",
    "rng",
    "save_checkpoint",
    "trace",
    "verify_checkpoint",
]


# The module paths docs/api.md named before these modules lived in packages: `import samestep.preempt` and
# `from samestep.protocol import RunProtocol` keep working (all are loaded by the imports above already).
_OLD_PATHS = {
    "checksums": "samestep.hashing.checksums",
    "loop_checks": "samestep.loop.step_checks",
    "preempt": "samestep.determinism.preempt",
    "protocol": "samestep.loop.protocol",
    "receipts": "samestep.records.receipts",
    "rng": "samestep.determinism.rng",
    "run": "samestep.loop.run",
}
for _old, _new in _OLD_PATHS.items():
    sys.modules[f"{__name__}.{_old}"] = sys.modules[_new]
    globals().setdefault(_old, sys.modules[_new])
del _old, _new


def __getattr__(name: str) -> Any:
    if name == "trace":
        from samestep.tracing.start import trace

        return trace
    raise AttributeError(f"module 'samestep' has no attribute {name!r}")

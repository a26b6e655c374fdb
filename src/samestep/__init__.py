"""samestep: bitwise-deterministic PyTorch pretraining.

    import samestep
    samestep.enable()                       # deterministic mode, validated, reversible
    samestep.save_checkpoint(root, step, model=model, optimizer=opt, data_cursor=cursor)
    samestep.load_checkpoint(root, model=model, optimizer=opt, data_cursor=cursor, fallback=True)
"""

from samestep import rng
from samestep.checkpoint import CheckpointError, LoadedCheckpoint, load_checkpoint, save_checkpoint, verify_checkpoint
from samestep.env import compare_environments, environment
from samestep.mode import DeterminismReport, disable, enable, is_enabled
from samestep.rng import capture_rng, restore_rng
from samestep.trace import digest, digest_many, trace

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "DeterminismReport", "LoadedCheckpoint", "__version__", "capture_rng", "compare_environments",
    "digest", "digest_many", "disable", "enable", "environment", "is_enabled", "load_checkpoint", "restore_rng", "rng",
    "save_checkpoint", "trace", "verify_checkpoint",
]

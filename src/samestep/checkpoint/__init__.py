"""Exact-resume checkpoints: safetensors plus a JSON manifest of digests, committed atomically."""

from samestep.checkpoint._format import FORMAT, VERSION, CheckpointError, committed_steps, step_dir_name
from samestep.checkpoint.load import LoadedCheckpoint, checkpoint_state, load_checkpoint, shard_count
from samestep.checkpoint.save import save_checkpoint
from samestep.checkpoint.verify import verify_checkpoint

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "LoadedCheckpoint",
    "checkpoint_state",
    "committed_steps",
    "load_checkpoint",
    "save_checkpoint",
    "shard_count",
    "step_dir_name",
    "verify_checkpoint",
]

"""The checkpoint format ("samestep.checkpoint", version 1): names and manifest.

    ROOT/                          e.g. RUN/checkpoints
      step_000100/
        manifest.json              format, version, step, world size, every file's size and SHA-256,
                                   every tensor's SHA-256, and the manifest's own SHA-256
        model.safetensors          model state (tied tensors stored once, aliases in the manifest)
        optimizer.safetensors      optimizer tensors; their non-tensor entries live in state.json
        state.json                 optimizer/scheduler/cursor skeletons, config, environment, extra
        rank_00000.safetensors     per-rank RNG tensors (never deduplicated across ranks)
        rank_00000.json            per-rank RNG metadata
      latest                       names the newest committed checkpoint; written last, for people and
                                   tools: loaders take the newest committed step_NNNNNN
      superseded/step_000200/      a checkpoint of a later step than one saved after it (a line of
                                   training the run left by loading an earlier checkpoint); never loaded

A checkpoint directory appears under its final name only by an atomic rename, after every file and
the manifest are fsync'ed, and leaves it (pruned) by a rename to a hidden name before it is deleted, so
a crash at any instant leaves only complete, committed checkpoints named.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from samestep.exit_codes import Refusal
from samestep.hashing.state import canonical_json
from samestep.records.durable import write_durable

FORMAT = "samestep.checkpoint"
VERSION = 1
# Version 2 adds sharded state: each rank's shards in its own files (``shard_names``), described in
# state.json's ``shards``. Unsharded checkpoints stay version 1; loaders read both.
SHARDED_VERSION = 2
# Version 3: a sharded tensor split along a dimension other than 0 (tensor parallelism's Shard(1)), its
# layout entry naming that dimension ("dim"). Written only when one is; loaders read 1, 2 and 3.
SPLIT_VERSION = 3
# Version 4: FSDP2 over tensor parallelism (a 2-D mesh): every rank writes its own shards, each a tensor rank's
# part cut into rows over the data ranks (a layout entry's "data"). Written only then; loaders read 1 to 4.
GRID_VERSION = 4
MANIFEST = "manifest.json"
LATEST = "latest"
SUPERSEDED = "superseded"
STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(Refusal):
    """A checkpoint is missing, corrupt, or does not fit what it is loaded into."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def rank_names(rank: int) -> tuple[str, str]:
    return f"rank_{rank:05d}.safetensors", f"rank_{rank:05d}.json"


def shard_names(rank: int) -> tuple[str, str]:
    """A rank's model and optimizer shard files in a sharded checkpoint."""
    return f"model.rank_{rank:05d}.safetensors", f"optimizer.rank_{rank:05d}.safetensors"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_digest(manifest: dict[str, Any]) -> str:
    """SHA-256 of the manifest without its own digest field."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return sha256_bytes(canonical_json(body))


def write_json(path: Path, obj: Any) -> bytes:
    data = json.dumps(obj, indent=1, sort_keys=True, allow_nan=False).encode("utf-8") + b"\n"
    write_durable(path, data)
    return data


def committed_steps(root: Path) -> list[tuple[int, Path]]:
    """Every committed checkpoint under ``root`` as ``(step, path)``, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)

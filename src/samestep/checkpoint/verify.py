"""A checkpoint checked before anything is restored from it: every file against the manifest's digests, its
structure, state.json and layout, each rank's JSON; the newest intact one found (fallback), and
verify_checkpoint."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load as safetensors_load

from samestep.checkpoint._format import (
    FORMAT,
    GRID_VERSION,
    MANIFEST,
    SHARDED_VERSION,
    SPLIT_VERSION,
    STEP_DIR,
    VERSION,
    CheckpointError,
    committed_steps,
    manifest_digest,
    rank_names,
    sha256_bytes,
    shard_names,
)
from samestep.hashing.state import sha256_tensor
from samestep.records.durable import NotAFile, read_file

__all__ = ["Verified", "candidate_paths", "first_intact", "verify", "verify_checkpoint"]


@dataclass(slots=True)
class Verified:
    path: Path
    manifest: dict[str, Any]
    data: dict[str, bytes]  # file name -> bytes, each checked against the manifest


def _tensor_problem(name: str, data: bytes, expected: dict[str, str]) -> str:
    """Names the tensor(s) that differ in a safetensors file whose SHA-256 did not match."""
    try:
        tensors = safetensors_load(data)
    except Exception as e:  # a damaged header: no tensor can be named
        return f"its header does not parse ({e})"
    bad = [k for k, digest in expected.items() if k not in tensors or sha256_tensor(tensors[k]) != digest]
    extra = sorted(set(tensors) - set(expected))
    if bad:
        return "tensor(s) " + ", ".join(repr(k) for k in bad) + " differ from their manifest digest"
    if extra:
        return "tensor(s) not in the manifest: " + ", ".join(map(repr, extra))
    return "its bytes differ from the manifest digest (header or padding)"


def verify(path: Path, only: set[str] | None = None) -> Verified:
    """Reads and checks one checkpoint directory; raises CheckpointError naming the first problem."""
    mpath = path / MANIFEST
    try:
        manifest = json.loads(read_file(mpath))
    except FileNotFoundError:
        raise CheckpointError(f"{mpath}: missing; {path} is not a committed samestep checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: not valid JSON ({e}); the manifest is corrupt") from None
    except (NotAFile, NotADirectoryError, PermissionError) as e:
        raise CheckpointError(
            str(e) if isinstance(e, NotAFile) else f"{mpath}: cannot be read ({e.strerror})"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{mpath}: format is {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
            f"expected {FORMAT!r}"
        )
    if manifest.get("version") not in (VERSION, SHARDED_VERSION, SPLIT_VERSION, GRID_VERSION):
        raise CheckpointError(
            f"{mpath}: version {manifest.get('version')!r} is not supported (this samestep "
            f"reads versions {VERSION} to {GRID_VERSION}); use the samestep release that wrote it"
        )
    if manifest.get("manifest_sha256") != manifest_digest(manifest):
        raise CheckpointError(f"{mpath}: its contents do not match manifest_sha256; the manifest was edited or damaged")
    _check_structure(mpath, manifest)
    named = STEP_DIR.match(path.name)
    if named and int(named.group(1)) != manifest["step"]:
        raise CheckpointError(
            f"{mpath}: says step {manifest['step']}, but it is {path.name}: the manifest was "
            "edited, or the directory renamed"
        )
    data: dict[str, bytes] = {}
    for name, entry in manifest["files"].items():
        if only is not None and name not in only:
            continue
        fpath = path / name
        try:
            blob = read_file(fpath)
        except FileNotFoundError:
            raise CheckpointError(f"{fpath}: missing (listed in the manifest)") from None
        except (NotAFile, PermissionError) as e:  # a corrupt checkpoint like any other: a fallback skips it
            raise CheckpointError(
                str(e) if isinstance(e, NotAFile) else f"{fpath}: cannot be read ({e.strerror})"
            ) from None
        if len(blob) != entry["size"]:
            raise CheckpointError(
                f"{fpath}: {len(blob)} bytes, manifest says {entry['size']} (truncated or overwritten)"
            )
        if sha256_bytes(blob) != entry["sha256"]:
            why = _tensor_problem(name, blob, entry["tensors"]) if "tensors" in entry else "its SHA-256 differs"
            raise CheckpointError(f"{fpath}: corrupt: {why}")
        data[name] = blob
    if "state.json" in data:
        _check_state(path / "state.json", data["state.json"], manifest)
    for name, blob in data.items():
        if name.startswith("rank_") and name.endswith(".json"):
            _check_rank_json(path / name, blob)
    return Verified(path, manifest, data)


def _check_structure(mpath: Path, manifest: dict[str, Any]) -> None:
    """A manifest whose digest is right can still be malformed (written by hand, or by another tool): each
    field of the shape this samestep reads, and file names that stay inside the checkpoint."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{mpath}: 'files' is {type(files).__name__}, expected a table of the checkpoint's files")
    for key in ("step", "world_size"):
        if not isinstance(manifest.get(key), int) or isinstance(manifest.get(key), bool) or manifest[key] < 0:
            raise CheckpointError(f"{mpath}: {key!r} is {manifest.get(key)!r}, expected a non-negative integer")
    for name in ("model.safetensors", "optimizer.safetensors", "state.json"):
        if name not in files:
            raise CheckpointError(f"{mpath}: lists no {name!r}, which every checkpoint holds")
    for name, entry in files.items():
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise CheckpointError(f"{mpath}: file name {name!r} is not a plain name inside the checkpoint")
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and isinstance(entry.get("sha256"), str)
            and isinstance(entry.get("tensors", {}), dict)
        ):
            raise CheckpointError(f"{mpath}: the entry of {name!r} needs an integer 'size' and a 'sha256' string")


def _check_state(path: Path, data: bytes, manifest: dict[str, Any]) -> None:
    """state.json's fields that loading needs (its bytes already match the manifest), its step the manifest's,
    and every file its layout needs listed in the manifest (``_check_layout``): an intact checkpoint loads."""
    try:
        state = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: is {type(state).__name__}, expected a table")
    for key, kind in (("environment", dict), ("model_aliases", dict), ("step", int)):
        if not isinstance(state.get(key), kind):
            raise CheckpointError(f"{path}: {key!r} is {state.get(key)!r}, expected a {kind.__name__}")
    if state["step"] != manifest["step"]:
        raise CheckpointError(
            f"{path}: says step {state['step']}, the manifest {manifest['step']}: one of them was edited"
        )
    optimizer = state.get("optimizer", {})
    if not (
        isinstance(optimizer, dict)
        and isinstance(optimizer.get("state", {}), dict)
        and isinstance(optimizer.get("param_groups", []), list)
    ):
        raise CheckpointError(
            f"{path}: 'optimizer' is {json.dumps(optimizer)[:60]}, expected an optimizer's state "
            "dict (a table with a 'state' table and a 'param_groups' list)"
        )
    _check_layout(path, state, manifest)


def _check_layout(path: Path, state: dict[str, Any], manifest: dict[str, Any]) -> None:
    """Every file the checkpoint's own layout needs is in the manifest (whose entries are checked to be
    present): each writer's RNG files, each shard-writing rank's shard files (``state["shards"]``); and each
    model alias names a tensor the checkpoint holds."""
    files, world = manifest["files"], manifest["world_size"]
    shards = state.get("shards")
    model_names = set(files["model.safetensors"].get("tensors", {}))
    if shards is not None:
        count = shards.get("world_size") if isinstance(shards, dict) else None
        if not (
            isinstance(count, int)
            and not isinstance(count, bool)
            and 1 <= count <= max(world, 1)
            and all(isinstance(shards.get(part), dict) for part in ("model", "optimizer"))
        ):
            what = f"its world_size is {count!r}" if isinstance(shards, dict) else f"it is {json.dumps(shards)[:40]}"
            raise CheckpointError(
                f"{path}: 'shards' is not the layout of a sharded checkpoint ({what}): expected a "
                f"table with a 'world_size' from 1 to the manifest's {world} and 'model' and "
                "'optimizer' tables"
            )
        for part in ("model", "optimizer"):
            for name, info in shards[part].items():
                shape = info.get("shape") if isinstance(info, dict) else None
                if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
                    raise CheckpointError(
                        f"{path}: the shard layout of {name!r} is {json.dumps(info)[:80]}, "
                        "expected a table with a 'shape' list of sizes"
                    )
        model_names |= set(shards["model"])
    needed = [(r, name) for r in range(world) for name in rank_names(r)]
    needed += [(r, name) for r in range(shards["world_size"] if shards else 0) for name in shard_names(r)]
    for r, name in needed:
        if name not in files:
            raise CheckpointError(
                f"{path.parent / MANIFEST}: lists no {name!r}, which rank {r} of the "
                f"{world}-rank layout that wrote this checkpoint needs: a file was dropped; the "
                "checkpoint cannot be loaded"
            )
    for alias, target in state["model_aliases"].items():
        if not isinstance(target, str) or target not in model_names:
            raise CheckpointError(
                f"{path}: model alias {alias!r} -> {target!r} names no tensor of the checkpoint's model"
            )


def _check_rank_json(path: Path, data: bytes) -> None:
    """A rank's RNG metadata: a JSON table with the parts ``rng.restore_rng`` reads."""
    try:
        meta = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    kinds = (("python", dict), ("numpy", dict), ("cuda_devices", int), ("generators", list))
    bad = next((k for k, kind in kinds if not isinstance(meta, dict) or not isinstance(meta.get(k), kind)), None)
    if bad is not None:
        raise CheckpointError(
            f"{path}: is {json.dumps(meta)[:60]}, expected a rank's RNG state (a table with "
            f"{', '.join(repr(k) for k, _ in kinds)}; {bad!r} is not there as it should be)"
        )


def candidate_paths(path: Path) -> list[Path]:
    """The checkpoint directories to try, best first: every committed one, newest first. ``latest`` is
    not read: a crash between a commit and its update leaves it naming an older checkpoint, and a save
    moves later steps aside (save._supersede), so the newest committed step is the newest save."""
    if (path / MANIFEST).exists() or STEP_DIR.match(path.name):
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint or checkpoints directory")
    order = [p for _, p in committed_steps(path)]
    if not order:
        raise CheckpointError(f"{path}: holds no committed checkpoint (no step_NNNNNN directory)")
    return order


def verify_checkpoint(path: str | os.PathLike[str]) -> Path:
    """Checks every file and tensor digest of a checkpoint (a step directory, or the newest in a root).

    Returns:
        The checkpoint directory that was verified.

    Raises:
        CheckpointError: the file, tensor and problem (missing, truncated, flipped bits, edited manifest).
    """
    return verify(candidate_paths(Path(path))[0]).path


def first_intact(path: Path, fallback: bool) -> tuple[Verified, list[tuple[Path, str]]]:
    """The checkpoint to load: the best candidate, or with ``fallback`` the first intact one, and the
    corrupt ones skipped on the way (each with a warning)."""
    candidates = candidate_paths(path)
    skipped: list[tuple[Path, str]] = []
    for cand in candidates if fallback else candidates[:1]:
        try:
            return verify(cand), skipped
        except CheckpointError as e:
            if not fallback:
                raise
            skipped.append((cand, str(e)))
            warnings.warn(f"skipping corrupt checkpoint {cand}: {e}", RuntimeWarning, stacklevel=3)
    raise CheckpointError(f"{path}: no intact checkpoint; " + "; ".join(f"{p.name}: {w}" for p, w in skipped))

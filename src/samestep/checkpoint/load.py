"""``load_checkpoint`` and ``verify_checkpoint``: every byte checked before any state is touched."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
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
from samestep.determinism import rng as _rng
from samestep.determinism.env import compare_environments, environment, numerics_differences
from samestep.distributed.group import group_up
from samestep.hashing.state import sha256_tensor, unflatten
from samestep.records.durable import NotAFile, read_file

__all__ = ["LoadedCheckpoint", "checkpoint_state", "load_checkpoint", "shard_count", "verify_checkpoint"]


@dataclass(slots=True)
class LoadedCheckpoint:
    """What ``load_checkpoint`` restored, and what it had to skip to get there."""

    path: Path
    step: int
    world_size: int
    config: dict[str, Any] | None
    environment: dict[str, Any]
    env_diff: dict[str, tuple[Any, Any]]
    extra: Any = None
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    shards: int | None = None  # the ranks whose shards it holds (a sharded run's world size); None: whole tensors


@dataclass(slots=True)
class _Verified:
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


def _verify(path: Path, only: set[str] | None = None) -> _Verified:
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
        raise CheckpointError(f"{mpath}: format is {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                              f"expected {FORMAT!r}")
    if manifest.get("version") not in (VERSION, SHARDED_VERSION, SPLIT_VERSION, GRID_VERSION):
        raise CheckpointError(f"{mpath}: version {manifest.get('version')!r} is not supported (this samestep "
                              f"reads versions {VERSION} to {GRID_VERSION}); use the samestep release that wrote it")
    if manifest.get("manifest_sha256") != manifest_digest(manifest):
        raise CheckpointError(f"{mpath}: its contents do not match manifest_sha256; the manifest was edited "
                              "or damaged")
    _check_structure(mpath, manifest)
    named = STEP_DIR.match(path.name)
    if named and int(named.group(1)) != manifest["step"]:
        raise CheckpointError(f"{mpath}: says step {manifest['step']}, but it is {path.name}: the manifest was "
                              "edited, or the directory renamed")
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
            raise CheckpointError(str(e) if isinstance(e, NotAFile) else f"{fpath}: cannot be read ({e.strerror})") \
                from None
        if len(blob) != entry["size"]:
            raise CheckpointError(f"{fpath}: {len(blob)} bytes, manifest says {entry['size']} (truncated or "
                                  "overwritten)")
        if sha256_bytes(blob) != entry["sha256"]:
            why = _tensor_problem(name, blob, entry["tensors"]) if "tensors" in entry else "its SHA-256 differs"
            raise CheckpointError(f"{fpath}: corrupt: {why}")
        data[name] = blob
    if "state.json" in data:
        _check_state(path / "state.json", data["state.json"], manifest)
    for name, blob in data.items():
        if name.startswith("rank_") and name.endswith(".json"):
            _check_rank_json(path / name, blob)
    return _Verified(path, manifest, data)


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
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)
                and isinstance(entry.get("tensors", {}), dict)):
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
        raise CheckpointError(f"{path}: says step {state['step']}, the manifest {manifest['step']}: one of them was "
                              "edited")
    optimizer = state.get("optimizer", {})
    if not (isinstance(optimizer, dict) and isinstance(optimizer.get("state", {}), dict)
            and isinstance(optimizer.get("param_groups", []), list)):
        raise CheckpointError(f"{path}: 'optimizer' is {json.dumps(optimizer)[:60]}, expected an optimizer's state "
                              "dict (a table with a 'state' table and a 'param_groups' list)")
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
        if not (isinstance(count, int) and not isinstance(count, bool) and 1 <= count <= max(world, 1)
                and all(isinstance(shards.get(part), dict) for part in ("model", "optimizer"))):
            what = f"its world_size is {count!r}" if isinstance(shards, dict) else f"it is {json.dumps(shards)[:40]}"
            raise CheckpointError(f"{path}: 'shards' is not the layout of a sharded checkpoint ({what}): expected a "
                                  f"table with a 'world_size' from 1 to the manifest's {world} and 'model' and "
                                  "'optimizer' tables")
        for part in ("model", "optimizer"):
            for name, info in shards[part].items():
                shape = info.get("shape") if isinstance(info, dict) else None
                if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
                    raise CheckpointError(f"{path}: the shard layout of {name!r} is {json.dumps(info)[:80]}, "
                                          "expected a table with a 'shape' list of sizes")
        model_names |= set(shards["model"])
    needed = [(r, name) for r in range(world) for name in rank_names(r)]
    needed += [(r, name) for r in range(shards["world_size"] if shards else 0) for name in shard_names(r)]
    for r, name in needed:
        if name not in files:
            raise CheckpointError(f"{path.parent / MANIFEST}: lists no {name!r}, which rank {r} of the "
                                  f"{world}-rank layout that wrote this checkpoint needs: a file was dropped; the "
                                  "checkpoint cannot be loaded")
    for alias, target in state["model_aliases"].items():
        if not isinstance(target, str) or target not in model_names:
            raise CheckpointError(f"{path}: model alias {alias!r} -> {target!r} names no tensor of the checkpoint's "
                                  "model")


def _check_rank_json(path: Path, data: bytes) -> None:
    """A rank's RNG metadata: a JSON table with the parts ``rng.restore_rng`` reads."""
    try:
        meta = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    kinds = (("python", dict), ("numpy", dict), ("cuda_devices", int), ("generators", list))
    bad = next((k for k, kind in kinds if not isinstance(meta, dict) or not isinstance(meta.get(k), kind)), None)
    if bad is not None:
        raise CheckpointError(f"{path}: is {json.dumps(meta)[:60]}, expected a rank's RNG state (a table with "
                              f"{', '.join(repr(k) for k, _ in kinds)}; {bad!r} is not there as it should be)")


def _candidates(path: Path) -> list[Path]:
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
    return _verify(_candidates(Path(path))[0]).path


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    data_cursor: Any = None,
    fallback: bool = False,
    strict_env: bool = False,
    restore_rng: bool | str = True,
    generators: dict[str, torch.Generator] | None = None,
    check_config: Callable[[dict[str, Any] | None], None] | None = None,
) -> LoadedCheckpoint:
    """Verifies a checkpoint, then restores it into the given objects.

    Args:
        path: a step directory, or a checkpoints root (its newest committed checkpoint).
        model, optimizer, scheduler, data_cursor: restored in place from their saved ``state_dict()``.
        fallback: if the newest checkpoint is corrupt, warn and use the newest intact one.
        strict_env: an environment fingerprint that differs in a field that can change a bit
            (``env.numerics_differences``) is an error instead of a warning; ``env_diff`` records every field.
        restore_rng: restore this rank's python/numpy/torch/CUDA/registered generator states;
            ``"same_world_size"`` restores them only if the checkpoint was written by as many ranks as
            there are now (for loops whose training randomness is counter-keyed, like samestep train).
        generators: named generators to restore besides the registered ones.
        check_config: called with the saved config once the checkpoint is verified, before anything
            is restored; it raises to refuse a checkpoint written under another configuration.

    Returns:
        A ``LoadedCheckpoint`` with the step, config, environment differences and skipped checkpoints.

    Raises:
        CheckpointError: the checkpoint (every one, with ``fallback``) is corrupt or does not fit.
    """
    import torch.distributed as dist

    distributed = group_up()
    verified, skipped = _first_intact(Path(path), fallback)
    manifest, data = verified.manifest, verified.data
    state = json.loads(data["state.json"])
    if check_config is not None:
        check_config(state.get("config"))
    diff = _check_environment(verified.path, state["environment"], strict_env)
    opt_tensors = {**safetensors_load(data["optimizer.safetensors"]), **_unsharded(verified, state, "optimizer")}
    if model is not None:
        _load_model(verified, state, model)
    for obj, key in ((optimizer, "optimizer"), (scheduler, "scheduler"), (data_cursor, "data_cursor")):
        if obj is None:
            continue
        if key not in state:
            raise CheckpointError(f"{verified.path}: holds no {key} state, but a {key} was passed to load into")
        try:
            obj.load_state_dict(unflatten(state[key], opt_tensors))
        except (TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
            raise CheckpointError(f"{verified.path / 'state.json'}: its {key} state does not load into this run's "
                                  f"{key} ({type(e).__name__}: {e}); it was written by another program or "
                                  "edited") from None
    if restore_rng == "same_world_size":
        restore_rng = manifest["world_size"] == (dist.get_world_size() if distributed else 1)
    if restore_rng:
        _load_rng(verified, dist.get_rank() if distributed else 0, generators)
    extra = unflatten(state["extra"], opt_tensors) if "extra" in state else None
    return LoadedCheckpoint(path=verified.path, step=manifest["step"], world_size=manifest["world_size"],
                            config=state.get("config"), environment=state["environment"], env_diff=diff,
                            extra=extra, skipped=skipped,
                            shards=state["shards"]["world_size"] if state.get("shards") else None)


def checkpoint_state(path: str | os.PathLike[str], rank: int | None = None) -> dict[str, Any]:
    """A checkpoint's state as its writer's ``state_dict()`` calls returned it, rebuilt from its (verified)
    files alone, with nothing built or restored: ``{"model", "step"}`` and each of ``"optimizer"``,
    ``"scheduler"``, ``"data_cursor"`` it holds. Of a sharded checkpoint, ``rank``'s own shards in place of
    each sharded tensor (what that rank's DTensors held locally); else, or with ``rank`` None, whole tensors.
    What the run's receipts digest, to compare a checkpoint with them offline.

    Raises:
        CheckpointError: it is damaged, or holds no shards of ``rank``.
    """
    verified = _verify(_candidates(Path(path))[0])
    state = json.loads(verified.data["state.json"])
    if state.get("shards") and rank is not None:
        if rank >= state["shards"]["world_size"]:
            raise CheckpointError(f"{verified.path}: holds shards of {state['shards']['world_size']} rank(s), not of "
                                  f"rank {rank}")
        m_name, o_name = shard_names(rank)
        model = {**safetensors_load(verified.data["model.safetensors"]), **safetensors_load(verified.data[m_name])}
        tensors = {**safetensors_load(verified.data["optimizer.safetensors"]),
                   **safetensors_load(verified.data[o_name])}
    else:
        model = {**safetensors_load(verified.data["model.safetensors"]), **_unsharded(verified, state, "model")}
        tensors = {**safetensors_load(verified.data["optimizer.safetensors"]),
                   **_unsharded(verified, state, "optimizer")}
    for alias, target in state["model_aliases"].items():
        model[alias] = model[target]
    tree: dict[str, Any] = {"model": model, "step": verified.manifest["step"]}
    for key in ("optimizer", "scheduler", "data_cursor"):
        if key in state:
            tree[key] = unflatten(state[key], tensors)
    return tree


def shard_count(path: str | os.PathLike[str]) -> int | None:
    """How many ranks' shards a checkpoint holds (the world size of the sharded run that wrote it), or None
    where it holds whole tensors. Reads only its manifest and (checked against it) state.json.

    Raises:
        CheckpointError: either is damaged.
    """
    verified = _verify(_candidates(Path(path))[0], only={"state.json"})
    shards = json.loads(verified.data["state.json"]).get("shards")
    return shards["world_size"] if shards else None


def _first_intact(path: Path, fallback: bool) -> tuple[_Verified, list[tuple[Path, str]]]:
    """The checkpoint to load: the best candidate, or with ``fallback`` the first intact one, and the
    corrupt ones skipped on the way (each with a warning)."""
    candidates = _candidates(path)
    skipped: list[tuple[Path, str]] = []
    for cand in candidates if fallback else candidates[:1]:
        try:
            return _verify(cand), skipped
        except CheckpointError as e:
            if not fallback:
                raise
            skipped.append((cand, str(e)))
            warnings.warn(f"skipping corrupt checkpoint {cand}: {e}", RuntimeWarning, stacklevel=3)
    raise CheckpointError(f"{path}: no intact checkpoint; " + "; ".join(f"{p.name}: {w}" for p, w in skipped))


def _check_environment(path: Path, saved: dict[str, Any], strict: bool) -> dict[str, tuple[Any, Any]]:
    """The fields in which this environment differs from the saved one (all of them: the resume's record).
    Those that can change a bit (``env.numerics_differences``: not a launcher's thread variable under one
    pinned thread count, nor a rank's GPU binding or core count) are an error if ``strict``, else a warning."""
    now = environment()
    diff = compare_environments(saved, now)
    bits = numerics_differences(saved, now)
    if bits:
        fields = ", ".join(f"{k} ({a!r} -> {b!r})" for k, (a, b) in bits.items())
        msg = f"{path} was written in another environment; differing fields: {fields}"
        if strict:
            raise CheckpointError(msg + ". Bits may differ; pass strict_env=False to load anyway")
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return diff


def _unsharded(verified: _Verified, state: dict[str, Any], part: str) -> dict[str, torch.Tensor]:
    """The whole tensors of a sharded checkpoint's ``part`` ("model" or "optimizer"): each one's rows from
    every rank's shard file, in rank order (any world size then takes its own shards of them). Of version 4,
    each tensor rank's part first, from its data ranks' rows (rank = data rank x tensor ranks + tensor rank)."""
    shards = state.get("shards")
    if not shards:
        return {}
    index = 0 if part == "model" else 1
    world = shards["world_size"]
    files = [safetensors_load(verified.data[shard_names(r)[index]]) for r in range(world)]
    out = {}
    for name, info in shards[part].items():
        try:
            if "data" in info:
                data = len(info["data"])
                tensor = world // data
                held = [torch.cat([files[d * tensor + t][name] for d, (a, b) in enumerate(info["data"]) if b > a])
                        for t in range(tensor)]
            else:
                held = [f[name] for f in files]
            if "rows" not in info:  # whole on every tensor rank (version 4)
                whole = held[0]
            else:
                dim, parts = info.get("dim", 0), info.get("parts", 1)
                pieces = [h.chunk(parts, dim) for h, (a, b) in zip(held, info["rows"]) if b > a]
                whole = (torch.cat([torch.cat([p[i] for p in pieces], dim) for i in range(parts)], dim) if pieces
                         else torch.empty(0))
        except (KeyError, RuntimeError, ZeroDivisionError, TypeError, ValueError, IndexError) as e:
            raise CheckpointError(f"{verified.path}: the shards of {name!r} do not fit together ({e})") from None
        if list(whole.shape) != info["shape"]:
            raise CheckpointError(f"{verified.path}: the shards of {name!r} make shape {list(whole.shape)}, "
                                  f"state.json says {info['shape']}")
        out[name] = whole
    return out


def _load_model(verified: _Verified, state: dict[str, Any], model: torch.nn.Module) -> None:
    tensors = {**safetensors_load(verified.data["model.safetensors"]), **_unsharded(verified, state, "model")}
    for alias, target in state["model_aliases"].items():
        tensors[alias] = tensors[target]
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{verified.path / 'model.safetensors'}: does not fit the model: {e}") from None


def _load_rng(verified: _Verified, rank: int, generators: dict[str, torch.Generator] | None) -> None:
    t_name, j_name = rank_names(rank)
    if t_name not in verified.data:
        raise CheckpointError(
            f"{verified.path}: has no RNG state for rank {rank} (written by {verified.manifest['world_size']} "
            "rank(s)); resume with the same world size, or pass restore_rng=False when all "
            "randomness is counter-keyed (samestep train does this)")
    try:
        _rng.restore_rng(json.loads(verified.data[j_name]), safetensors_load(verified.data[t_name]), generators)
    except (TypeError, KeyError, IndexError, AttributeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{verified.path / j_name}: rank {rank}'s RNG state does not restore "
                              f"({type(e).__name__}: {e})") from None

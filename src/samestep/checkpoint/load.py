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
    CheckpointError,
    rank_names,
    shard_names,
)
from samestep.checkpoint.verify import Verified, candidate_paths, first_intact, verify
from samestep.determinism import rng as _rng
from samestep.determinism.env import compare_environments, environment, numerics_differences
from samestep.distributed.group import group_up
from samestep.hashing.state import unflatten

__all__ = ["LoadedCheckpoint", "checkpoint_state", "load_checkpoint", "shard_count"]


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
    verified, skipped = first_intact(Path(path), fallback)
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
            raise CheckpointError(
                f"{verified.path / 'state.json'}: its {key} state does not load into this run's "
                f"{key} ({type(e).__name__}: {e}); it was written by another program or "
                "edited"
            ) from None
    if restore_rng == "same_world_size":
        restore_rng = manifest["world_size"] == (dist.get_world_size() if distributed else 1)
    if restore_rng:
        _load_rng(verified, dist.get_rank() if distributed else 0, generators)
    extra = unflatten(state["extra"], opt_tensors) if "extra" in state else None
    return LoadedCheckpoint(
        path=verified.path,
        step=manifest["step"],
        world_size=manifest["world_size"],
        config=state.get("config"),
        environment=state["environment"],
        env_diff=diff,
        extra=extra,
        skipped=skipped,
        shards=state["shards"]["world_size"] if state.get("shards") else None,
    )


def checkpoint_state(path: str | os.PathLike[str], rank: int | None = None) -> dict[str, Any]:
    """A checkpoint's state as its writer's ``state_dict()`` calls returned it, rebuilt from its (verified)
    files alone, with nothing built or restored: ``{"model", "step"}`` and each of ``"optimizer"``,
    ``"scheduler"``, ``"data_cursor"`` it holds. Of a sharded checkpoint, ``rank``'s own shards in place of
    each sharded tensor (what that rank's DTensors held locally); else, or with ``rank`` None, whole tensors.
    What the run's receipts digest, to compare a checkpoint with them offline.

    Raises:
        CheckpointError: it is damaged, or holds no shards of ``rank``.
    """
    verified = verify(candidate_paths(Path(path))[0])
    state = json.loads(verified.data["state.json"])
    if state.get("shards") and rank is not None:
        if rank >= state["shards"]["world_size"]:
            raise CheckpointError(
                f"{verified.path}: holds shards of {state['shards']['world_size']} rank(s), not of rank {rank}"
            )
        m_name, o_name = shard_names(rank)
        model = {**safetensors_load(verified.data["model.safetensors"]), **safetensors_load(verified.data[m_name])}
        tensors = {
            **safetensors_load(verified.data["optimizer.safetensors"]),
            **safetensors_load(verified.data[o_name]),
        }
    else:
        model = {**safetensors_load(verified.data["model.safetensors"]), **_unsharded(verified, state, "model")}
        tensors = {
            **safetensors_load(verified.data["optimizer.safetensors"]),
            **_unsharded(verified, state, "optimizer"),
        }
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
    verified = verify(candidate_paths(Path(path))[0], only={"state.json"})
    shards = json.loads(verified.data["state.json"]).get("shards")
    return shards["world_size"] if shards else None


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


def _unsharded(verified: Verified, state: dict[str, Any], part: str) -> dict[str, torch.Tensor]:
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
                held = [
                    torch.cat([files[d * tensor + t][name] for d, (a, b) in enumerate(info["data"]) if b > a])
                    for t in range(tensor)
                ]
            else:
                held = [f[name] for f in files]
            if "rows" not in info:  # whole on every tensor rank (version 4)
                whole = held[0]
            else:
                dim, parts = info.get("dim", 0), info.get("parts", 1)
                pieces = [h.chunk(parts, dim) for h, (a, b) in zip(held, info["rows"]) if b > a]
                whole = (
                    torch.cat([torch.cat([p[i] for p in pieces], dim) for i in range(parts)], dim)
                    if pieces
                    else torch.empty(0)
                )
        except (KeyError, RuntimeError, ZeroDivisionError, TypeError, ValueError, IndexError) as e:
            raise CheckpointError(f"{verified.path}: the shards of {name!r} do not fit together ({e})") from None
        if list(whole.shape) != info["shape"]:
            raise CheckpointError(
                f"{verified.path}: the shards of {name!r} make shape {list(whole.shape)}, "
                f"state.json says {info['shape']}"
            )
        out[name] = whole
    return out


def _load_model(verified: Verified, state: dict[str, Any], model: torch.nn.Module) -> None:
    tensors = {**safetensors_load(verified.data["model.safetensors"]), **_unsharded(verified, state, "model")}
    for alias, target in state["model_aliases"].items():
        tensors[alias] = tensors[target]
    _refuse_other_dtypes(verified.path / "model.safetensors", tensors, model)
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{verified.path / 'model.safetensors'}: does not fit the model: {e}") from None


def _refuse_other_dtypes(path: Path, tensors: dict[str, torch.Tensor], model: Any) -> None:
    """Refuses a model whose parameters or buffers are of other dtypes than the checkpoint's tensors of the same
    names: ``load_state_dict`` would cast them, and the run go on from other bits than it saved (a model cast
    after samestep.Run started, ``model.double()``, saved in the new dtype and built in the old one here)."""
    module = model
    while not isinstance(module, torch.nn.Module) and hasattr(module, "model"):  # a loader of its shards or part
        module = module.model
    if not isinstance(module, torch.nn.Module):
        return
    own = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    for name, tensor in own.items():  # the model's own order: the first one named is the same every time
        if name in tensors and tensors[name].dtype != tensor.dtype:
            raise CheckpointError(
                f"{path}: holds {name!r} as {tensors[name].dtype}, but the model here has it as {tensor.dtype}: the "
                "model's dtypes are not those it was saved with (cast after samestep.Run started, as by "
                "model.double(), or built otherwise here). Fix: cast the model before samestep.Run, as when "
                "the run was saved"
            )


def _load_rng(verified: Verified, rank: int, generators: dict[str, torch.Generator] | None) -> None:
    t_name, j_name = rank_names(rank)
    if t_name not in verified.data:
        raise CheckpointError(
            f"{verified.path}: has no RNG state for rank {rank} (written by {verified.manifest['world_size']} "
            "rank(s)); resume with the same world size, or pass restore_rng=False when all "
            "randomness is counter-keyed (samestep train does this)"
        )
    try:
        _rng.restore_rng(json.loads(verified.data[j_name]), safetensors_load(verified.data[t_name]), generators)
    except (TypeError, KeyError, IndexError, AttributeError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"{verified.path / j_name}: rank {rank}'s RNG state does not restore ({type(e).__name__}: {e})"
        ) from None

"""What a checkpoint's files are made of, whole or in shards: its tensors written once each (a tied tensor named
once), each file's manifest entry, and the state skeletons the tensors are taken out of."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from samestep.checkpoint._format import (
    FORMAT,
    VERSION,
    sha256_bytes,
)
from samestep.hashing.state import flatten, sha256_tensor
from samestep.records.durable import write_durable

__all__ = ["file_entry", "skeletons", "unique_tensors", "write_tensors"]


def unique_tensors(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Stores each tensor once: safetensors refuses shared storage (e.g. tied embeddings)."""
    seen: dict[tuple, str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        t = t.detach()
        ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and ident in seen:
            aliases[name] = seen[ident]
            continue
        seen[ident] = name
        unique[name] = t.to("cpu").contiguous()
    return unique, aliases


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    data = safetensors_bytes(tensors, metadata={"format": FORMAT, "version": str(VERSION)})
    write_durable(path, data)
    return {
        "size": len(data),
        "sha256": sha256_bytes(data),
        "tensors": {k: sha256_tensor(v) for k, v in sorted(tensors.items())},
    }


def file_entry(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": sha256_bytes(data)}


def skeletons(
    optimizer: torch.optim.Optimizer | None,
    stateful: dict[str, Any],
    extra: dict[str, Any] | None,
    tensors: dict[str, Any],
) -> dict[str, Any]:
    """The JSON skeletons of the optimizer, ``stateful``'s objects and ``extra``, their tensors put in
    ``tensors`` by name."""
    out: dict[str, Any] = {}
    if optimizer is not None:
        out["optimizer"] = flatten(optimizer.state_dict(), "optimizer", tensors)
    for name, obj in stateful.items():
        if obj is not None:
            out[name] = flatten(obj.state_dict(), name, tensors)
    if extra is not None:
        out["extra"] = flatten(extra, "extra", tensors)
    return out

"""Randomness: counter-keyed draws, and complete capture/restore of every RNG a user loop may touch.

docs/design.md, invariant 1: every random draw is a pure function of (seed, step, global microbatch index,
purpose), never of the rank, the world size or how many draws another stream made before. Resume and
re-layout then need no RNG replay:

    g = samestep.rng.generator(seed, step, microbatch, "dropout")
    mask = torch.rand(shape, generator=g) >= p

A user loop that draws from the global generators all the same gets ``capture_rng()`` /
``restore_rng()``: python, numpy, torch CPU, every CUDA device, and registered ``torch.Generator`` s
(data loaders), per rank. The captured state is JSON plus tensors, so a checkpoint stores it without
pickle.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from typing import Any

import numpy as np
import torch

__all__ = [
    "capture_rng",
    "generator",
    "key",
    "positional_keep",
    "register_generator",
    "restore_rng",
    "unregister_generator",
]

_MASK63 = (1 << 63) - 1
_registered: dict[str, torch.Generator] = {}


def key(seed: int, step: int, microbatch: int, purpose: str) -> int:
    """The 63-bit seed of one random stream: a pure function of its four coordinates.

    Args:
        seed: the run's seed.
        step: the optimizer step (or another counter the purpose defines, e.g. the epoch).
        microbatch: the global microbatch index within the step (0..N-1), never a rank-local one.
        purpose: what the draws are for ("dropout", "init", "data-order"...), so streams never overlap.

    Returns:
        A non-negative integer below 2**63, usable as ``torch.Generator().manual_seed(...)``.
    """
    for name, value in (("seed", seed), ("step", step), ("microbatch", microbatch)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"rng.key: {name}={value!r} must be a non-negative integer")
    h = hashlib.blake2b(digest_size=8, person=b"samestep.rng.v1")
    h.update(struct.pack("<QQQ", seed, step, microbatch))
    h.update(purpose.encode("utf-8"))
    return int.from_bytes(h.digest(), "little") & _MASK63


def generator(
    seed: int, step: int, microbatch: int, purpose: str, device: str | torch.device = "cpu"
) -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded with ``key(seed, step, microbatch, purpose)``."""
    g = torch.Generator(device=device)
    g.manual_seed(key(seed, step, microbatch, purpose))
    return g


_M32 = 0xFFFFFFFF


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of ``x``, in place in its int32 lanes: products wrap
    modulo 2**32 on every device and a right shift is made logical by masking what the sign spread, so the bits
    are those of the same hash over unsigned 32-bit values (``tests/unit/test_rng.py`` holds it to an int64
    reference)."""
    for _ in range(2):
        x.bitwise_xor_((x >> 16).bitwise_and_(0xFFFF)).mul_(0x45D9F3B)
    return x.bitwise_xor_((x >> 16).bitwise_and_(0xFFFF))


def _int32(value: int) -> int:
    """An unsigned 32-bit value as the int32 of the same bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


def positional_keep(
    stream_key: int,
    global_shape: tuple[int, ...],
    starts: tuple[int, ...],
    local_shape: tuple[int, ...],
    p: float,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """The keep-mask of dropout with probability ``p`` over the block ``local_shape`` at ``starts`` of a
    tensor of ``global_shape``: an element is kept by a hash of ``stream_key`` (``key(...)``) and its flat
    position in the whole tensor alone, so however the tensor is split (heads over tensor-parallel ranks,
    a sequence over sequence-parallel ones) each rank draws its block of the one whole mask.

    Raises:
        ValueError: a block that does not lie inside the tensor, or ``p`` outside [0, 1).
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"rng.positional_keep: p={p!r} must be in [0, 1)")
    if not (len(global_shape) == len(starts) == len(local_shape)) or any(
        s < 0 or s + n > g for g, s, n in zip(global_shape, starts, local_shape)
    ):
        raise ValueError(
            f"rng.positional_keep: block {tuple(local_shape)} at {tuple(starts)} does not lie inside "
            f"a tensor of shape {tuple(global_shape)}"
        )
    lo, hi = _int32(stream_key & _M32), _int32((stream_key >> 32) & _M32)
    if math.prod(global_shape) <= 1 << 31:  # every position below 2**31: its high half 0, its low half int32's
        h = _mix32_(
            _mix32_(_positions(global_shape, starts, local_shape, torch.int32, device).bitwise_xor_(lo)).bitwise_xor_(
                hi
            )
        )
    else:
        flat = _positions(global_shape, starts, local_shape, torch.int64, device)
        h = _mix32_(
            _mix32_(flat.to(torch.int32).bitwise_xor_(lo)).bitwise_xor_((flat >> 32).to(torch.int32)).bitwise_xor_(hi)
        )  # to(int32): the low bits
    # unsigned h >= t, compared as signed: both moved by 2**31
    return h.bitwise_xor_(torch.iinfo(torch.int32).min) >= int(p * 2**32) - (1 << 31)


def _positions(
    global_shape: tuple[int, ...],
    starts: tuple[int, ...],
    local_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: str | torch.device,
) -> torch.Tensor:
    """Each element's flat position in the whole tensor, over the block ``local_shape`` at ``starts``, in
    ``dtype`` (one that holds the last position)."""
    flat = torch.zeros((), dtype=dtype, device=device)
    stride = 1
    for d in reversed(range(len(global_shape))):
        pos = torch.arange(starts[d], starts[d] + local_shape[d], dtype=dtype, device=device) * stride
        flat = flat + pos.view(-1, *([1] * (len(global_shape) - 1 - d)))
        stride *= global_shape[d]
    return flat  # a new tensor of its own (the sums above make one), which the hash changes in place


def register_generator(name: str, gen: torch.Generator) -> None:
    """Includes ``gen`` (e.g. a DataLoader's generator) in every ``capture_rng()`` under ``name``."""
    _registered[name] = gen


def unregister_generator(name: str) -> None:
    """Stops capturing the generator registered as ``name``."""
    _registered.pop(name, None)


def capture_rng(generators: dict[str, torch.Generator] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Captures every RNG state of this process.

    Args:
        generators: extra named generators, on top of the registered ones.

    Returns:
        ``(meta, tensors)``: JSON-able metadata and the state tensors, to be stored per rank.
    """
    gens = {**_registered, **(generators or {})}
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    meta: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached).hex()},
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0,
        "generators": sorted(gens),
    }
    tensors: dict[str, torch.Tensor] = {
        "torch.cpu": torch.get_rng_state(),
        "numpy.keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
    }
    for i in range(meta["cuda_devices"]):
        tensors[f"torch.cuda.{i}"] = torch.cuda.get_rng_state(i)
    for name, g in gens.items():
        tensors[f"generator.{name}"] = g.get_state()
    return meta, tensors


def restore_rng(
    meta: dict[str, Any], tensors: dict[str, torch.Tensor], generators: dict[str, torch.Generator] | None = None
) -> None:
    """Restores what ``capture_rng()`` captured.

    Raises:
        ValueError: a captured generator or CUDA device has no counterpart here (names it).
    """
    gens = {**_registered, **(generators or {})}
    py = meta["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npm = meta["numpy"]
    np.random.set_state(
        (
            npm["kind"],
            tensors["numpy.keys"].numpy().astype(np.uint32),
            npm["pos"],
            npm["has_gauss"],
            float.fromhex(npm["cached_gaussian"]),
        )
    )
    torch.set_rng_state(tensors["torch.cpu"])
    n_cuda = meta["cuda_devices"]
    if n_cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() < n_cuda:
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise ValueError(
                f"RNG state holds {n_cuda} CUDA device(s) but this process sees {have}; "
                "resume with the same CUDA_VISIBLE_DEVICES"
            )
        for i in range(n_cuda):
            torch.cuda.set_rng_state(tensors[f"torch.cuda.{i}"], i)
    for name in meta["generators"]:
        if name not in gens:
            raise ValueError(
                f"RNG state holds generator {name!r}, which is not registered here; "
                f"call samestep.rng.register_generator({name!r}, gen) before loading"
            )
        gens[name].set_state(tensors[f"generator.{name}"])

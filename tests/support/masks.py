"""The positional dropout mask's definition over unsigned 32-bit values held in int64, every product below
2**59: the reference ``samestep.rng.positional_keep`` (int32 lanes) is held to bit for bit
(tests/unit/test_rng.py), and bench/bench_mask.py times it against."""

from __future__ import annotations

import torch

__all__ = ["keep_by_int64"]

M32 = 0xFFFFFFFF


def keep_by_int64(stream_key: int, flat: torch.Tensor, p: float) -> torch.Tensor:
    """The mask's definition at flat positions ``flat`` (int64): every product below 2**59."""

    def mix(x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = ((x >> 16) ^ x) * 0x45D9F3B & M32
        return (x >> 16) ^ x

    lo, hi = stream_key & M32, (stream_key >> 32) & M32
    return mix(mix((flat & M32) ^ lo) ^ (flat >> 32) ^ hi) >= int(p * 2**32)

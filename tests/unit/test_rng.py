"""Counter-keyed randomness and complete RNG capture/restore."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from samestep import capture_rng, restore_rng
from samestep.determinism import rng
from tests.support.masks import keep_by_int64


def test_key_is_a_pure_function_of_its_coordinates():
    """The same coordinates give the same key; changing any one coordinate changes it."""
    base = rng.key(7, 3, 2, "dropout")
    assert base == rng.key(7, 3, 2, "dropout")
    others = {
        rng.key(8, 3, 2, "dropout"),
        rng.key(7, 4, 2, "dropout"),
        rng.key(7, 3, 1, "dropout"),
        rng.key(7, 3, 2, "init"),
        rng.key(7, 2, 3, "dropout"),
    }
    assert base not in others and len(others) == 5
    assert 0 <= base < 2**63


def test_keyed_generator_draws_repeat_bitwise():
    """Two generators with one key draw identical bits; another microbatch draws different bits."""
    a = torch.rand(1000, generator=rng.generator(1, 5, 3, "dropout"))
    b = torch.rand(1000, generator=rng.generator(1, 5, 3, "dropout"))
    c = torch.rand(1000, generator=rng.generator(1, 5, 4, "dropout"))
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert not torch.equal(a.view(torch.int32), c.view(torch.int32))


def test_key_rejects_negative_coordinates():
    """Keys are defined for non-negative counters only."""
    with pytest.raises(ValueError, match="step=-1"):
        rng.key(0, -1, 0, "x")


def _draw(loader_gen: torch.Generator) -> tuple:
    return (
        random.random(),
        random.gauss(0, 1),
        float(np.random.rand()),
        np.random.randn(3).tolist(),
        torch.rand(4).tolist(),
        torch.randperm(10, generator=loader_gen).tolist(),
    )


def test_capture_restore_round_trip_and_negative_control():
    """After restore every stream repeats bit for bit; without restore the next draws differ."""
    loader = torch.Generator().manual_seed(3)
    rng.register_generator("loader", loader)
    try:
        random.seed(1), np.random.seed(1), torch.manual_seed(1)
        random.gauss(0, 1)  # leaves a cached gaussian in python's state
        meta, tensors = capture_rng()
        first = _draw(loader)
        second = _draw(loader)  # negative control: no restore, the streams moved on
        restore_rng(meta, tensors)
        again = _draw(loader)
    finally:
        rng.unregister_generator("loader")
    assert again == first
    assert second != first


def test_restore_names_an_unregistered_generator():
    """A captured generator with no counterpart at restore time is named in the error."""
    meta, tensors = capture_rng({"sampler": torch.Generator().manual_seed(0)})
    with pytest.raises(ValueError, match="'sampler'"):
        restore_rng(meta, tensors)


def test_a_positional_dropout_mask_does_not_depend_on_how_the_tensor_is_split():
    """positional_keep: the mask of a (2, 8, 16, 16) attention tensor split over 2 or 4 ranks by heads (dim 1),
    or over a sequence (dim 2), is the whole tensor's mask, block for block, bit for bit; it keeps about
    1 - p, and another stream key draws another mask. Negative control: each block drawn from the same keyed
    generator (the usual way, a draw per tensor) is not the whole tensor's block."""
    shape, p, k = (2, 8, 16, 16), 0.25, rng.key(0, 3, 5, "dropout")
    whole = rng.positional_keep(k, shape, (0, 0, 0, 0), shape, p)
    assert whole.shape == shape and abs(whole.float().mean().item() - (1 - p)) < 0.02
    for dim in (1, 2):
        for ranks in (2, 4):
            n = shape[dim] // ranks
            for r in range(ranks):
                starts = tuple(r * n if d == dim else 0 for d in range(4))
                local = tuple(n if d == dim else s for d, s in enumerate(shape))
                block = rng.positional_keep(k, shape, starts, local, p)
                assert torch.equal(block, whole.narrow(dim, r * n, n)), (dim, ranks, r)
    assert not torch.equal(rng.positional_keep(rng.key(0, 3, 6, "dropout"), shape, (0,) * 4, shape, p), whole)
    drawn = torch.rand(shape, generator=rng.generator(0, 3, 5, "dropout")) >= p
    second = torch.rand((2, 4, 16, 16), generator=rng.generator(0, 3, 5, "dropout")) >= p  # rank 1 of 2's own draw
    assert not torch.equal(drawn.narrow(1, 4, 4), second)


def test_a_positional_mask_outside_its_tensor_or_of_a_bad_probability_is_refused():
    """A block past the tensor's end and p = 1 are refused, naming the values. Negative control: the last
    block that fits is drawn."""
    rng.positional_keep(1, (4, 4), (2, 0), (2, 4), 0.5)
    with pytest.raises(ValueError, match=r"block \(3, 4\) at \(2, 0\) does not lie inside a tensor of shape \(4, 4\)"):
        rng.positional_keep(1, (4, 4), (2, 0), (3, 4), 0.5)
    with pytest.raises(ValueError, match=r"p=1.0 must be in \[0, 1\)"):
        rng.positional_keep(1, (4, 4), (0, 0), (4, 4), 1.0)


def test_the_positional_mask_in_int32_lanes_is_its_int64_definition_bit_for_bit():
    """positional_keep hashes in int32 lanes (wrapping products, logical shifts by masking): for stream keys with
    the top bits of either half set or clear, positions past 2**32 (a block far into a large tensor), and p at
    0, the ends and between, every element is the int64 definition's (``tests/support/masks.py``'s, which
    bench/bench_mask.py times against); so it is for a tensor whose positions all fit int32 lanes, hashed from
    int32 positions. Negative
    control: the same comparison with a plain arithmetic shift in place of the logical one (the sign spread left
    unmasked) differs."""
    shape = (1, 3, 1 << 31)  # positions up to 2**32 + 2**31; the block at the end past 2**32
    starts, local = (0, 2, (1 << 31) - 4096), (1, 1, 4096)
    flat = (torch.arange(4096, dtype=torch.int64) + 2 * (1 << 31) + starts[2]).view(local)
    for key in (0, 7, 0xFFFFFFFFFFFFFFFF, 0x8000000080000000, rng.key(0, 3, 5, "dropout")):
        for p in (0.0, 0.1, 0.5, 0.9, 0.999):
            assert torch.equal(rng.positional_keep(key, shape, starts, local, p), keep_by_int64(key, flat, p)), (
                hex(key),
                p,
            )

    def arithmetic(x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = ((x >> 16) ^ x) * 0x45D9F3B
        return (x >> 16) ^ x

    small, block = (2, 8, 16, 16), (2, 4, 16, 16)  # every position below 2**31: hashed as int32 positions
    positions = torch.arange(2 * 8 * 16 * 16, dtype=torch.int64).view(small)[:, 4:]
    for key in (0, 0xFFFFFFFFFFFFFFFF, rng.key(0, 3, 5, "dropout")):
        assert torch.equal(
            rng.positional_keep(key, small, (0, 4, 0, 0), block, 0.25), keep_by_int64(key, positions, 0.25)
        ), hex(key)

    key = 0x8000000080000000
    h = arithmetic(arithmetic(flat.to(torch.int32) ^ -(1 << 31)) ^ (flat >> 32).to(torch.int32) ^ -(1 << 31))
    assert not torch.equal(
        (h ^ torch.iinfo(torch.int32).min) >= int(0.5 * 2**32) - (1 << 31), keep_by_int64(key, flat, 0.5)
    )


def test_the_positional_mask_of_any_block_is_its_definition_at_the_blocks_positions():
    """Blocks of tensors of 1 to 4 dimensions, at random places (the whole tensor, blocks whose trailing
    dimensions are whole, and blocks that cut every dimension): each element is the int64 definition's at its
    flat position in the whole tensor, read off an index tensor. Negative control: the positions of a block as
    if it began the tensor give another mask."""
    r = random.Random(7)
    for case in range(60):
        shape = tuple(r.choice((1, 2, 3, 5, 8)) for _ in range(r.randint(1, 4)))
        whole = case % 3 == 0
        starts = tuple(0 if whole or (case % 3 == 1 and d > 0) else r.randrange(n) for d, n in enumerate(shape))
        local = tuple(
            n - s if whole or (case % 3 == 1 and d > 0) else r.randint(1, n - s)
            for d, (n, s) in enumerate(zip(shape, starts))
        )
        index = torch.arange(math.prod(shape), dtype=torch.int64).view(shape)
        flat = index[tuple(slice(s, s + n) for s, n in zip(starts, local))]
        key = r.getrandbits(64)
        got = rng.positional_keep(key, shape, starts, local, 0.5)
        assert got.shape == local and torch.equal(got, keep_by_int64(key, flat, 0.5)), (shape, starts, local)
    shape, starts, local = (4, 8, 16), (2, 0, 0), (2, 8, 16)
    key = rng.key(0, 1, 2, "dropout")
    moved = keep_by_int64(key, torch.arange(2 * 8 * 16, dtype=torch.int64).view(local), 0.5)
    assert not torch.equal(rng.positional_keep(key, shape, starts, local, 0.5), moved)

"""State trees as JSON plus tensors: exact, pickle-free round trips."""

from __future__ import annotations

import math

import torch

from samestep._state import flatten, state_digest, unflatten


def test_round_trip_keeps_types_and_bits():
    """Int keys, tuples, None, bools and every float (nan, inf, -0.0, subnormal) survive exactly."""
    tree = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3)}},
            "param_groups": [{"betas": (0.9, 0.95), "lr": 0.1, "amsgrad": False, "foreach": None,
                              "params": [0], "x": [float("inf"), -0.0, 5e-324, float("nan")]}]}
    tensors: dict = {}
    back = unflatten(flatten(tree, "opt", tensors), tensors)
    assert list(back["state"]) == [0] and back["param_groups"][0]["betas"] == (0.9, 0.95)
    xs = back["param_groups"][0]["x"]
    assert xs[0] == float("inf") and math.copysign(1, xs[1]) == -1 and xs[2] == 5e-324 and math.isnan(xs[3])
    assert torch.equal(back["state"][0]["exp_avg"], tree["state"][0]["exp_avg"])


def test_state_digest_sees_one_bit_and_structure():
    """Flipping one bit, changing a dtype or a non-tensor value changes the digest; equal trees agree."""
    t = torch.arange(10, dtype=torch.float32)
    base = state_digest({"a": t, "n": 1})
    assert base == state_digest({"a": t.clone(), "n": 1})
    flipped = t.clone()
    flipped.view(torch.int32)[3] ^= 1
    assert base != state_digest({"a": flipped, "n": 1})
    assert base != state_digest({"a": t.double(), "n": 1})
    assert base != state_digest({"a": t, "n": 2})
    zero, negzero = torch.tensor([0.0]), torch.tensor([-0.0])
    assert state_digest(zero) != state_digest(negzero)

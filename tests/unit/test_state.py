"""State trees as JSON plus tensors: exact, pickle-free round trips."""

from __future__ import annotations

import math

import torch

from samestep.hashing.state import flatten, state_digest, unflatten


def test_round_trip_keeps_types_and_bits():
    """Int keys, tuples, None, bools and every float (nan, inf, -0.0, subnormal) survive exactly."""
    tree = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3)}},
        "param_groups": [
            {
                "betas": (0.9, 0.95),
                "lr": 0.1,
                "amsgrad": False,
                "foreach": None,
                "params": [0],
                "x": [float("inf"), -0.0, 5e-324, float("nan")],
            }
        ],
    }
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


def test_tensor_bytes_are_the_row_major_bytes_of_every_kind_of_tensor():
    """``tensor_bytes`` (a NumPy view where it can, the general path where it cannot) gives each tensor's
    values in row-major order, as a copy made element by element does: contiguous, transposed, sliced,
    strided, expanded, 0-d, empty, requiring grad, negated, bf16, fp16, complex, bool, int. Negative
    control: the same comparison tells a transposed tensor's bytes from its storage's."""
    from samestep.hashing.state import tensor_bytes

    def row_major(t: torch.Tensor) -> bytes:  # one element at a time, through a copy
        flat = t.detach().clone().contiguous().reshape(-1)
        return b"".join(bytes(x.view(torch.uint8).tolist()) for x in flat.reshape(-1, 1)) if flat.numel() else b""

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g)
    kinds = [
        x,
        x.t(),
        x[1:, 1:3],
        x[:, ::2],
        torch.randn(2, 3, generator=g).expand(4, 2, 3),
        torch.tensor(2.5),
        torch.zeros(0, 3),
        torch.randn(5, generator=g, requires_grad=True),
        torch.randn(3, generator=g).neg(),
        torch.randn(4, generator=g).bfloat16(),
        torch.randn(3, generator=g).half(),
        torch.randn(3, dtype=torch.complex64, generator=g),
        torch.tensor([True, False]),
        torch.arange(6).reshape(2, 3),
        torch.tensor(7, dtype=torch.uint8),
    ]
    for t in kinds:
        view = tensor_bytes(t)
        assert isinstance(view, memoryview) and view.format == "B" and bytes(view) == row_major(t), (t.dtype, t.shape)
    storage = bytes(x.view(torch.uint8).reshape(-1).tolist())
    assert bytes(tensor_bytes(x.t())) != storage == bytes(tensor_bytes(x))

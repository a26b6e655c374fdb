"""The environment fingerprint and its comparison."""

from __future__ import annotations

import json
import os

import torch

import samestep


def test_fingerprint_holds_the_contract_fields_and_is_json():
    """The fingerprint names Python, torch, BLAS, CPU, threads, determinism settings and env vars."""
    env = samestep.environment()
    for key in (
        "python.version",
        "torch.version",
        "torch.blas",
        "torch.cpu_capability",
        "cpu.model",
        "threads.intra_op",
        "determinism.algorithms",
        "env.NCCL_ALGO",
        "cuda.version",
        "platform.system",
    ):
        assert key in env, key
    assert env["torch.version"] == torch.__version__
    assert json.loads(json.dumps(env)) == env


def test_fingerprint_is_stable_and_compare_finds_nothing():
    """Two fingerprints of an unchanged process are equal (negative side of the comparison)."""
    assert samestep.compare_environments(samestep.environment(), samestep.environment()) == {}


def test_compare_names_every_differing_field():
    """A thread-count change, a changed env var and a field present on one side only are all named."""
    before = samestep.environment()
    torch.set_num_threads(1 if torch.get_num_threads() != 1 else 2)
    algo = "Ring" if before["env.NCCL_ALGO"] != "Ring" else "Tree"
    os.environ["NCCL_ALGO"] = algo
    after = samestep.environment()
    after["gpu.extra"] = "H200"
    diff = samestep.compare_environments(before, after)
    assert set(diff) == {"threads.intra_op", "env.NCCL_ALGO", "gpu.extra"}
    assert diff["env.NCCL_ALGO"] == (before["env.NCCL_ALGO"], algo)
    assert diff["gpu.extra"] == (None, "H200")


def test_thread_variables_change_no_bit_under_one_pinned_thread_count():
    """A 1-process run and a torchrun one (whose launcher sets OMP_NUM_THREADS) under one pinned intra-op
    thread count differ in nothing that changes a bit, nor in the fields that differ between the processes
    of one job; control: under other thread counts the variables are named with the count."""
    from samestep.determinism.env import numerics_differences

    a = samestep.environment()
    b = {**a, "env.OMP_NUM_THREADS": "1", "env.MKL_NUM_THREADS": "1", "cpu.count": 96}
    a = {**a, "env.OMP_NUM_THREADS": None, "env.MKL_NUM_THREADS": None}
    assert numerics_differences(a, b) == {}
    assert set(samestep.compare_environments(a, b)) == {"env.OMP_NUM_THREADS", "env.MKL_NUM_THREADS", "cpu.count"}
    b["threads.intra_op"] = a["threads.intra_op"] + 1
    assert set(numerics_differences(a, b)) == {"env.OMP_NUM_THREADS", "env.MKL_NUM_THREADS", "threads.intra_op"}

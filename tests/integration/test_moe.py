"""The reference model's MoE layer: its plain combine races on this CPU; deterministic mode repeats."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import train_here

pytestmark = pytest.mark.slow

# top-3: with two contributions per token into zeros, any order gives the same bits (a + b == b + a);
# three contributions make the order visible.
MOE = ("train.device=cpu", "train.steps=3", "train.global_batch=16", "train.micro_batch=8", "model.n_layer=1",
       "model.n_head=2", "model.n_embd=64", "model.block_size=64", "model.moe_experts=4", "model.moe_top_k=3")


def test_moe_plain_races_and_deterministic_mode_repeats(tmp_path):
    """Determinism off: the index_put_ combine makes runs differ (real race). On: two runs are identical."""
    torch.set_num_threads(2)  # determinism off leaves the thread count as it finds it
    off = {train_here(tmp_path / f"off{i}", *MOE, "determinism.enabled=false")["state_digest"] for i in range(3)}
    assert len(off) > 1, "three MoE runs with a racing combine all agreed"
    on = [train_here(tmp_path / f"on{i}", *MOE, "determinism.threads=2")["state_digest"] for i in range(2)]
    assert on[0] == on[1]

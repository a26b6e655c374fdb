"""The reference models' MoE layer: its plain combine races on this CPU; deterministic mode repeats; a Llama's
experts give one process's bits on data ranks and at TP 2 (and, activated over a rank's whole part, would not)."""

from __future__ import annotations

import pytest
import torch

from tests.support import metrics_bytes, train_here, train_ranks

pytestmark = pytest.mark.slow

# top-3: with two contributions per token into zeros, any order gives the same bits (a + b == b + a);
# three contributions make the order visible.
MOE = (
    "train.device=cpu",
    "train.steps=3",
    "train.global_batch=16",
    "train.micro_batch=8",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=64",
    "model.block_size=64",
    "model.moe_experts=4",
    "model.moe_top_k=3",
)


def test_moe_plain_races_and_deterministic_mode_repeats(tmp_path):
    """Determinism off: the index_put_ combine makes runs differ (real race). On: two runs are identical."""
    torch.set_num_threads(2)  # determinism off leaves the thread count as it finds it
    off = {train_here(tmp_path / f"off{i}", *MOE, "determinism.enabled=false")["state_digest"] for i in range(3)}
    assert len(off) > 1, "three MoE runs with a racing combine all agreed"
    on = [train_here(tmp_path / f"on{i}", *MOE, "determinism.threads=2")["state_digest"] for i in range(2)]
    assert on[0] == on[1]


# A Llama whose SwiGLU experts get uneven row counts (top-2 of 4 over 64 tokens), 40 wide (8 chunks of 5): at
# TP 2 a rank's part of an expert's activation is 20 wide, so its element count leaves a vectorized kernel's
# scalar tail on other elements than the whole's, with 8- and 16-float vectors alike (AVX2, AVX-512)
LLAMA = (
    "train.device=cpu",
    "train.steps=3",
    "train.global_batch=8",
    "train.micro_batch=2",
    "train.warmup_steps=2",
    "model.arch=llama",
    "model.n_layer=2",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "model.dropout=0.1",
    "model.moe_experts=4",
    "model.moe_top_k=2",
    "model.mlp_hidden=40",
)


def test_a_llama_moe_gives_the_one_process_bits_on_2_data_ranks_and_at_tp_2(tmp_path):
    """A Llama with routed SwiGLU experts: on 2 data ranks the one process's final digest and metrics.jsonl; with
    parallel.tp_chunks=8, TP 2 the one process's of the same chunks (each expert split like the dense MLP)."""
    one, two = train_here(tmp_path / "one", *LLAMA), train_ranks(tmp_path / "two", *LLAMA, nproc=2)
    assert one["state_digest"] == two["state_digest"]
    assert metrics_bytes(tmp_path / "one") == metrics_bytes(tmp_path / "two")
    tp = (*LLAMA, "parallel.tp_chunks=8")
    tp1, tp2 = train_here(tmp_path / "tp1", *tp), train_ranks(tmp_path / "tp2", *tp, "parallel.tp=2", nproc=2)
    assert tp1["state_digest"] == tp2["state_digest"]
    assert metrics_bytes(tmp_path / "tp1") == metrics_bytes(tmp_path / "tp2")


def _activation_whole() -> None:
    """The experts' activation on a rank's whole part (PyTorch's way), not chunk by chunk."""
    from samestep.train import llama

    llama.chunkwise = lambda fn, x, width: fn(x)


def test_an_activation_on_a_ranks_whole_part_gives_other_bits_at_tp_2(tmp_path):
    """Negative control of model.chunkwise: the SwiGLU experts' activation over each rank's whole part puts the
    kernel's scalar tail on other elements at TP 2 than on one process, and the final state differs."""
    tp = (*LLAMA, "parallel.tp_chunks=8")
    one = train_ranks(tmp_path / "tp1", *tp, nproc=1, patch=_activation_whole)
    two = train_ranks(tmp_path / "tp2", *tp, "parallel.tp=2", nproc=2, patch=_activation_whole)
    assert one["state_digest"] != two["state_digest"]

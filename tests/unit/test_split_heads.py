"""A tensor-parallel split must give each rank whole attention heads (distributed/placement.py,
``refuse_split_heads``): 2 kv heads at TP 4 is refused by name before a step, where transformers would fail
inside its attention (``shape '[1, 32, -1, 8]' is invalid``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from samestep.distributed.placement import refuse_split_heads
from samestep.exit_codes import Refusal
from tests.support import spawn


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return LlamaForCausalLM(config)


def _split(model: torch.nn.Module, degree: int) -> None:
    """The marks the canonical styles leave (``tp_styles._style_apply``) on a Llama's attention at ``degree``."""
    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(attn, name).samestep_tp_split = (degree, 0, 1)
        attn.o_proj.samestep_tp_split = (degree, 1, 1)


def test_two_kv_heads_at_tp_4_are_refused_naming_the_projection_and_the_fix():
    """Negative control: TP 2 (a whole kv head a rank) and no split at all pass."""
    model = _llama()
    refuse_split_heads(model)
    _split(model, 2)
    refuse_split_heads(model)
    _split(model, 4)
    with pytest.raises(Refusal) as refused:
        refuse_split_heads(model)
    said = str(refused.value)
    assert said.startswith("model.layers.0.self_attn.k_proj: 2 heads of 8 split over tensor-parallel degree 4")
    assert "a tensor-parallel degree that divides 2" in said and "\n" not in said


def _mark(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from samestep.distributed import CanonicalColwiseParallel, CanonicalRowwiseParallel

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=1)
    try:
        model = _llama()
        mesh = init_device_mesh("cpu", (1,))
        col, row = CanonicalColwiseParallel(2), CanonicalRowwiseParallel(2)
        parallelize_module(model.model.layers[0].self_attn, mesh, {"k_proj": col, "o_proj": row})
        attn = model.model.layers[0].self_attn
        Path(out).write_text(json.dumps([attn.k_proj.samestep_tp_split, attn.o_proj.samestep_tp_split]))
    finally:
        dist.destroy_process_group()


def test_the_canonical_styles_leave_how_they_split_a_layer(tmp_path):
    """(degree, the weight's split dimension, fused parts) on each layer a canonical style shards."""
    spawn(_mark, (str(tmp_path / "init"), str(tmp_path / "out.json")), 1)
    assert json.loads((tmp_path / "out.json").read_text()) == [[1, 0, 1], [1, 1, 1]]

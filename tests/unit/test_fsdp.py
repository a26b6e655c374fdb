"""shard_model: FSDP2 groups of a model of any class (samestep.distributed.fsdp)."""

from __future__ import annotations

import pytest
import torch

from samestep.distributed import shard_model
from tests.conftest import spawn


class Layer(torch.nn.Module):
    """A block of a model samestep did not write (its class not named ``Block``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(8, 4), Layer(), Layer(), torch.nn.Linear(4, 8))


def _groups(rank: int, init: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=1)
    try:
        model = shard_model(_model(), 1, blocks=Layer)
        assert [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)] == [
            "FSDPSequential", "FSDPLayer", "FSDPLayer"]
        # control: by default only a class named Block is a group, so the root holds every parameter
        plain = shard_model(_model(), 1)
        assert [m for m in plain.modules() if isinstance(m, FSDPModule)] == [plain]
    finally:
        dist.destroy_process_group()


def test_shard_model_makes_a_group_of_each_block_of_the_class_given(tmp_path):
    spawn(_groups, (str(tmp_path / "init"),), 1)


def test_shard_model_refuses_blocks_it_cannot_find_by_name():
    with pytest.raises(ValueError, match=r"holds no such module; pass the class of its blocks .*'Layer'"):
        shard_model(_model(), 1, blocks=torch.nn.GRU)
    with pytest.raises(TypeError, match="a module class or a tuple of them"):
        shard_model(_model(), 1, blocks="Layer")

"""shard_model: FSDP2 groups of a model of any class (samestep.distributed.fsdp)."""

from __future__ import annotations

import pytest
import torch

from samestep.distributed import shard_model
from tests.support import spawn


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
            "FSDPSequential",
            "FSDPLayer",
            "FSDPLayer",
        ]
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


class Viewing(torch.nn.Module):
    """A module that returns a view of what it computed (the control: FSDP2 warns of it)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).view(-1, 8)


def _view_warnings(rank: int, init: str, out: str) -> None:
    import json
    import warnings
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from samestep.distributed import CanonicalColwiseParallel, CanonicalRowwiseParallel

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=1)
    try:
        grid = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        said = {}
        for name, style in (
            ("column", CanonicalColwiseParallel(2)),
            ("row", CanonicalRowwiseParallel(2)),
            ("viewing", None),
        ):
            head = Viewing() if style is None else torch.nn.Linear(4, 8)
            if style is not None:
                parallelize_module(head, grid["tp"], style)
            fully_shard(head, mesh=grid["dp"])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(2):  # every step, as the loop calls it
                    head(torch.randn(2, 3, 4)).sum().backward()
            said[name] = sum("returned a view tensor" in str(w.message) for w in caught)
        Path(out).write_text(json.dumps(said))
    finally:
        dist.destroy_process_group()


def test_fsdp2_over_a_canonical_layer_warns_of_no_view_output(tmp_path):
    """A column- or row-parallel layer that FSDP2 wraps (a head, the model's last call) returns a tensor of its
    own, so FSDP2's "returned a view tensor" warning (an in-place op on it would drop the pre-backward hook)
    is not given, step after step. Control: a module returning a view gets the warning in the same check."""
    import json

    spawn(_view_warnings, (str(tmp_path / "init"), str(tmp_path / "said.json")), 1)
    said = json.loads((tmp_path / "said.json").read_text())
    assert said["column"] == said["row"] == 0 and said["viewing"] == 2, said

"""ShardAdamW: AdamW's update run on DTensor parameters' shards, with AdamW's bits and state
(samestep.distributed.shard_adamw)."""

from __future__ import annotations

import pytest
import torch

from samestep.distributed.shard_adamw import ShardAdamW
from tests.support import spawn


def _params(mesh) -> list[torch.nn.Parameter]:
    """A weight split by rows, one by columns, a replicated bias (as the tensor-parallel styles place them) and a
    plain tensor, from one seed."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(8, 6, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g)]
    placed = [distribute_tensor(t, mesh, [p]) for t, p in zip(whole, (Shard(0), Shard(1), Replicate()))]
    return [torch.nn.Parameter(t) for t in [*placed, torch.randn(5, generator=g)]]


def _train(kind, mesh) -> list[torch.Tensor]:
    """Three steps of ``kind`` (decay on matrices only, as the trainer groups them) on seeded gradients: every
    parameter's and state tensor's bits, whole."""
    params = _params(mesh)
    opt = kind(
        [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        **({"foreach": False} if kind is torch.optim.AdamW else {}),
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in params:
            grad = torch.randn(p.shape, generator=g)
            p.grad = (
                type(p).from_local(
                    grad.chunk(mesh.size(), p.placements[0].dim)[mesh.get_local_rank()]
                    if p.placements[0].is_shard()
                    else grad,
                    mesh,
                    p.placements,
                    shape=p.shape,
                    stride=p.stride(),
                )
                if hasattr(p, "placements")
                else grad
            )
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = [t for p in params for t in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], opt.state[p]["step"])]
    return [
        (t.full_tensor() if hasattr(t, "full_tensor") else t).view(-1).view(torch.int32)
        for t in [*params, *state]
        if t.dtype == torch.float32
    ]


def _compare(rank: int, init: str, out: str) -> None:
    import json
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        adamw, shard, coupled = (_train(k, mesh) for k in (torch.optim.AdamW, ShardAdamW, torch.optim.Adam))
        keys = sorted(ShardAdamW(_params(mesh)).state_dict()["param_groups"][0])
        said = {
            "same": all(torch.equal(a, b) for a, b in zip(adamw, shard)) and len(adamw) == len(shard) == 16,
            "coupled_differs": not all(torch.equal(a, b) for a, b in zip(adamw, coupled)),
            "group_keys": keys == sorted(torch.optim.AdamW(_params(mesh)).state_dict()["param_groups"][0]),
        }
        if rank == 0:
            Path(out).write_text(json.dumps(said))
    finally:
        dist.destroy_process_group()


def test_the_update_on_shards_has_adamws_bits_and_state(tmp_path):
    """On 2 ranks, rows-, columns-split and replicated DTensor parameters and a plain one: three steps of ShardAdamW
    leave the bytes AdamW(foreach=False) leaves in every parameter and state tensor, and its state dict's groups
    have AdamW's keys. Control: Adam's coupled weight decay, through the same comparison, leaves other bytes."""
    import json

    spawn(_compare, (str(tmp_path / "init"), str(tmp_path / "said.json")), 2)
    said = json.loads((tmp_path / "said.json").read_text())
    assert said == {"same": True, "coupled_differs": True, "group_keys": True}


def test_an_option_of_another_update_and_a_closure_are_refused_by_name():
    """foreach, fused, amsgrad and the like take another update than the one on shards: refused at construction,
    naming the option, and in a group added after it at step; a closure at step."""
    p = torch.nn.Parameter(torch.zeros(2))
    for option in ({"foreach": True}, {"fused": True}, {"amsgrad": True}, {"maximize": True}):
        with pytest.raises(ValueError, match=f"ShardAdamW: {next(iter(option))}=True takes another update"):
            ShardAdamW([p], **option)
    with pytest.raises(ValueError, match="closure"):
        ShardAdamW([p]).step(lambda: 0.0)
    opt = ShardAdamW([p])
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "amsgrad": True})
    with pytest.raises(ValueError, match="param group 1: amsgrad=True"):
        opt.step()

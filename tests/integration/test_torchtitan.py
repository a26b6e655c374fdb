"""samestep.Run with torchtitan's own Llama 3 model (its debug flavour, fused QKV, whose state-dict hooks
regather the fused weight: a collective) sharded by torchtitan's own FSDP2 helper, on 1 and 2 gloo
processes. The one stand-in: FlexAttention has no backward on a CPU, so each block's inner attention is
PyTorch's causal SDPA (what torchtitan needs CUDA for; the shipped samestep code is untouched)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import samestep
from samestep.analysis.receipt_check import check_receipts
from tests.support import spawn

pytestmark = pytest.mark.slow
MICROBATCHES, TOTAL, VOCAB = 4, 4, 2048


class CausalSDPA(torch.nn.Module):
    """torchtitan's inner-attention interface (B, L, N, H in and out) on PyTorch's causal SDPA."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):  # noqa: ANN001
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)


def _worker(
    rank: int, world: int, init: str, run_dir: str, out: str, kill_at: int | None, forget: bool, sharded: bool
) -> None:
    """``forget``: a resume leaves the optimizer's state out (the negative control)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder  # imported where used: a second at collection
    from torchtitan.models.llama3 import llama3_configs

    from samestep.distributed import CanonicalGradients, FsdpGradients, full_state

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    config = llama3_configs["debugmodel"](attn_backend="flex")
    config = dataclasses.replace(config, layers=config.layers[:2])  # 2 of its 6 blocks: the same kinds
    torch.manual_seed(0)
    model = config.build()
    for layer in model.layers.values():
        layer.attention.inner_attention = CausalSDPA()
    k = MICROBATCHES // world
    if sharded:  # torchtitan's helper: each block an FSDP2 group, the root the rest
        apply_fsdp_to_decoder(
            model,
            init_device_mesh("cpu", (world,)),
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
            pp_enabled=False,
        )
        grads = FsdpGradients(model, microbatches_per_process=k, world_size=world, rank=rank)
    else:
        grads = CanonicalGradients(model.parameters(), microbatches_per_process=k, world_size=world, rank=rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    with samestep.Run(run_dir, model=model, optimizer=opt, rng="keyed") as run:  # its draws keyed: moves layouts
        if forget and run.start:
            opt.state.clear()
        for step in run.steps(TOTAL):
            for i in grads.microbatches:
                with run.microbatch(i):
                    x = torch.randint(0, VOCAB, (2, 17), generator=samestep.rng.generator(0, step, i, "data"))
                    logits = model(x[:, :-1])
                    loss = F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1)) / MICROBATCHES
                    if step == kill_at:
                        os._exit(9)  # killed mid-step
                    loss.backward()
                grads.accumulate(i, extra=loss.detach())
            run.metric("loss", grads.reduce()[0])
            opt.step()
            opt.zero_grad(set_to_none=True)
    state = full_state(model)[0]  # every rank: a collective
    if rank == 0:
        digest = samestep.digest(torch.cat([t.reshape(-1) for t in state.values()]))
        Path(out).write_text(
            json.dumps({"digest": digest, "start": run.start, "sharded": run.sharded, "keys": sorted(state)})
        )


def _run(
    tmp_path: Path,
    name: str,
    world: int,
    *,
    run_dir: Path | None = None,
    kill_at: int | None = None,
    forget: bool = False,
) -> dict | None:
    out = tmp_path / f"{name}.json"
    args = (
        world,
        str(tmp_path / f"init_{name}"),
        str(run_dir or tmp_path / name),
        str(out),
        kill_at,
        forget,
        world > 1,
    )
    if kill_at is not None:
        spawn(_worker, args, world, exit_code=9)
        return None
    spawn(_worker, args, world)
    return json.loads(out.read_text())


def test_torchtitan_llama3_under_fsdp2_reruns_resumes_and_moves_from_2_processes_to_1(tmp_path):
    """torchtitan's debug Llama 3 (fused QKV) sharded by its FSDP2 helper over 2 processes through
    samestep.Run: the state of one process, bit for bit (samestep's canonical reduce-scatter); killed in
    step 3 and resumed on 2 processes, and the same killed run resumed on 1, both end on it too; the
    checkpoints hold each rank's shards, their state dicts name the fused weight as torchtitan's hook splits
    it, and `receipts verify` holds. Negative control: the 2 -> 1 resume leaving the optimizer's state out ends
    elsewhere."""
    one = _run(tmp_path, "one", 1)
    two = _run(tmp_path, "two", 2)
    assert one["sharded"] is False and two["sharded"] is True and two["digest"] == one["digest"]
    # the fused weight as torchtitan's state-dict hook names it apart, gathered from FSDP2's shards
    assert "layers.0.attention.qkv_linear.wq.weight" in two["keys"] and not any("wqkv" in k for k in two["keys"])
    _run(tmp_path, "killed", 2, kill_at=3)
    for copy in ("to1", "off"):
        shutil.copytree(tmp_path / "killed", tmp_path / copy)
    resumed = _run(tmp_path, "resumed", 2, run_dir=tmp_path / "killed")
    assert resumed["start"] == 2 and resumed["digest"] == one["digest"]
    assert (tmp_path / "killed" / "checkpoints" / "step_000004" / "model.rank_00001.safetensors").is_file()
    assert check_receipts(tmp_path / "killed")["ok"]
    moved = _run(tmp_path, "moved", 1, run_dir=tmp_path / "to1")
    assert moved["start"] == 2 and moved["digest"] == one["digest"]
    assert check_receipts(tmp_path / "to1")["ok"]
    forgot = _run(tmp_path, "forgot", 1, run_dir=tmp_path / "off", forget=True)
    assert forgot["start"] == 2 and forgot["digest"] != one["digest"]

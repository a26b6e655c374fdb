"""samestep.Run on several processes, with the model as the loop wrapped it: sharded by FSDP2 (every rank saves
and receipts its own shards, through the model's own state-dict hooks) or replicated by DDP (rank 0 saves and
receipts the whole state). The model carries a fused weight that its state-dict hook splits into Replicate
DTensors with a collective, as torchtitan's fused QKV does: every rank must take the state together."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import samestep
from samestep.analysis.receipt_check import check_receipts
from tests.support import spawn

pytestmark = pytest.mark.slow
MICROBATCHES, TOTAL = 4, 4


class Fused(torch.nn.Module):
    """Three projections in one weight (``wqkv``) that its state dict names apart (``wq``, ``wk``, ``wv``): the
    split takes the whole weight (``full_tensor``, a collective under FSDP2) and hands out Replicate DTensors;
    loading fuses them back into the parameter's own placement."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = torch.nn.Linear(8, 24, bias=False)
        self.out = torch.nn.Linear(24, 1)
        self.register_state_dict_post_hook(_split)
        self.register_load_state_dict_pre_hook(_fuse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.wqkv(x)))


def _split(module: Fused, state: dict, prefix: str, local_metadata: dict) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    weight = state.pop(prefix + "wqkv.weight")
    if isinstance(weight, DTensor):
        whole = weight.full_tensor()  # every rank: a collective
        parts = [
            DTensor.from_local(p.clone(), weight.device_mesh, [Replicate()], run_check=False) for p in whole.chunk(3)
        ]
    else:
        parts = [p.clone() for p in weight.detach().chunk(3)]
    for name, part in zip("qkv", parts):
        state[f"{prefix}w{name}.weight"] = part


def _fuse(module: Fused, state: dict, prefix: str, *args) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    parts = [state.pop(f"{prefix}w{name}.weight") for name in "qkv"]
    whole = torch.cat([p.full_tensor() if isinstance(p, DTensor) else p for p in parts])
    like = module.wqkv.weight
    state[prefix + "wqkv.weight"] = (
        distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)
        if isinstance(like, DTensor)
        else whole
    )


def _params(model: torch.nn.Module) -> np.ndarray:
    """Every parameter whole (a sharded one gathered: a collective), as int32 bits."""
    from torch.distributed.tensor import DTensor

    whole = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in whole]).numpy().view(np.int32)


def _own_ddp_reduce(model: torch.nn.Module, losses: list[torch.Tensor], world: int) -> torch.Tensor:
    """After DDP's own all-reduce (it averages; the loss is summed, so the gradients are scaled back by the
    world size): the step's loss, the ranks' local sums added by an all-reduce."""
    for p in model.parameters():
        p.grad.mul_(float(world))
    total = torch.stack(losses).sum()
    if world > 1:
        dist.all_reduce(total)
    return total


def _worker(
    rank: int,
    world: int,
    init: str,
    run_dir: str,
    out: str,
    layout: str,
    kill_at: int | None,
    forget: bool,
    every: int = 1,
) -> None:
    """A Run of TOTAL steps of MICROBATCHES global microbatches with the canonical reduction, the model
    ``layout``: "fsdp" (FSDP2 over ``world``), "ddp" or "plain" (one process); "fsdp-own" and "ddp-own": the
    wrapper's own reduction (FSDP2's reduce-scatter after each microbatch; DDP's all-reduce after the last,
    ``no_sync`` before). ``kill_at``: every rank dies (``os._exit``) inside that step, after its forward, with
    the checkpoint of the step before committed. ``forget``: a resume leaves the optimizer's state out.
    ``every``: the steps between checkpoints."""
    from samestep.distributed import CanonicalGradients
    from samestep.distributed.fsdp import FsdpDefaultGradients, FsdpGradients

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Fused()
    k = MICROBATCHES // world
    grads: Any = None  # ddp-own: DDP reduces
    if layout.startswith("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.wqkv, mesh=mesh)
        fully_shard(model, mesh=mesh)
        kind = FsdpDefaultGradients if layout == "fsdp-own" else FsdpGradients
        grads = kind(model, microbatches_per_process=k, world_size=world, rank=rank)
    elif layout != "ddp-own":
        grads = CanonicalGradients(model.parameters(), microbatches_per_process=k, world_size=world, rank=rank)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=False)
    if layout.startswith("ddp"):  # ddp: DDP kept, its own all-reduce left out (no_sync), the canonical tree reduces
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    with samestep.Run(
        run_dir, model=model, optimizer=opt, rng="keyed", checkpoint_every=every
    ) as run:  # its draws keyed: moves layouts
        if forget and run.start:
            opt.state.clear()
        for step in run.steps(TOTAL):
            mine, losses = range(rank * k, (rank + 1) * k), []
            for i in mine:
                unsynced = layout == "ddp" or (layout == "ddp-own" and i != mine[-1])
                with run.microbatch(i), model.no_sync() if unsynced else contextlib.nullcontext():
                    x = torch.randn(3, 8, generator=samestep.rng.generator(0, step, i, "data"))
                    loss = model(x).square().mean() / MICROBATCHES
                    if step == kill_at:
                        os._exit(9)  # killed mid-step: no close, no save of this step
                    loss.backward()
                if grads is None:
                    losses.append(loss.detach())
                else:
                    grads.accumulate(i, extra=loss.detach())
            run.metric("loss", _own_ddp_reduce(model, losses, world) if grads is None else grads.reduce()[0])
            opt.step()
            opt.zero_grad(set_to_none=True)
    bits = _params(model)
    if rank == 0:
        np.save(Path(out) / "params.npy", bits)
        Path(out, "run.json").write_text(json.dumps({"start": run.start, "sharded": run.sharded}))


def _run(
    tmp_path: Path,
    name: str,
    layout: str,
    world: int,
    *,
    kill_at: int | None = None,
    forget: bool = False,
    run_dir: Path | None = None,
    every: int = 1,
    exit_code: int | None = None,
) -> tuple[np.ndarray | None, dict | None]:
    """One launch of ``_worker`` into ``run_dir`` (default ``tmp_path / name``); what rank 0 wrote (None after a
    kill)."""
    run_dir = run_dir or tmp_path / name
    out = tmp_path / f"out_{name}"
    out.mkdir()
    args = (world, str(tmp_path / f"init_{name}"), str(run_dir), str(out), layout, kill_at, forget, every)
    if kill_at is not None or exit_code is not None:
        spawn(_worker, args, world, exit_code=9 if exit_code is None else exit_code)
        return None, None
    spawn(_worker, args, world)
    return np.load(out / "params.npy"), json.loads((out / "run.json").read_text())


def _final(run_dir: Path) -> str:
    """The digest of the whole state final.json holds (shards gathered, DDP's names unwrapped)."""
    final = json.loads((run_dir / "final.json").read_text())
    assert final["state_digest_of"] == "whole"
    return final["state_digest"]


def _receipts(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_dir / "receipts").glob("rank_*.jsonl"))}


def test_run_on_fsdp2_reruns_resumes_after_a_kill_and_moves_from_2_processes_to_1(tmp_path):
    """FSDP2 over 2 gloo processes, a model whose state-dict hook gathers a fused weight (a collective) into
    Replicate DTensors: a rerun gives the same bits and the same receipts of each rank's shards; a run killed
    in step 3 and resumed on 2 processes is the run straight through, bit for bit, receipts included; the
    same killed run resumed on 1 process (unsharded) continues to the same bits, which are those of one
    process from the start; `receipts verify` holds on each. Negative controls: FSDP2's own reduce-scatter gives
    other bits on 2 processes than on 1, and the 2 -> 1 resume leaving the optimizer's state out ends on other
    bits."""
    straight, info = _run(tmp_path, "straight", "fsdp", 2)
    assert info == {"start": 0, "sharded": True}
    again, _ = _run(tmp_path, "again", "fsdp", 2)
    assert np.array_equal(again, straight)
    assert set(_receipts(tmp_path / "straight")) == {"rank_00000.jsonl", "rank_00001.jsonl"}
    assert _receipts(tmp_path / "again") == _receipts(tmp_path / "straight")

    one, _ = _run(tmp_path, "one", "plain", 1)
    assert np.array_equal(one, straight)  # the canonical reduction: one process's bits
    own1, own2 = (_run(tmp_path, f"own{w}", "fsdp-own", w)[0] for w in (1, 2))
    assert not np.array_equal(own1, own2)

    _run(tmp_path, "killed", "fsdp", 2, kill_at=3)
    import shutil

    for copy in ("to1", "off"):
        shutil.copytree(tmp_path / "killed", tmp_path / copy)
    resumed, info = _run(tmp_path, "resumed", "fsdp", 2, run_dir=tmp_path / "killed")
    assert info == {"start": 2, "sharded": True} and np.array_equal(resumed, straight)
    assert _receipts(tmp_path / "killed") == _receipts(tmp_path / "straight")
    assert check_receipts(tmp_path / "killed")["ok"]

    moved, info = _run(tmp_path, "moved", "plain", 1, run_dir=tmp_path / "to1")
    assert info == {"start": 2, "sharded": False} and np.array_equal(moved, straight)
    assert check_receipts(tmp_path / "to1")["ok"]

    forgot, info = _run(tmp_path, "forgot", "plain", 1, run_dir=tmp_path / "off", forget=True)
    assert info["start"] == 2 and not np.array_equal(forgot, straight)
    # final.json: one digest of the whole state (parameters and optimizer moments) on every layout
    assert len({_final(tmp_path / d) for d in ("straight", "one", "killed", "to1")}) == 1
    assert _final(tmp_path / "off") != _final(tmp_path / "one")
    assert _final(tmp_path / "own1") != _final(tmp_path / "own2")


def test_a_sharded_resume_checks_each_ranks_steps_computed_again(tmp_path):
    """FSDP2 on 2 processes, a checkpoint every 2 steps, every rank killed in step 4 (the checkpoint of step 2;
    each rank's receipts of its shards up to step 3): resumed as it is, each rank checks step 3 against its own
    receipt, holds it until both agree, and the run ends on the straight run's bits and receipts. Negative
    control: the same kill resumed with the optimizer's state left out stops on every rank before either
    writes a receipt, each rank's receipts file as the kill left it."""
    import shutil

    straight, _ = _run(tmp_path, "straight", "fsdp", 2, every=2)
    _run(tmp_path, "killed", "fsdp", 2, kill_at=4, every=2)
    assert all(len(b.splitlines()) == 4 for b in _receipts(tmp_path / "killed").values())  # header, steps 1-3
    shutil.copytree(tmp_path / "killed", tmp_path / "off")
    before = _receipts(tmp_path / "off")
    _run(tmp_path, "forgot", "fsdp", 2, run_dir=tmp_path / "off", forget=True, every=2, exit_code=1)
    assert _receipts(tmp_path / "off") == before
    resumed, info = _run(tmp_path, "resumed", "fsdp", 2, run_dir=tmp_path / "killed", every=2)
    assert info == {"start": 2, "sharded": True} and np.array_equal(resumed, straight)
    assert _receipts(tmp_path / "killed") == _receipts(tmp_path / "straight")


def test_run_on_ddp_reruns_and_resumes_after_a_kill(tmp_path):
    """DDP over 2 gloo processes (its gradients reduced by the canonical tree inside the loop): rank 0 saves
    and receipts the whole state; a rerun and a run killed in step 3 and resumed give the same bits and the
    same receipts, and the bits of one process. Negative controls: DDP's own all-reduce gives other bits on 2
    processes than on 1, and the resume leaving the optimizer's state out differs."""
    straight, info = _run(tmp_path, "straight", "ddp", 2)
    assert info == {"start": 0, "sharded": False}
    assert set(_receipts(tmp_path / "straight")) == {"rank_00000.jsonl"}
    again, _ = _run(tmp_path, "again", "ddp", 2)
    assert np.array_equal(again, straight) and _receipts(tmp_path / "again") == _receipts(tmp_path / "straight")
    one, _ = _run(tmp_path, "one", "plain", 1)
    assert np.array_equal(one, straight)
    own1, own2 = (_run(tmp_path, f"own{w}", "ddp-own", w)[0] for w in (1, 2))
    assert not np.array_equal(own1, own2)
    _run(tmp_path, "killed", "ddp", 2, kill_at=3)
    import shutil

    shutil.copytree(tmp_path / "killed", tmp_path / "off")
    resumed, info = _run(tmp_path, "resumed", "ddp", 2, run_dir=tmp_path / "killed")
    assert info["start"] == 2 and np.array_equal(resumed, straight)
    assert _receipts(tmp_path / "killed") == _receipts(tmp_path / "straight")
    assert check_receipts(tmp_path / "killed")["ok"]
    forgot, info = _run(tmp_path, "forgot", "ddp", 2, run_dir=tmp_path / "off", forget=True)
    assert info["start"] == 2 and not np.array_equal(forgot, straight)
    # final.json: DDP's names unwrapped, the one process's digest; the control's differs
    assert _final(tmp_path / "straight") == _final(tmp_path / "one") == _final(tmp_path / "killed")
    assert _final(tmp_path / "off") != _final(tmp_path / "one")
    assert _final(tmp_path / "own1") != _final(tmp_path / "own2")

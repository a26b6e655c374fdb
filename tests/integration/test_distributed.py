"""The cross-process canonical combine over gloo: same bits as one process, whatever the world size."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import samestep
from samestep.distributed.reduce import combine_across_ranks, ring_allreduce_bytes
from samestep.distributed.tree import canonical_sum
from samestep.hashing.checksums import Checksums
from samestep.tracing import Perturb
from tests.support import spawn, traced_step

pytestmark = pytest.mark.slow
N_MICRO, SIZE = 8, 10_001  # SIZE is not a multiple of any world size: exercises the padding


def _leaves() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(SIZE, generator=g) * torch.exp(torch.randn(SIZE, generator=g) * 6) for _ in range(N_MICRO)]


def _worker(rank: int, world: int, init_file: str, out_dir: str, bucket: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    k = N_MICRO // world
    local = canonical_sum(_leaves()[rank * k : (rank + 1) * k])
    combined, sent = combine_across_ranks(local, world, bucket_elements=bucket)
    plain = local.clone()
    dist.all_reduce(plain)  # PyTorch's path, for the negative control
    np.save(f"{out_dir}/canonical_{rank}.npy", combined.numpy())
    np.save(f"{out_dir}/allreduce_{rank}.npy", plain.numpy())
    np.save(f"{out_dir}/sent_{rank}.npy", np.array([sent]))


def _run(world: int, tmp_path, bucket: int) -> dict[str, list[np.ndarray]]:
    out = tmp_path / f"w{world}"
    out.mkdir()
    spawn(_worker, (world, str(tmp_path / f"init{world}"), str(out), bucket), world)
    kinds = ("canonical", "allreduce", "sent")
    return {kind: [np.load(out / f"{kind}_{r}.npy") for r in range(world)] for kind in kinds}


def test_combine_matches_one_process_on_2_and_4_ranks_and_allreduce_does_not(tmp_path):
    """2 and 4 gloo ranks give the 1-process bits on every rank (small buckets: pipelined); plain all-reduce
    gives other bits at 2 vs 4 ranks (negative control). Bytes sent equal a ring all-reduce's, within padding."""
    reference = canonical_sum(_leaves()).numpy().view(np.int32)
    plain = {}
    for world in (2, 4):
        res = _run(world, tmp_path, bucket=3_000)
        for r in range(world):
            assert np.array_equal(res["canonical"][r].view(np.int32), reference), (world, r)
        plain[world] = res["allreduce"][0].view(np.int32)
        ring = ring_allreduce_bytes(SIZE, 4, world)
        assert ring <= int(res["sent"][0][0]) <= ring * 1.05
    assert not np.array_equal(plain[2], plain[4])


def _three_steps(
    rec, model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, width: int, changed: bool, call: torch.nn.Module
) -> None:
    """Steps 1-3 of a distributed test loop, one microbatch per rank (``call``: the model as wrapped);
    ``changed``: rank 1's data differs at step 2. Closes ``rec``."""
    for step in (1, 2, 3):
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(100 * step + rank))
        if changed and rank == 1 and step == 2:
            x[0, 0] += 1e-3
        traced_step(rec, model, opt, step, [(rank, x)], lambda x: call(x).square().mean())
    rec.close()


def _ddp_worker(rank: int, world: int, init_file: str, run_dir: str, variant: str) -> None:
    """Three steps of a small model under PyTorch DDP over gloo, traced at step level through
    ``Recorder.ddp_comm_hook`` (``variant``: "traced", "view" (traced, gradients as bucket views),
    "changed" (rank 1's data differs at step 2),
    "op" (traced at op level), "op_ulp" (and one ULP planted on rank 1 at step 2) or "untraced" (no hook,
    no trace)); writes the final parameters' bits."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with samestep.enable(threads=1):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 64))
        # Small buckets: from step 2 on (DDP rebuilds them after the first), two reductions per step
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.25, gradient_as_bucket_view=variant == "view")
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        views = []
        opt.register_step_pre_hook(
            lambda *_: views.append(any(p.grad.untyped_storage().nbytes() > p.grad.nbytes for p in model.parameters()))
        )
        level = {"untraced": "off", "op": "op", "op_ulp": "op"}.get(variant, "step")
        # the last layer's weight gradient on rank 1 (a ULP in a forward activation can round away)
        perturb = (
            Perturb(
                rank=1, step=2, microbatch=1, phase="backward", scope="module.2", op="aten.mm.default", occurrence=1
            )
            if variant == "op_ulp"
            else None
        )
        rec = samestep.trace(run_dir, level=level, steps="1-3", perturb=perturb)
        if variant != "untraced":
            rec.attach(ddp)
            ddp.register_comm_hook(None, rec.ddp_comm_hook())
        _three_steps(rec, model, opt, rank, 64, variant == "changed", ddp)
        assert views == [variant == "view"] * 3, views  # the gradients are views of DDP's buckets in "view" only
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        np.save(f"{run_dir}/params_{rank}.npy", flat.numpy().view(np.int32))
    # Done, its results on disk: skip the interpreter's teardown, where gloo's threads may still hold the
    # hooks' futures and abort the process (pytorch/pytorch#179291), under load, after the work is done
    os._exit(0)


def test_ddp_comm_hook_records_each_bucket_and_diff_blames_the_rank_that_changed(tmp_path):
    """A DDP loop of the user's own, traced at step level with rec.ddp_comm_hook(): the hook changes no
    bit (same parameters as DDP without it), two runs diff identical with every bucket's reduction
    recorded in bucket order (one with gradient_as_bucket_view=True: the gradients are views of DDP's
    buckets, which its next backward overwrites), and when rank 1's data changes at step 2, the difference
    is first seen on rank 1 (step-level records have no inputs: no origin is claimed) while rank 0's first
    difference is the bucket reduction whose local input matched (a receiver). At op level
    too, two runs are identical: DDP's reducer builds its buckets in uninitialised memory and writes them
    in C++ without bumping version counters, and its all-reduces finish on gloo's thread; and a ULP planted
    on rank 1 is the origin there while rank 0 only receives it."""
    from samestep.analysis import diff_runs
    from samestep.tracing import read_stream, stream_path

    runs = {}
    for name, variant in (
        ("a", "traced"),
        ("b", "view"),
        ("c", "changed"),
        ("plain", "untraced"),
        ("opa", "op"),
        ("opb", "op"),
        ("opc", "op_ulp"),
    ):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        spawn(_ddp_worker, (2, str(tmp_path / f"init_{name}"), str(runs[name]), variant), 2)
    for r in range(2):
        for name in ("a", "b", "opa"):
            assert np.array_equal(np.load(runs[name] / f"params_{r}.npy"), np.load(runs["plain"] / f"params_{r}.npy"))
    table = read_stream(stream_path(runs["a"], 0)).table
    buckets = [
        (s, o)
        for s, sc, o, op in zip(
            table["step"].to_pylist(),
            table["scope"].to_pylist(),
            table["occurrence"].to_pylist(),
            table["op"].to_pylist(),
        )
        if sc == "collective" and op == "ddp.allreduce"
    ]
    per_step = [sum(s == step for s, _ in buckets) for step in (1, 2, 3)]
    assert per_step[1] >= 2 and buckets == [(s, o) for s in (1, 2, 3) for o in range(per_step[s - 1])], buckets
    same = diff_runs(runs["a"], runs["b"])
    assert same["identical"] and same["per_rank"]["0"]["records_compared"] == table.num_rows
    changed = diff_runs(runs["a"], runs["c"])
    assert changed["origin"] is None and (changed["first_seen"]["rank"], changed["first_seen"]["step"]) == (1, 2)
    assert "rank(s) 0 received it through a collective" in changed["summary"]
    d0 = changed["per_rank"]["0"]["divergence"]
    assert (d0["kind"], d0["scope"], d0["op"], d0["step"], d0["inputs_matched"]) == (
        "receiver",
        "collective",
        "ddp.allreduce",
        2,
        True,
    )
    ops = diff_runs(runs["opa"], runs["opb"])
    assert ops["identical"], ops["summary"]
    ops_table = read_stream(stream_path(runs["opa"], 0)).table
    assert ops_table.num_rows == ops["per_rank"]["0"]["records_compared"] > table.num_rows
    assert "c10d.allreduce_.default" in ops_table["op"].to_pylist()
    # the hook's own copy of each bucket is not one of the model's ops (this model's backward has no clone)
    phase_ops = set(zip(ops_table["phase"].to_pylist(), ops_table["op"].to_pylist()))
    assert ("backward", "aten.clone.default") not in phase_ops
    # A ULP on rank 1 at op level: the origin there; rank 0 receives it from gloo's write into the buckets,
    # below the dispatcher: a receiver (the buckets' views are staged anew after the all-reduce), not an origin
    ulp = diff_runs(runs["opa"], runs["opc"])
    assert (ulp["origin"]["rank"], ulp["origin"]["op"], ulp["origin"]["step"]) == (1, "aten.mm.default", 2)
    d0 = ulp["per_rank"]["0"]["divergence"]
    assert d0 is not None and d0["kind"] == "receiver" and d0["step"] == 2, ulp["per_rank"]["0"]


def _fsdp_worker(rank: int, world: int, init_file: str, run_dir: str, variant: str) -> None:
    """Three steps of a small model sharded by FSDP2 (``fully_shard``: parameters, gradients and optimizer
    state are DTensors) over gloo, traced as tracing/recorder.py says (``variant``: "step", "module", "op",
    "changed" (step level; rank 1's data differs at step 2) or "untraced"); writes the final local shards'
    bits and the digest of this rank's shard of the first weight."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with samestep.enable(threads=1):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        level = {"untraced": "off", "changed": "step"}.get(variant, variant)
        rec = samestep.trace(run_dir, level=level, steps="1-3")
        rec.attach(model)
        if variant != "untraced":
            for layer in (model[0], model[2], model):
                layer.set_custom_reduce_scatter(rec.fsdp_reduce_scatter())
        _three_steps(rec, model, opt, rank, 16, variant == "changed", model)
        shards = [p._local_tensor.detach().reshape(-1) for p in model.parameters()]
        np.save(f"{run_dir}/params_{rank}.npy", torch.cat(shards).numpy().view(np.int32))
        (Path(run_dir) / f"weight_{rank}.txt").write_text(Checksums().of([model[0].weight._local_tensor])[0])


def test_fsdp2_sharded_state_is_traced_as_each_rank_shard(tmp_path):
    """FSDP2 (fully_shard) over 2 gloo processes: parameters, gradients and optimizer state are DTensors,
    which the recorder refused (no storage pointer). Each rank now records its local shard, and with
    rec.fsdp_reduce_scatter() each gradient reduce-scatter: tracing at step, module or op level changes no
    bit (the comm reduces as FSDP2's default); two runs diff identical at step and module level with every
    reduce-scatter recorded; a rank's 'param' record is the state checksum of its shard; and when rank 1's data
    changes at step 2, the difference is first seen on rank 1 (no origin claimed at step level) while rank
    0's first difference is the reduce-scatter whose local input matched (a receiver)."""
    from samestep.analysis import diff_runs
    from samestep.tracing import read_stream, stream_path

    runs = {}
    for name in ("untraced", "step", "step2", "module", "op", "changed"):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        spawn(_fsdp_worker, (2, str(tmp_path / f"init_{name}"), str(runs[name]), name.rstrip("2")), 2)
    for r in range(2):
        plain = np.load(runs["untraced"] / f"params_{r}.npy")
        for name in ("step", "module", "op"):
            assert np.array_equal(np.load(runs[name] / f"params_{r}.npy"), plain), (name, r)
        rows = read_stream(stream_path(runs["step"], r)).table.to_pylist()
        last = [x for x in rows if x["op"] == "param" and x["scope"] == "0.weight"][-1]
        assert last["step"] == 3 and last["outputs"].hex() == (runs["step"] / f"weight_{r}.txt").read_text()
    assert read_stream(stream_path(runs["step"], 0)).table.num_rows > 20
    for a, b in (("step", "step2"), ("step", "module")):
        same = diff_runs(runs[a], runs[b])
        assert same["identical"], (a, b, same["summary"])
    table = read_stream(stream_path(runs["step"], 0)).table
    calls = [
        (s, o)
        for s, op, o in zip(table["step"].to_pylist(), table["op"].to_pylist(), table["occurrence"].to_pylist())
        if op == "fsdp.reduce_scatter"
    ]
    assert calls == [(s, o) for s in (1, 2, 3) for o in range(2)], calls  # the two Linear layers, every step
    changed = diff_runs(runs["step"], runs["changed"])
    assert changed["origin"] is None and (changed["first_seen"]["rank"], changed["first_seen"]["step"]) == (1, 2), (
        changed["summary"]
    )
    d0 = changed["per_rank"]["0"]["divergence"]
    assert (d0["kind"], d0["scope"], d0["op"], d0["step"], d0["inputs_matched"]) == (
        "receiver",
        "collective",
        "fsdp.reduce_scatter",
        2,
        True,
    ), d0

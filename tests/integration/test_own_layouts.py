"""A model samestep did not write on the layouts of a loop of one's own: examples/tp_llama.py (a transformers Llama
from its config, tensor-parallel through PyTorch's ``parallelize_module`` with samestep's canonical styles, under
``samestep.Run``) run as its docstring runs it, on one process and as torchrun's processes. ``Run`` records the
layout (the mesh and every parameter's placements), so diff pairs records only on one layout and names a rank
by its mesh coordinates, and a run killed at one degree resumes at another."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support import cli_here, script_ranks, side_by_side

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tp_llama.py"
PIPELINE = ROOT / "examples" / "pp_llama.py"
EXPERTS = ROOT / "examples" / "ep_mixtral.py"
PLANT = "rank=1,step=3,microbatch=1,phase=forward,scope=model.layers.1.mlp.up_proj,op=aten.bmm.default"


KILLED = 9  # the example's exit code where --kill-after ends it


def _launch(processes: int, run_dir: Path, *args: str) -> str | Exception:
    """The example as its docstring runs it, as torchrun's processes where ``processes`` > 1 (forked from the
    spawn server); the digest it prints ("" where --kill-after ends it), or what a process raised."""
    killed = KILLED if "--kill-after" in args else None
    try:
        return script_ranks(EXAMPLE, str(run_dir), *args, nproc=processes, exit_code=killed).strip()
    except Exception as e:  # torch.multiprocessing's ProcessRaisedException: the traceback in its message
        return e


def _together(*launches: tuple) -> list[str | Exception]:
    return side_by_side(*(lambda a=a: _launch(*a) for a in launches))


def _digest(done: str | Exception) -> str:
    assert isinstance(done, str) and len(done) == 32, done
    return done


def test_tensor_parallel_llama_resumes_across_degrees_and_diffs_by_layout(tmp_path):
    """1 process, FSDP2 over TP on a 2 x 2 mesh, TP 2 (steps 1-2, then killed) resumed at TP 4, on 1 process and
    on the 2 x 2 mesh: one digest of the final parameters, and `samestep diff` of the 1-process run and the
    TP 2 -> 4 run and the 2 x 2 run "identical" (every step's loss and gradient-norm bits; their records were
    written on other layouts, which run.json's layouts and the note name). A ULP planted in rank 1's up_proj at
    step 3 of a TP 4 resume is the origin diff names, at `tp 1` of the mesh, the records before it alike on every
    rank (the others receive it). Refused: the resume on 1 process with ``rng="restore"`` (the checkpoint holds 2
    ranks' generators), naming rng='keyed', nothing written. Negative controls: PyTorch's own styles at TP 2
    give other bits than the plain model on 1 process, and on the 2 x 2 mesh (with FSDP2's own reduce-scatter)
    other bits than samestep's there; diff of the 1-process run and that TP 2 run says diverged (other layouts:
    by the loss bits)."""
    one, killed, stock1, stock2, grid, stock_grid = _together(
        (1, tmp_path / "one"),
        (2, tmp_path / "k", "--kill-after", "2"),
        (1, tmp_path / "s1", "--styles", "pytorch"),
        (2, tmp_path / "s2", "--styles", "pytorch"),
        (4, tmp_path / "grid", "--dp", "2"),
        (4, tmp_path / "sgrid", "--dp", "2", "--styles", "pytorch"),
    )
    assert killed == "" and sorted(p.name for p in (tmp_path / "k" / "checkpoints").glob("step_*")) == [
        "step_000001",
        "step_000002",
    ]
    assert _digest(stock1) != _digest(stock2)
    assert _digest(grid) == _digest(one) != _digest(stock_grid)
    for name in ("tp4", "planted", "to1", "refused", "togrid"):
        shutil.copytree(tmp_path / "k", tmp_path / name)
    before = sorted(p.relative_to(tmp_path / "refused") for p in (tmp_path / "refused").rglob("*"))
    tp4, planted, to1, refused, togrid = _together(
        (4, tmp_path / "tp4", "--trace-op", "3"),
        (4, tmp_path / "planted", "--trace-op", "3", "--perturb", PLANT),
        (1, tmp_path / "to1"),
        (1, tmp_path / "refused", "--rng", "restore"),
        (4, tmp_path / "togrid", "--dp", "2"),
    )
    assert _digest(tp4) == _digest(to1) == _digest(togrid) == _digest(one)
    _digest(planted)
    assert isinstance(refused, Exception)
    assert "rng='keyed'" in str(refused) and "written by 2 process(es)" in str(refused)
    assert sorted(p.relative_to(tmp_path / "refused") for p in (tmp_path / "refused").rglob("*")) == before

    doc = json.loads((tmp_path / "tp4" / "run.json").read_text())
    assert doc["layout"]["meshes"][0]["shape"] == [2] and doc["layout"]["placed"]["S(0)"] == 10
    assert [(r["step"], r["meshes"][0]["shape"]) for r in doc["resumes"]] == [(2, [4])]
    layout = json.loads((tmp_path / "grid" / "run.json").read_text())["layout"]
    assert layout["sharded"] == "fsdp2" and layout["meshes"][0] == {
        "names": ["dp", "tp"],
        "shape": [2, 2],
        "ranks": [[0, 1], [2, 3]],
    }

    same = cli_here("diff", str(tmp_path / "one"), str(tmp_path / "tp4"))
    assert same.returncode == 0 and same.stdout.startswith("identical"), same.stdout
    assert "device mesh tp=1" in same.stdout and "device mesh tp=2" in same.stdout
    for other in ("to1", "togrid", "grid"):
        moved = cli_here("diff", str(tmp_path / "one"), str(tmp_path / other))
        assert moved.returncode == 0 and moved.stdout.startswith("identical"), (other, moved.stdout)
    assert "device mesh dp=2 x tp=2; dp=2, FSDP2 sharding them" in moved.stdout
    # final.json: the whole state (shards gathered) digested alike on every layout, so diff compares it too
    finals = {
        name: json.loads((tmp_path / name / "final.json").read_text())
        for name in ("one", "tp4", "to1", "grid", "togrid", "s2")
    }
    assert {f["state_digest_of"] for f in finals.values()} == {"whole"}
    assert len({finals[n]["state_digest"] for n in ("one", "tp4", "to1", "grid", "togrid")}) == 1, finals
    assert finals["s2"]["state_digest"] != finals["one"]["state_digest"]
    assert "and the final state digest are compared" in moved.stdout

    found = cli_here("diff", "--json", str(tmp_path / "tp4"), str(tmp_path / "planted"))
    report = json.loads(found.stdout)
    assert found.returncode == 1 and report["origin"]["rank"] == 1 and report["origin"]["step"] == 3
    # the records before the plant agree on every rank: the others only receive it (a buffer a collective
    # fills, digested before it is, would make one an origin of its own)
    kinds = {rank: res["divergence"]["kind"] for rank, res in report["per_rank"].items()}
    assert kinds == {"0": "receiver", "1": "origin", "2": "receiver", "3": "receiver"}, kinds
    assert report["origin"]["scope"] == "model.layers.1.mlp.up_proj" and report["origin"]["op"] == "aten.bmm.default"
    assert any("rank 1 at step 3 is tp 1 of the mesh tp=4" in note for note in report["notes"])
    assert cli_here("diff", str(tmp_path / "one"), str(tmp_path / "s2")).returncode == 1


def test_a_pipelined_llama_gives_the_one_process_bits_at_pp_2_and_pp_2_by_dp_2():
    """examples/pp_llama.py: the Llama cut into stages that torch.distributed.pipelining runs, each stage's
    gradients summed by ``canonical_stage``: 1 process (the model's own call), PP 2 and PP 2 x DP 2 print one
    digest of the final parameters and one last loss. Negative control: PyTorch's own (pipelining's
    accumulation, the data ranks' all-reduce, the stages' norms combined) gives another digest at PP 2 x DP 2
    than on 1 process."""
    one, pp2, grid, plain1, plain_grid = side_by_side(
        *(
            lambda a=a: script_ranks(PIPELINE, *a[1:], nproc=a[0]).strip()
            for a in ((1,), (2,), (4, "--dp", "2"), (1, "--plain"), (4, "--dp", "2", "--plain"))
        )
    )
    digest, loss = one.split()
    assert len(digest) == 32 and loss.startswith("0x")
    assert pp2 == grid == one
    assert plain1.split()[0] != plain_grid.split()[0]


def test_a_mixtral_gives_the_one_process_bits_at_ep_2_and_4_and_resumes_across_degrees(tmp_path):
    """examples/ep_mixtral.py: a transformers Mixtral (4 experts, top 2) whose experts ``parallelize_experts``
    spreads over the ranks: 1 process (the model's own call, transformers' default grouped_mm experts), EP 2,
    and EP 2 killed after step 2 resumed on 1 process and at EP 4, print one digest of the final parameters;
    so do 1 process and EP 4 in transformers' eager loop. `samestep diff` of the 1-process run and the EP 2 ->
    1 run: "identical". Negative control: the usual sums at EP 2 (autograd's over the ranks' rows, the other
    gradients all-reduced after each rank's microbatches in turn) give another digest, which diff calls
    diverged."""
    killed = KILLED
    one, ep2, dead, plain, eager1, eager4 = side_by_side(
        *(
            lambda a=a: script_ranks(
                EXPERTS, str(tmp_path / a[1]), *a[2:], nproc=a[0], exit_code=killed if "--kill-after" in a else None
            ).strip()
            for a in (
                (1, "one"),
                (2, "ep2"),
                (2, "k", "--kill-after", "2"),
                (2, "plain", "--plain"),
                (1, "e1", "--experts", "eager"),
                (4, "e4", "--experts", "eager"),
            )
        )
    )
    assert dead == "" and _digest(ep2) == _digest(one) != _digest(plain)
    assert _digest(eager4) == _digest(eager1)
    for name in ("to1", "to4"):
        shutil.copytree(tmp_path / "k", tmp_path / name)
    to1, to4 = side_by_side(
        lambda: script_ranks(EXPERTS, str(tmp_path / "to1"), nproc=1).strip(),
        lambda: script_ranks(EXPERTS, str(tmp_path / "to4"), nproc=4).strip(),
    )
    assert _digest(to1) == _digest(to4) == _digest(one)
    layout = json.loads((tmp_path / "ep2" / "run.json").read_text())["layout"]
    assert layout["meshes"][0]["names"] == ["ep"] and layout["placed"]["S(0)"] == 4  # 2 layers' 2 stacked weights
    same = cli_here("diff", str(tmp_path / "one"), str(tmp_path / "to1"))
    assert same.returncode == 0 and same.stdout.startswith("identical"), same.stdout
    other = cli_here("diff", str(tmp_path / "one"), str(tmp_path / "plain"))
    assert other.returncode == 1 and "diverged" in other.stdout, other.stdout

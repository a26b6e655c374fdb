"""World-size invariance of the reference run, and elastic exact resume across world sizes."""

from __future__ import annotations

import json
import os

import pytest

from tests.support import TINY, cli_here, metrics_bytes, train_here, train_ranks

pytestmark = pytest.mark.slow

# 8 global microbatches of 2 sequences: layouts (1 x 8), (2 x 4), (4 x 2), (8 x 1).
LAYOUT = (
    *[s for s in TINY if not s.startswith(("train.global_batch", "train.steps"))],
    "train.global_batch=16",
    "train.steps=6",
)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    d = tmp_path_factory.mktemp("w1") / "run"
    return d, train_here(d, *LAYOUT)["state_digest"]


@pytest.mark.parametrize("nproc", [2, 4, 8])
def test_world_sizes_give_the_one_process_bits(one_process, tmp_path, nproc):
    """(2 x 4), (4 x 2) and (8 x 1) give the (1 x 8) per-step loss bits and final digest."""
    ref_dir, ref_digest = one_process
    final = train_ranks(tmp_path / "run", *LAYOUT, nproc=nproc)
    assert final["state_digest"] == ref_digest and final["world_size"] == nproc
    assert metrics_bytes(tmp_path / "run") == metrics_bytes(ref_dir)


def test_plain_allreduce_differs_across_world_sizes(tmp_path):
    """Negative control: determinism off (plain .grad accumulation + all-reduce, DDP's path, same thread
    count) repeats at a fixed world size but gives different bits at 2 and 4 processes."""
    off = (*LAYOUT, "determinism.enabled=false", "train.steps=3")
    two = [train_ranks(tmp_path / f"w2_{i}", *off, nproc=2)["state_digest"] for i in range(2)]
    four = train_ranks(tmp_path / "w4", *off, nproc=4)["state_digest"]
    assert two[0] == two[1]
    assert four != two[0]


@pytest.mark.parametrize("first,second", [(4, 2), (1, 4)])  # 2 -> 1: the FSDP2 test below
def test_elastic_resume_is_exact(one_process, tmp_path, first, second):
    """Stop a run written by `first` processes after 4 steps, resume on `second`: bits of the 1-process run."""
    ref_dir, ref_digest = one_process
    d = tmp_path / "run"
    if first == 1:
        assert train_here(d, *LAYOUT, stop_after=4) is None
    else:
        assert train_ranks(d, *LAYOUT, nproc=first, stop_after=4) is None
    final = train_ranks(d, *LAYOUT, nproc=second, resume=True)
    assert final["state_digest"] == ref_digest
    assert metrics_bytes(d) == metrics_bytes(ref_dir)
    run = json.loads((d / "run.json").read_text())
    assert run["layout"]["world_size"] == first
    assert [(r["step"], r["world_size"]) for r in run["resumes"]] == [(4, second)]


def test_fsdp2_gives_the_one_process_bits_and_resumes_across_sharded_layouts(one_process, tmp_path):
    """parallel.fsdp=true shards parameters, gradients and optimizer state with FSDP2 and reduces along the
    canonical tree: a run on 4 sharded processes, stopped after step 2, resumed on 2 sharded processes,
    stopped after step 4, and finished on 1 unsharded process gives the 1-process run's per-step loss and
    grad-norm bits and final digest; run.json records each layout."""
    ref_dir, ref_digest = one_process
    d, fsdp = tmp_path / "run", "parallel.fsdp=true"
    assert train_ranks(d, *LAYOUT, fsdp, nproc=4, stop_after=2) is None
    assert train_ranks(d, *LAYOUT, fsdp, nproc=2, stop_after=2, resume=True) is None
    final = train_here(d, *LAYOUT, resume=True)
    assert final["state_digest"] == ref_digest
    assert metrics_bytes(d) == metrics_bytes(ref_dir)
    run = json.loads((d / "run.json").read_text())
    assert run["layout"] == {"world_size": 4, "microbatches_per_process": 2, "sharded": "fsdp2"}
    # each sharded process wrote its own shards, and the 1-process resume read them whole
    first = d / "checkpoints" / "step_000002"
    assert json.loads((first / "manifest.json").read_text())["version"] == 2
    assert sorted(p.name for p in first.glob("model.rank_*")) == [f"model.rank_0000{r}.safetensors" for r in range(4)]
    assert [(r["step"], r["world_size"], r.get("sharded")) for r in run["resumes"]] == [(2, 2, "fsdp2"), (4, 1, None)]


def _dies_writing_its_optimizer_shard_of_step_4() -> None:
    """Rank 1 SIGKILLs itself as it writes its optimizer shard into step 4's checkpoint."""
    import signal

    import samestep.checkpoint.save_shards as save_shards

    write = save_shards.write_tensors

    def dying(path, tensors):
        if path.name == "optimizer.rank_00001.safetensors" and path.parent.name == ".step_000004.tmp":
            os.kill(os.getpid(), signal.SIGKILL)
        return write(path, tensors)

    save_shards.write_tensors = dying  # where each rank's shard files are written


def test_a_rank_killed_in_a_sharded_save_leaves_the_previous_checkpoint_and_the_resume_is_exact(one_process, tmp_path):
    """Rank 1 of a 2-process sharded run is SIGKILLed while writing its optimizer shard of step 4: the job
    dies, step 2 stays the newest checkpoint, intact, and a sharded resume gives the 1-process bits. Then a
    flipped byte in one shard is named by `samestep checkpoint verify` (exit 1): file and tensor."""
    import signal

    ref_dir, ref_digest = one_process
    d, fsdp = tmp_path / "run", "parallel.fsdp=true"
    train_ranks(d, *LAYOUT, fsdp, nproc=2, patch=_dies_writing_its_optimizer_shard_of_step_4, exit_code=-signal.SIGKILL)
    assert (d / "checkpoints" / "latest").read_text().strip() == "step_000002"
    final = train_ranks(d, *LAYOUT, fsdp, nproc=2, resume=True)
    assert final["state_digest"] == ref_digest and metrics_bytes(d) == metrics_bytes(ref_dir)
    shard = d / "checkpoints" / "step_000006" / "model.rank_00001.safetensors"
    blob = bytearray(shard.read_bytes())
    blob[-3] ^= 1
    shard.write_bytes(bytes(blob))
    verify = cli_here("checkpoint", "verify", str(d))
    assert (
        verify.returncode == 1 and "model.rank_00001.safetensors: corrupt: tensor(s) '" in verify.stdout + verify.stderr
    )


def test_fsdp2_in_bf16_matches_one_process_and_its_own_reduction_differs(tmp_path):
    """A Llama in bf16 compute (fp32 gradients and reduction) sharded over 2 processes gives the 1-process
    bits. Negative control: FSDP2 with its own reduce-scatter (determinism off: every microbatch reduced
    in the collective's order and added into the shard) gives other bits on 2 and on 4 processes, and
    neither gives the canonical ones."""
    llama = (*LAYOUT, "model.arch=llama", "train.precision=bf16", "train.steps=3")
    one = train_here(tmp_path / "l1", *llama)["state_digest"]
    sharded = train_ranks(tmp_path / "l2", *llama, "parallel.fsdp=true", nproc=2)["state_digest"]
    assert one == sharded and metrics_bytes(tmp_path / "l1") == metrics_bytes(tmp_path / "l2")
    off = (*llama, "parallel.fsdp=true", "determinism.enabled=false")
    two, four = (train_ranks(tmp_path / f"w{n}", *off, nproc=n)["state_digest"] for n in (2, 4))
    assert len({two, four, one}) == 3


def test_unaligned_layout_is_refused_with_alternatives(tmp_path):
    """12 microbatches on 4 processes (3 each) is not an aligned layout: refused before any process starts
    (one line, exit 2), naming supported ones."""
    from tests.support import train_cmd

    bad = (*LAYOUT, "train.global_batch=24")
    proc = cli_here(*train_cmd(tmp_path / "run", *bad, nproc=4)[3:])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and not (tmp_path / "run").exists()
    assert "4 processes x 3 microbatches per process is not supported" in proc.stderr
    assert "--nproc 3 (4 microbatches per process)" in proc.stderr

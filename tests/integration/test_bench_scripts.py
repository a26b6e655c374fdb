"""The bench scripts run where CI does: the GPU check script's CPU-capable sections work (device time
is not spent on a broken script), and so does the worker contention bench."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import Forked

ROOT = Path(__file__).resolve().parents[2]


def _bench(script: str, *args: str, timeout: float = 600) -> Forked:
    """``python bench/<script> *args`` from the repository's root, in a process of its own (``Forked``); the
    ended process."""
    proc = Forked(list(args), script=ROOT / "bench" / script, cwd=ROOT)
    proc.wait(timeout)
    return proc


def _numbers(doc: dict, *keys: str) -> None:
    """Each of ``keys`` is in ``doc``, a finite number: the output's shape. A measured time or ratio is the
    bench's to report (docs/performance.md), not a test's to judge."""
    for key in keys:
        value = doc[key]
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), (key, value)


def test_gpu_check_runs_its_cpu_sections(tmp_path):
    """`bench/gpu_check.py --sections env,digest` on CPU: the digest section compares every case's
    digest by each path (here all on CPU) and finds no mismatch; an unknown section is reported, not
    fatal to the others."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--out", str(tmp_path), "--sections", "env,digest,nonsense"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["env"]["torch"] == __import__("torch").__version__
    d = result["digest"]
    assert d["ok"] and d["cases"] >= 20 and d["distinct_digests"] == d["cases"] and d["flipped_bit_detected"]
    assert "unknown section 'nonsense'" in result["nonsense"]["error"]


def test_worker_contention_bench_runs_both_layouts():
    """`bench_trace.worker_contention` (one round): a child digesting the reference model's state nonstop,
    in both layouts, and the training steps timed beside it."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        bench_trace = __import__("bench_trace")
        result = bench_trace.worker_contention(1, steps=1)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert result["bytes"] > 1 << 20 and result["rounds"] == 1
    _numbers(result, "slowdown_in_groups", "slowdown_all_at_once")


def test_trace_bench_times_the_recorder_calls(tmp_path):
    """`bench_trace.py --recorder-calls --own-share` (one pair of one step, small diff sets): the step
    level's time inside the recorder's calls and its share of the untraced step are reported, while the worker
    drops each batch once it is described (--own-share ran into a TypeError once unnoticed)."""
    proc = _bench(
        "bench_trace.py",
        "--levels",
        "step",
        "--pairs",
        "1",
        "--steps",
        "1",
        "--records",
        "1000",
        "--ranks",
        "2",
        "--records-per-rank",
        "10",
        "--contention-rounds",
        "0",
        "--recorder-calls",
        "--own-share",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = json.loads(proc.stdout)["trace_overhead"]["step"]
    _numbers(step, "recorder_calls_ms_per_step", "recorder_calls_share")


def test_user_loop_bench_runs_and_counts_records():
    """`bench/bench_user_loop.py` (one pair of one step, step level): a ratio, and the records each traced
    step writes (28 gradients, 28 parameters and 56 AdamW moments at least) with their cost."""
    proc = _bench("bench_user_loop.py", "--levels", "step", "--pairs", "1", "--steps", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = json.loads(proc.stdout)["step"]
    assert step["records_per_step"] >= 112
    _numbers(step, "ratio_median", "step_ms_traced")


def test_own_loop_bench_prices_run_and_each_of_its_parts():
    """`bench/bench_own_loop.py` (one pair of one step): a ratio to the plain loop for the mode and for each
    of Run's parts up to its defaults, with the step times of the Run variants (shape only, never a time)."""
    proc = _bench("bench_own_loop.py", "--pairs", "1", "--steps", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert list(out) == ["mode", "run_bare", "+receipts", "+checkpoint", "defaults"], list(out)
    _numbers(out["mode"], "ratio_median")
    for name in ("run_bare", "+receipts", "+checkpoint", "defaults"):
        _numbers(out[name], "ratio_median", "step_ms_plain", "step_ms_run")


def test_callbacks_bench_prices_each_framework_with_and_without_its_callback():
    """`bench/bench_callbacks.py` (one pair of two steps): for the HF and the Lightning Trainer, a ratio to the
    Trainer alone and each side's seconds (shape only)."""
    proc = _bench("bench_callbacks.py", "--pairs", "1", "--steps", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert list(out) == ["hf", "lightning"], list(out)
    for name in out:
        _numbers(out[name], "ratio_median", "s_plain", "s_callback")


def test_fault_harness_finds_every_outcome_as_documented(rng):
    """`bench/bench_faults.py` in a short round (1 random SIGKILL and 1 before the first checkpoint, 1 SIGTERM and
    1 SIGINT to the process group, 1 killed launcher, 1 pair of concurrent writers and a loop of one's own
    beside a trainer; tests/integration/test_train.py kills saves at their filesystem operations) and the
    whole malformed-input corpus: every resume exact, no step lost beyond the checkpoint interval, every
    input refused as documented, nothing blocking. Negative control: a case that expects the wrong outcome
    (a flipped checkpoint byte called intact) is caught by the same check."""
    proc = _bench(
        "bench_faults.py",
        "--kills",
        "1",
        "--signals",
        "1",
        "--writers",
        "1",
        "--launcher",
        "1",
        "--save-ops",
        "none",
        "--seed",
        str(rng.randrange(2**31)),
        "--json",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    r = json.loads(proc.stdout)
    for kills in (r["kills"], r["kills_before_a_checkpoint"]):
        assert kills["exact"] == kills["trials"] == 1 and kills["lost_beyond_interval"] == 0
    assert r["signals"] == r["group_signals"] == {"trials": 1, "exit_75": 1, "steps_lost": 0, "exact": 1}
    assert r["launcher"] == {"trials": 1, "ranks_stopped": 1, "saved": 1}
    assert r["writers"] == {"trials": 1, "one_refused": 1, "refusal_one_line": 1, "exact": 1, "own_loop_refused": 1}
    assert r["corpus"]["failures"] == [] and r["corpus"]["as_documented"] == r["corpus"]["cases"] >= 90
    assert r["corpus"]["control_caught"]


def test_cost_model_prices_the_combine_against_ddp():
    """`bench/cost_model.py --json`: at every rank count the canonical combine sends DDP's bytes but, started
    after the backward, exposes more time than DDP's ring; as built (all-to-alls in the backward), less, and
    with the whole combine in the backward less again, no less than one bucket's.
    A model with a free network (huge bandwidth, no latency) prices both alike: the check can tell."""

    def rows(*extra):
        proc = _bench("cost_model.py", "--json", *extra, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    for r in rows():
        assert r["canonical_exposed_ms"] > r["ddp_exposed_ms"] and r["ratio_to_ddp"] > 1.1
        assert r["canonical_overlapped_exposed_ms"] <= r["canonical_exposed_ms"]
        assert 1.0 <= r["ratio_to_ddp_overlapped"] < r["ratio_to_ddp"]
        assert 1.0 <= r["ratio_to_ddp_whole_overlap"] <= r["ratio_to_ddp_overlapped"]
    free = rows("--alpha-us", "0", "--gbps", "1e9", "--sum-gbps", "1e9")
    assert all(abs(r["ratio_to_ddp"] - 1.0) < 1e-6 for r in free)


def test_chunk_cost_model_prices_the_chunks_against_one_gemm_a_rank():
    """`bench/cost_chunks.py --json`: for the 7B and the 70B at TP 1, 2, 4 and 8, the canonical layers cost more
    than PyTorch's styles while a rank holds several chunks, less so the wider the model, and at TP 8 (one chunk
    a rank: one GEMM a projection, no sums) the same. With one chunk (TP 1 only) both run the same GEMMs and are
    priced alike: the check can tell."""

    def rows(*extra):
        proc = _bench("cost_chunks.py", "--json", *extra, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return {(r["model"], r["tp"]): r for r in json.loads(proc.stdout)}

    got = rows()
    assert set(got) == {(m, t) for m in ("7B", "70B") for t in (1, 2, 4, 8)}
    for m in ("7B", "70B"):
        assert got[m, 1]["layer_ratio"] > got[m, 2]["layer_ratio"] > got[m, 4]["layer_ratio"] > 1.0
        assert got[m, 8]["layer_ratio"] == pytest.approx(1.0)
    assert all(got["70B", t]["layer_ratio"] < got["7B", t]["layer_ratio"] for t in (1, 2, 4))
    one = rows("--chunks", "1")
    assert set(one) == {("7B", 1), ("70B", 1)} and all(r["linears_ratio"] == 1.0 for r in one.values())


def test_receipt_and_check_benches_run():
    """`bench/bench_receipts.py`, `bench/bench_checks.py` and `bench/bench_production.py` (one pair of one or two
    steps): ratios, the training thread's own time for the receipts, every side of the production bench (with
    the step-level trace's)."""
    proc = _bench("bench_receipts.py", "--pairs", "1", "--steps", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    _numbers(result, "receipts_ratio_median", "training_thread_ms")
    proc = _bench("bench_checks.py", "--every", "2", "--pairs", "1", "--steps", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    _numbers(json.loads(proc.stdout)["sdc_check_every=2"], "ratio_median")
    proc = _bench("bench_production.py", "--pairs", "1", "--steps", "1", "--trace", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result["sides"]) == {
        "plain",
        "deterministic",
        "+receipts",
        "production",
        "production+trace",
        "production+trace apart",
    }
    _numbers(result["sides"]["production"], "vs_plain")
    _numbers(result["checksum"], "ns_per_byte")
    _numbers(result["sides"]["production+trace"], "vs_production")


def _ranks_said(proc: subprocess.CompletedProcess) -> str:
    """What a torchrun'd bench printed, for a failure: whether rank 0 got to its result, and the ranks' own lines
    before torchrun's summary of the failure."""
    return f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-10000:]}"


def test_layout_bench_times_canonical_tensor_parallelism_against_pytorchs():
    """`bench/bench_layout.py --tp` on 2 processes: the reference step (1 pair, one narrow layer by ``--set``) and
    with ``--block`` one decoder block (2 pairs, a small one): both sides' step times and their ratio are reported
    (the bench that measures what canonical tensor parallelism costs against PyTorch's styles)."""
    for args in (
        ["--set", "model.n_embd=64", "--set", "model.n_layer=1", "--pairs", "1"],
        ["--block", "--pairs", "2", "--width", "64", "--seq", "16", "--batch", "2"],
    ):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                "bench/bench_layout.py",
                "--tp",
                *args,
                "--json",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0, _ranks_said(proc)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        assert r["world_size"] == 2
        _numbers(r, "step_ms_canonical", "step_ms_plain_tp", "time_ratio_median")


def test_chunks_bench_times_the_chunked_layers_against_plain_ones():
    """`bench/bench_chunks.py` (1 round of 1 step a side, at width 64 by ``--set``): both sides' step times and
    their ratio, and with ``--floor`` the two controls' (the layers' plain arithmetic, on DTensor parameters and
    on plain ones)."""
    proc = _bench("bench_chunks.py", "--pairs", "1", "--steps", "1", "--set", "model.n_embd=64", "--json", "--floor")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["chunks"] == 8 and r["set"] == ["model.n_embd=64"]
    _numbers(
        r,
        "step_ms_plain",
        "step_ms_chunked",
        "ratio_median",
        "step_ms_floor",
        "ratio_median_floor",
        "step_ms_floor_local",
        "ratio_median_floor_local",
    )


def test_mask_bench_times_the_int32_mask_against_its_int64_definition():
    """`bench/bench_mask.py` (2 calls a side): both masks' times and their ratio, after checking they agree."""
    proc = _bench("bench_mask.py", "--calls", "2", "--shape", "2", "64", "64", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["shape"] == [2, 64, 64]
    _numbers(r, "ms_int32", "ms_int64", "ratio")


def test_cost_model_prices_canonical_tensor_parallelism_against_plain():
    """`bench/cost_model.py --tp --json`: TP 2, 4 and 8 x DP 8 to 4,096; the canonical sums across tensor ranks
    cost the ring's messages and bytes plus their fixed-order sum on the device, so more than plain TP's,
    and the step more. Control: with a free device sum and no chunk cost, from TP 4 on the canonical sums
    price exactly as the ring (the model tells the sum apart from the messages)."""

    def rows(*extra):
        proc = _bench("cost_model.py", "--tp", "--json", *extra, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    priced = rows()
    assert [(r["tp"], r["dp"]) for r in priced] == [(t, d) for t in (2, 4, 8) for d in (8, 64, 512, 4096)]
    for r in priced:
        assert r["canonical_tp_sums_ms"] > r["plain_tp_sums_ms"] and r["ratio_to_plain_tp"] > 1
    for r in rows("--hbm-gbps", "1e12", "--chunk-cost", "0"):
        if r["tp"] >= 4:
            assert abs(r["canonical_tp_sums_ms"] - r["plain_tp_sums_ms"]) < 1e-6


@pytest.mark.parametrize("layout", ["--pp", "--ep"])
def test_layout_bench_times_pipeline_and_expert_parallelism_against_the_usual_sums(layout):
    """`bench/bench_layout.py --pp` and `--ep` on 2 processes (1 pair, 2 layers): both sides' step times, their
    ratio and each rank's bytes a step (the benches of what the canonical stages and experts cost)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "bench/bench_layout.py",
            layout,
            "--pairs",
            "1",
            "--set",
            "model.n_layer=2",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, _ranks_said(proc)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["layout"] == layout[2:] and r["world_size"] == 2
    _numbers(r, "step_ms_canonical", "step_ms_plain")
    assert len(r["bytes_ratio_per_rank"]) == 2
    _numbers({f"rank {i}": b for i, b in enumerate(r["bytes_ratio_per_rank"])}, "rank 0", "rank 1")


def test_cost_model_prices_pipeline_and_expert_parallelism():
    """`bench/cost_model.py --pp` and `--ep` (JSON): PP 2-8 x DP 8-512 and EP 8, 64 within DP 64-4,096. With an
    untied head the canonical stages cost their data-parallel combines only; a tied weight's rows of each
    microbatch price below its whole once a step where they are smaller. Control: a free network and no split
    cost price the canonical and the usual ways alike."""

    def rows(*extra):
        proc = _bench("cost_model.py", "--json", *extra, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    pp = rows("--pp")
    assert [(r["pp"], r["dp"]) for r in pp] == [(p, d) for p in (2, 4, 8) for d in (8, 64, 512)]
    assert all(r["ratio_to_plain_pp"] >= 1 and r["receipts_gather_ms"] > 0 for r in pp)
    tied = rows("--pp", "--tied-mb", "1000", "--tied-rows-mb", "10")
    assert all(
        t["canonical_exposed_ms"] - r["canonical_exposed_ms"] < t["plain_exposed_ms"] - r["plain_exposed_ms"]
        for r, t in zip(pp, tied)
    )
    ep = rows("--ep")
    assert [(r["ep"], r["dp"]) for r in ep] == [(g, d) for g in (8, 64) for d in (64, 512, 4096)]
    assert all(r["ratio_to_plain_ep"] > 1 for r in ep)
    free = ("--alpha-us", "0", "--gbps", "1e9", "--sum-gbps", "1e9")
    assert all(abs(r["ratio_to_plain_pp"] - 1) < 1e-6 for r in rows("--pp", *free))
    assert all(abs(r["ratio_to_plain_ep"] - 1) < 1e-6 for r in rows("--ep", *free, "--split-cost", "0"))

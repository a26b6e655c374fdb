"""Tensor parallelism in the reference run (`samestep train --set parallel.tp=N`): TP 2, TP 4 and 2 data x 2
tensor ranks (FSDP2 off and on) give the one-process bits of the same parallel.tp_chunks, gpt and llama, fp32
and bf16, dropout on; a TP-2 run killed by SIGKILL resumes at TP 4, on one process and on 2 x 2 bit for bit, and
an FSDP2 one on 2 x 2, at TP 4 and on one process; the receipts of a
run that grew hold; diff and bisect name a planted difference's tensor rank, module and op; with sequence
parallelism (parallel.sp) the same at TP 2 and 4, and across a kill. The negative controls take one mechanism
out (tests/controls.py) and run that path on one process and on the layout: the two differ."""

from __future__ import annotations

import json

import pytest

from tests.controls import plain_norm_gradients, plain_tensor_parallel_sums, resume_without_the_optimizer_unchecked
from tests.support import (
    TINY,
    cli_here,
    killed_in_step_4,
    metrics_bytes,
    run_files,
    train_cmd,
    train_here,
    train_ranks,
)

pytestmark = pytest.mark.slow

# 4 heads of 8 (TP 4: one head a rank), dropout on: the attention's mask is keyed by head position
TP = (
    *[s for s in TINY if not s.startswith(("model.n_head", "train.steps"))],
    "model.n_head=4",
    "model.dropout=0.1",
    "train.steps=4",
    "parallel.tp_chunks=8",
)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp1") / "run"
    return d, train_here(d, *TP)["state_digest"]


@pytest.mark.parametrize(
    "nproc,tp,fsdp",
    [(2, 2, False), (4, 4, False), (4, 2, False), (4, 2, True)],
    ids=["tp2", "tp4", "dp2xtp2", "fsdp-dp2xtp2"],
)
def test_tp_2_and_4_and_2_data_by_2_tensor_ranks_give_the_one_process_bits(one_process, tmp_path, nproc, tp, fsdp):
    """The final state digest and metrics.jsonl's bytes at TP 2, TP 4 and 2 data x 2 tensor ranks, FSDP2 off and
    on (each tensor rank's part sharded over the data ranks), are the one process's; run.json records the
    layout."""
    ref_dir, ref_digest = one_process
    final = train_ranks(tmp_path / "run", *TP, f"parallel.tp={tp}", f"parallel.fsdp={str(fsdp).lower()}", nproc=nproc)
    assert final["state_digest"] == ref_digest and metrics_bytes(tmp_path / "run") == metrics_bytes(ref_dir)
    layout = json.loads((tmp_path / "run" / "run.json").read_text())["layout"]
    assert layout == {
        "world_size": nproc,
        "microbatches_per_process": 4 * tp // nproc,
        "tensor_parallel": tp,
        **({"sharded": "fsdp2"} if fsdp else {}),
    }


@pytest.mark.parametrize(
    "what,nproc",
    [
        (("model.arch=llama", "model.n_kv_head=2"), 2),
        (("train.precision=bf16",), 4),
        (("model.arch=llama", "model.n_kv_head=2", "train.precision=bf16", "parallel.fsdp=true"), 4),
    ],
    ids=["llama-tp2", "bf16-dp2xtp2", "llama-bf16-fsdp-dp2xtp2"],
)
def test_llama_and_bf16_give_the_one_process_bits(tmp_path, what, nproc):
    """A Llama (grouped-query attention, its k and v one projection) at TP 2, a GPT computing in bf16 on 2
    data x 2 tensor ranks, and a Llama in bf16 under FSDP2 on 2 x 2 give the bits of one process."""
    settings = (*TP, *what, "train.steps=3")
    one = train_here(tmp_path / "one", *settings)["state_digest"]
    two = train_ranks(tmp_path / "two", *settings, "parallel.tp=2", nproc=nproc)["state_digest"]
    assert one == two and metrics_bytes(tmp_path / "one") == metrics_bytes(tmp_path / "two")


def test_a_tp_2_run_killed_resumes_at_tp_4_and_on_one_process_bit_for_bit(one_process, tmp_path):
    """Rank 1 of a TP-2 run is SIGKILLed in step 4 (the newest checkpoint: step 2). Resumed at TP 4, and from
    copies on one process and on 2 data x 2 tensor ranks, each run ends on the one-process bits; the grown
    run's receipts hold (ranks 2 and 3 keep theirs from step 3) and run.json records each segment's layout. A copy
    whose rank-1 receipts file was deleted is refused at TP 2 (the layout that wrote it), naming the file, and
    nothing in it changes; the untouched copies are the control. Negative control of the resume: a copy resumed
    at TP 4 leaving the optimizer's state out (the receipts' check of it lifted) ends elsewhere."""
    ref_dir, ref_digest = one_process
    d = tmp_path / "run"
    killed_in_step_4(d, *TP, "parallel.tp=2", nproc=2, copies=("copy", "grid", "lost", "forgot"))
    forgot = train_ranks(
        tmp_path / "forgot", *TP, "parallel.tp=4", nproc=4, resume=True, patch=resume_without_the_optimizer_unchecked
    )
    assert forgot["state_digest"] != ref_digest
    (tmp_path / "lost" / "receipts" / "rank_00001.jsonl").unlink()
    before = run_files(tmp_path / "lost")
    train_ranks(
        tmp_path / "lost", *TP, "parallel.tp=2", nproc=2, resume=True, exit_code=2, stderr=tmp_path / "lost.err"
    )
    assert (
        "lost/receipts/rank_00001.jsonl: missing, though the run kept receipts at step 2"
        in (tmp_path / "lost.err").read_text()
    )
    assert run_files(tmp_path / "lost") == before
    four = train_ranks(d, *TP, "parallel.tp=4", nproc=4, resume=True)
    one = train_here(tmp_path / "copy", *TP, resume=True)
    grid = train_ranks(tmp_path / "grid", *TP, "parallel.tp=2", nproc=4, resume=True)  # 2 data x 2 tensor ranks
    for run_dir, final in ((d, four), (tmp_path / "copy", one), (tmp_path / "grid", grid)):
        assert final["state_digest"] == ref_digest and metrics_bytes(run_dir) == metrics_bytes(ref_dir)
    resumes = json.loads((d / "run.json").read_text())["resumes"]
    assert [(r["step"], r["world_size"], r["tensor_parallel"]) for r in resumes] == [(2, 4, 4)]
    verify = cli_here("receipts", "verify", str(d))
    assert verify.returncode == 0 and "rank 2: steps 3-4" in verify.stdout, verify.stdout + verify.stderr


def test_an_fsdp2_over_tp_run_killed_resumes_on_2_x_2_at_tp_4_and_on_one_process_bit_for_bit(one_process, tmp_path):
    """FSDP2 over TP 2 on 4 processes (2 data x 2 tensor ranks), rank 1 SIGKILLed in step 4: its checkpoint of
    step 2 holds every rank's own shards (version 4). Resumed under the same layout, at TP 4 (as many shards,
    cut otherwise: its receipts are checked against the checkpoint's files) and on one process, each run ends
    on the one-process bits and its receipts verify."""
    ref_dir, ref_digest = one_process
    d, grid = tmp_path / "run", ("parallel.tp=2", "parallel.fsdp=true")
    killed_in_step_4(d, *TP, *grid, nproc=4, copies=("tp4", "one"))
    assert json.loads((d / "checkpoints" / "step_000002" / "manifest.json").read_text())["version"] == 4
    finals = {
        "grid": train_ranks(d, *TP, *grid, nproc=4, resume=True),
        "tp4": train_ranks(tmp_path / "tp4", *TP, "parallel.tp=4", nproc=4, resume=True),
        "one": train_here(tmp_path / "one", *TP, resume=True),
    }
    for name, final in finals.items():
        run_dir = d if name == "grid" else tmp_path / name
        assert final["state_digest"] == ref_digest and metrics_bytes(run_dir) == metrics_bytes(ref_dir), name
    verify = cli_here("receipts", "verify", str(d))
    assert verify.returncode == 0 and "rank 3: steps 1-4" in verify.stdout, verify.stdout + verify.stderr


def _dtensor_full_tensor() -> None:
    """The final state of FSDP2 over TP gathered by DTensor's own full_tensor."""
    from samestep.distributed import fsdp

    fsdp.whole_tensor = lambda t: t.full_tensor() if type(t).__name__ == "DTensor" else t.detach()


def test_dtensors_own_full_tensor_under_fsdp2_over_tp_gives_another_state(one_process, tmp_path):
    """Negative control of tensor_ranks_part: DTensor's own full_tensor of a tensor placed by FSDP2 over TP (the
    fused q, k, v's rows strided twice) misplaces rows, so the final state digest is not the one process's,
    though the run (its metrics) is."""
    ref_dir, ref_digest = one_process
    final = train_ranks(
        tmp_path / "run", *TP, "parallel.tp=2", "parallel.fsdp=true", nproc=4, patch=_dtensor_full_tensor
    )
    assert final["state_digest"] != ref_digest and metrics_bytes(tmp_path / "run") == metrics_bytes(ref_dir)


def test_a_receipt_chain_that_starts_late_without_a_grown_resume_is_broken(one_process, tmp_path):
    """Negative control of the grown run's receipts: a rank-1 file that starts at step 3 in a run that ran on 2
    processes from step 1 is named."""
    d = tmp_path / "run"
    train_ranks(d, *TP, "parallel.tp=2", nproc=2)
    path = d / "receipts" / "rank_00001.jsonl"
    header, *receipts = path.read_text().splitlines()
    path.write_text("\n".join([header, *receipts[2:]]) + "\n")
    verify = cli_here("receipts", "verify", str(d))
    assert verify.returncode != 0 and "rank_00001.jsonl: " in verify.stdout + verify.stderr


def _unkeyed_dropout() -> None:
    """Each rank's attention dropout drawn from the microbatch's generator over the heads it holds, as a model
    that does not key the mask by head position draws it (the rest of the attention, its contiguous operands
    included, as it is)."""
    from samestep.train import model

    model.head_dropout = lambda att, p, gen, training, n_head, first_head: model.dropout(att, p, gen, training)


def test_dropout_drawn_per_rank_from_the_generator_gives_other_bits(tmp_path):
    """Negative control of the head-keyed mask: the attention dropout drawn from the microbatch's generator over
    each rank's own heads gives other bits at TP 2 than on one process drawing it the same way."""
    one, two = (
        train_ranks(tmp_path / f"tp{tp}", *TP, f"parallel.tp={tp}", "train.steps=2", nproc=tp, patch=_unkeyed_dropout)[
            "state_digest"
        ]
        for tp in (1, 2)
    )
    assert one != two


@pytest.mark.parametrize(
    "settings,nproc,says",
    [
        (("parallel.tp=2",), 1, "parallel.tp=2 needs parallel.tp_chunks"),
        (("parallel.tp_chunks=8", "parallel.tp=3"), 1, "parallel.tp=3 does not divide parallel.tp_chunks=8"),
        (("parallel.tp_chunks=8", "parallel.tp=2"), 1, "parallel.tp=2 does not divide the 1 process(es)"),
        (("parallel.tp_chunks=8", "train.compile=true"), 1, "with train.compile=true is not supported yet"),
        (
            ("parallel.tp_chunks=8", "model.n_head=3", "model.n_embd=48", "parallel.tp=2"),
            2,
            "n_head=3 is not divisible",
        ),
        (
            ("parallel.tp_chunks=8", "parallel.sp=true", "model.block_size=36"),
            1,
            "model.block_size (parallel.sp)=36 is not divisible by parallel.tp_chunks=8",
        ),
        (
            ("parallel.tp_chunks=8", "model.vocab_size=260"),
            1,
            "model.vocab_size=260 (0: the data's) is not divisible by parallel.tp_chunks=8: the embedding and the "
            "head split by vocabulary into whole chunks. Fix: --set model.vocab_size=264",
        ),
    ],
)
def test_a_tensor_parallel_config_it_cannot_keep_on_one_path_is_refused(tmp_path, settings, nproc, says):
    """One line naming the field, the value and the fix; exit code 2 (a bad config); no run written."""
    proc = cli_here(*train_cmd(tmp_path / "run", *TINY, *settings, nproc=nproc)[3:])
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "run.json").exists()


def test_diff_names_the_op_rank_and_module_of_a_planted_difference_at_tp_2(tmp_path):
    """Two TP-2 runs traced at op level in step 3, one with one ULP planted on tensor rank 1 in the final norm's
    op: `samestep diff` names step 3, rank 1, the module and the op, and `bisect` (replaying both at TP 2 from
    step 2) the same; the pair without the plant is identical (every record, rank by rank: the same layout)."""
    from samestep.analysis.diff import diff_runs
    from samestep.replay.bisect import bisect_runs

    traced = (*TP, "parallel.tp=2", "trace.level=op", "trace.steps=3")
    target = "rank=1,step=3,microbatch=2,phase=forward,scope=transformer.ln_f,op=aten.native_layer_norm.default"
    for name, extra in (("a", ()), ("b", ()), ("planted", (f"trace.perturb={target}",))):
        train_ranks(tmp_path / name, *traced, *extra, nproc=2)
    same = diff_runs(tmp_path / "a", tmp_path / "b")
    assert same["identical"] and same["compared"]["trace_records"] > 0, same["summary"]
    planted = diff_runs(tmp_path / "a", tmp_path / "planted")
    assert planted["verdict"] == "diverged", planted["summary"]
    o = planted["origin"]
    assert o is not None, planted["summary"]
    assert (o["step"], o["rank"], o["microbatch"], o["scope"], o["op"]) == (
        3,
        1,
        2,
        "transformer.ln_f",
        "aten.native_layer_norm.default",
    ), o
    caught = bisect_runs(tmp_path / "a", tmp_path / "planted")
    o = caught["origin"]
    assert o is not None and caught["replayed_from"] == 2, caught["summary"]
    assert (o["step"], o["rank"], o["scope"], o["op"]) == (3, 1, "transformer.ln_f", "aten.native_layer_norm.default")


SP = (*TP, "parallel.sp=true")


def _dropout_per_block() -> None:
    """Each rank's dropout on its block of the sequence drawn from the microbatch's generator (no position)."""
    from samestep.train import model

    dropout = model.dropout
    model.dropout = lambda x, p, gen, training, sequence=None: dropout(x, p, gen, training)


@pytest.fixture(scope="module")
def sp_one_process(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp1") / "run"
    return d, train_here(d, *SP)["state_digest"]


def test_sequence_parallelism_at_tp_2_and_across_a_kill_resumed_at_tp_4_gives_the_one_process_bits(
    sp_one_process, tmp_path
):
    """parallel.sp=true: the norms, residual adds and dropout on each rank's block of the sequence. A TP-2 run,
    and a TP-2 run SIGKILLed in step 4 and resumed at TP 4, end on the one-process bits (final state digest,
    metrics.jsonl); a resume that turns sequence parallelism off is refused by name."""
    ref_dir, ref_digest = sp_one_process
    two = train_ranks(tmp_path / "two", *SP, "parallel.tp=2", nproc=2)
    assert two["state_digest"] == ref_digest and metrics_bytes(tmp_path / "two") == metrics_bytes(ref_dir)
    d = tmp_path / "killed"
    killed_in_step_4(d, *SP, "parallel.tp=2", nproc=2)
    four = train_ranks(d, *SP, "parallel.tp=4", nproc=4, resume=True)
    assert four["state_digest"] == ref_digest and metrics_bytes(d) == metrics_bytes(ref_dir)
    off = cli_here(*train_cmd(d, *TP, "parallel.sp=false", resume=True)[3:])
    assert off.returncode == 2 and "parallel.sp: True -> False" in off.stderr, off.stderr[-2000:]


def test_sequence_parallel_llama_in_bf16_gives_the_one_process_bits(tmp_path):
    """A Llama (RMSNorm, its norms without bias) computing in bf16 with sequence parallelism at TP 2."""
    settings = (*SP, "model.arch=llama", "model.n_kv_head=2", "train.precision=bf16", "train.steps=3")
    one = train_here(tmp_path / "one", *settings)["state_digest"]
    two = train_ranks(tmp_path / "two", *settings, "parallel.tp=2", nproc=2)["state_digest"]
    assert one == two and metrics_bytes(tmp_path / "one") == metrics_bytes(tmp_path / "two")


def test_moe_with_sequence_parallelism_at_tp_4_gives_the_one_process_bits(tmp_path):
    """A GPT whose MLPs are 16 experts, each split like the dense MLP, top-1 routing of 16 tokens a microbatch
    (so some experts get none: their layers sum empty blocks across the 4 ranks), with sequence parallelism,
    at TP 4: the bits of one process."""
    settings = (
        *SP,
        "model.moe_experts=16",
        "model.moe_top_k=1",
        "model.block_size=8",
        "model.n_layer=1",
        "train.steps=2",
    )
    one = train_here(tmp_path / "one", *settings)["state_digest"]
    four = train_ranks(tmp_path / "four", *settings, "parallel.tp=4", nproc=4)["state_digest"]
    assert one == four and metrics_bytes(tmp_path / "one") == metrics_bytes(tmp_path / "four")


@pytest.mark.parametrize(
    "what,patch,tp",
    [
        ((), plain_norm_gradients, 2),
        ((), _dropout_per_block, 2),
        (("model.arch=llama", "model.n_kv_head=2", "train.precision=bf16"), plain_norm_gradients, 2),
        (
            ("model.moe_experts=16", "model.moe_top_k=1", "model.block_size=8", "model.n_layer=1"),
            plain_tensor_parallel_sums,
            4,
        ),
    ],
    ids=["norm-sums", "dropout", "llama-bf16-norm-sums", "moe-tp4-plain-sums"],
)
def test_plain_sequence_parallel_norms_dropout_or_sums_give_other_bits(tmp_path, what, patch, tp):
    """Negative controls of the sequence-parallel claims above: with the norms' gradients summed per rank and
    all-reduced (a GPT, and a Llama's RMSNorms in bf16), with dropout drawn per rank's block from the
    generator, or, in the MoE, with every tensor-parallel layer (the experts' too) summing its chunks in turn and
    all-reducing the ranks' sums, TP 2 (the MoE: TP 4) gives other bits than one process doing the same."""
    one, many = (
        train_ranks(tmp_path / f"tp{n}", *SP, *what, "train.steps=2", f"parallel.tp={n}", nproc=n, patch=patch)[
            "state_digest"
        ]
        for n in (1, tp)
    )
    assert one != many

"""Pipeline parallelism in the reference run (`samestep train --set parallel.pp=N`): PP 2 and 4 (1F1B and GPipe)
and 2 data x 2 pipeline ranks give the one-process bits, a GPT with dropout on and its head tied to the
embedding, and a Llama MoE in bf16; a PP-2 run killed by SIGKILL resumes at PP 4, on one process and on 2 x 2 bit
for bit, and a one-process run resumes at PP 2; receipts and replay hold; pipelining's own accumulation of the
microbatches gives other bits than one process accumulating so, and so do plain tensor-parallel sums and norm
gradients inside the stages."""

from __future__ import annotations

import json

import pytest

from tests.controls import plain_norm_gradients, plain_tensor_parallel_sums, resume_without_the_optimizer_unchecked
from tests.support import TINY, cli_here, killed_in_step_4, metrics_bytes, origin_of, train_here, train_ranks

pytestmark = pytest.mark.slow

# 4 blocks (PP 4: one a stage), dropout on: each stage draws its masks from the generator its activations bring
PP = (
    *[s for s in TINY if not s.startswith(("model.n_layer", "train.steps"))],
    "model.n_layer=4",
    "model.dropout=0.1",
    "train.steps=4",
)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    d = tmp_path_factory.mktemp("pp1") / "run"
    return d, train_here(d, *PP)["state_digest"]


@pytest.mark.parametrize(
    "nproc,pp,schedule",
    [(2, 2, "1f1b"), (4, 4, "1f1b"), (4, 2, "1f1b"), (2, 2, "gpipe")],
    ids=["pp2", "pp4", "dp2xpp2", "pp2-gpipe"],
)
def test_pp_2_and_4_and_2_data_by_2_pipeline_ranks_give_the_one_process_bits(
    one_process, tmp_path, nproc, pp, schedule
):
    """The final state digest and metrics.jsonl's bytes at PP 2 and 4 under 1F1B, PP 2 under GPipe and 2 data x 2
    pipeline ranks are the one process's; run.json records the layout."""
    ref_dir, ref_digest = one_process
    final = train_ranks(tmp_path / "run", *PP, f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}", nproc=nproc)
    assert final["state_digest"] == ref_digest and metrics_bytes(tmp_path / "run") == metrics_bytes(ref_dir)
    layout = json.loads((tmp_path / "run" / "run.json").read_text())["layout"]
    assert layout == {"world_size": nproc, "microbatches_per_process": 4 * pp // nproc, "pipeline_parallel": pp}


def test_a_llama_moe_in_bf16_on_2_data_by_2_pipeline_ranks_gives_the_one_process_bits(tmp_path):
    """A Llama whose MLPs are 4 routed experts, computing in bf16 under autocast (the stages' activations cross
    in fp32, the head's logits in bf16), on 2 data x 2 pipeline ranks: the one process's bits."""
    settings = (*PP, "model.arch=llama", "model.moe_experts=4", "train.precision=bf16", "train.steps=3")
    one = train_here(tmp_path / "one", *settings)["state_digest"]
    grid = train_ranks(tmp_path / "grid", *settings, "parallel.pp=2", nproc=4)["state_digest"]
    assert one == grid and metrics_bytes(tmp_path / "one") == metrics_bytes(tmp_path / "grid")


def test_a_pp_2_run_killed_resumes_at_pp_4_on_one_process_and_on_2_x_2_bit_for_bit(one_process, tmp_path):
    """Rank 1 (the last stage) of a PP-2 run is SIGKILLed in step 4; its newest checkpoint, of step 2, holds the
    whole state, gathered from the stages. Resumed at PP 4, and from copies on one process and on 2 data x 2
    pipeline ranks, each run ends on the one-process bits; the receipts and a replay hold, and run.json records
    each segment's layout. A one-process run stopped at step 2 resumes at PP 2 on the same bits. Negative control
    of the resume: a copy resumed at PP 4 leaving the optimizer's state out (the receipts' check of it lifted)
    ends elsewhere."""
    ref_dir, ref_digest = one_process
    d = tmp_path / "run"
    killed_in_step_4(d, *PP, "parallel.pp=2", nproc=2, copies=("copy", "grid", "forgot"))
    forgot = train_ranks(
        tmp_path / "forgot", *PP, "parallel.pp=4", nproc=4, resume=True, patch=resume_without_the_optimizer_unchecked
    )
    assert forgot["state_digest"] != ref_digest
    four = train_ranks(d, *PP, "parallel.pp=4", nproc=4, resume=True)
    one = train_here(tmp_path / "copy", *PP, resume=True)
    grid = train_ranks(tmp_path / "grid", *PP, "parallel.pp=2", nproc=4, resume=True)
    train_here(tmp_path / "grown", *PP, stop_after=2)
    grown = train_ranks(tmp_path / "grown", *PP, "parallel.pp=2", nproc=2, resume=True)
    for name, final in (("run", four), ("copy", one), ("grid", grid), ("grown", grown)):
        assert final["state_digest"] == ref_digest and metrics_bytes(tmp_path / name) == metrics_bytes(ref_dir), name
    resumes = json.loads((d / "run.json").read_text())["resumes"]
    assert [(r["step"], r["world_size"], r["pipeline_parallel"]) for r in resumes] == [(2, 4, 4)]
    for name in ("run", "grown"):
        verify = cli_here("receipts", "verify", str(tmp_path / name))
        assert verify.returncode == 0 and "rank 0: steps 1-4" in verify.stdout, verify.stdout + verify.stderr
    replay = cli_here("verify", "--yes", str(d))  # its segment on 4 processes: more than 2 cores need the word
    assert replay.returncode == 0 and "equal bit for bit" in replay.stdout, replay.stdout + replay.stderr


def _plain_accumulation() -> None:
    """Each stage's gradients as pipelining leaves them: every microbatch's backward added into ``p.grad``."""
    from samestep.distributed.reduce import AllReduceGradients
    from samestep.train import trainer

    trainer.CanonicalGradients = lambda params, overlap=True, **kw: AllReduceGradients(params, **kw)


def _tied_uses_summed_apart() -> None:
    """The GPT's tied head with each use's gradients summed along the canonical tree apart and the two sums added
    at the step's end (what Megatron's embedding all-reduce gives), instead of the two uses of each microbatch
    added first."""
    import torch
    import torch.distributed as dist

    from samestep.distributed import pipeline
    from samestep.distributed.tree import BinaryCounter

    add_step = pipeline.TiedWeight.add_step

    def apart(self):
        if self.is_first:
            return add_step(self)
        uses = [BinaryCounter(), BinaryCounter()]
        for grad in self._pending:
            count = torch.empty(1, dtype=torch.int64)
            dist.recv(count, src=self.peer, group=self.group)
            index, rows = torch.empty(int(count), dtype=torch.int64), torch.empty(int(count), grad.shape[1])
            for t in (index, rows):
                dist.recv(t, src=self.peer, group=self.group)
            uses[0].push(grad)
            uses[1].push(torch.zeros_like(grad).index_copy_(0, index, rows))
        self._pending.clear()
        self.weight.grad = uses[0].result() + uses[1].result()

    pipeline.TiedWeight.add_step = apart


@pytest.mark.parametrize("patch", [_plain_accumulation, _tied_uses_summed_apart], ids=["plain", "tied-apart"])
def test_pipelinings_own_accumulation_and_a_tied_heads_uses_summed_apart_give_other_bits(tmp_path, patch):
    """Negative controls, deterministic mode on: with pipelining's plain accumulation (((m0+m1)+m2)+m3 in each
    stage's ``p.grad``), or the tied head's two uses each summed over the step apart and then added (Megatron's
    embedding all-reduce), PP 2 gives other bits than one process doing the same."""
    one, two = (
        train_ranks(tmp_path / f"pp{pp}", *PP, f"parallel.pp={pp}", "train.steps=2", nproc=pp, patch=patch)[
            "state_digest"
        ]
        for pp in (1, 2)
    )
    assert one != two


# tensor parallelism inside each stage: the one process of the same parallel.tp_chunks is the reference
TPP = (*PP, "parallel.tp_chunks=8", "train.steps=3")


def test_2_data_by_2_pipeline_by_2_tensor_ranks_give_the_one_process_bits(tmp_path):
    """`--nproc 8 --set parallel.tp=2 --set parallel.pp=2` (2 data x 2 pipeline x 2 tensor ranks; the GPT's head,
    tied to the vocabulary-split embedding, split alike on the last stage) gives the bits of one process of the
    same parallel.tp_chunks; run.json records the layout."""
    one = train_here(tmp_path / "one", *TPP)["state_digest"]
    cube = train_ranks(tmp_path / "cube", *TPP, "parallel.tp=2", "parallel.pp=2", nproc=8)["state_digest"]
    assert one == cube and metrics_bytes(tmp_path / "one") == metrics_bytes(tmp_path / "cube")
    layout = json.loads((tmp_path / "cube" / "run.json").read_text())["layout"]
    assert layout == {"world_size": 8, "microbatches_per_process": 2, "tensor_parallel": 2, "pipeline_parallel": 2}


@pytest.mark.parametrize(
    "what", [(), ("model.arch=llama", "model.n_kv_head=2", "train.precision=bf16")], ids=["gpt", "llama-bf16"]
)
def test_sequence_parallelism_inside_pipeline_stages_gives_the_one_process_bits(tmp_path, what):
    """`parallel.sp=true` on 2 pipeline x 2 tensor ranks: the stages pass each tensor rank's block of positions
    (the Llama's rotary tables told the whole length), and the run gives the bits of one process with sequence
    parallelism, a GPT (tied head) and a Llama in bf16."""
    settings = (*TPP, "parallel.sp=true", *what)
    one = train_here(tmp_path / "one", *settings)["state_digest"]
    grid = train_ranks(tmp_path / "grid", *settings, "parallel.tp=2", "parallel.pp=2", nproc=4)["state_digest"]
    assert one == grid and metrics_bytes(tmp_path / "one") == metrics_bytes(tmp_path / "grid")


@pytest.mark.parametrize(
    "what,patch,nproc",
    [
        ((), plain_tensor_parallel_sums, 8),
        (("parallel.sp=true",), plain_norm_gradients, 4),
    ],
    ids=["2x2x2-plain-sums", "sp-in-stages-norm-sums"],
)
def test_plain_sums_or_norm_gradients_inside_pipeline_stages_give_other_bits(tmp_path, what, patch, nproc):
    """Negative controls of the two claims above: with the tensor-parallel layers summing their chunks in turn
    and all-reducing the ranks' sums, 2 data x 2 pipeline x 2 tensor ranks, and with the sequence-parallel norms'
    gradients summed per rank and all-reduced, 2 pipeline x 2 tensor ranks, give other bits than one process
    doing the same."""
    settings = (*TPP, *what, "train.steps=1")
    one = train_ranks(tmp_path / "one", *settings, nproc=1, patch=patch)["state_digest"]
    many = train_ranks(tmp_path / "many", *settings, "parallel.tp=2", "parallel.pp=2", nproc=nproc, patch=patch)
    assert one != many["state_digest"]


def test_a_llama_in_bf16_moves_between_tp_2_by_pp_2_and_tp_2_bit_for_bit(tmp_path):
    """A Llama in bf16 stopped at step 2 at TP 2 (each rank's shards checkpointed) resumes on 2 pipeline x 2
    tensor ranks, and one stopped there (the whole state checkpointed) resumes at TP 2: both end on the one
    process's bits, and their receipts hold (rank 1 keeps receipts only where it holds shards)."""
    settings = (*TPP, "model.arch=llama", "model.n_kv_head=2", "train.precision=bf16", "train.steps=4")
    one = train_here(tmp_path / "one", *settings)["state_digest"]
    train_ranks(tmp_path / "grow", *settings, "parallel.tp=2", nproc=2, stop_after=2)
    grown = train_ranks(tmp_path / "grow", *settings, "parallel.tp=2", "parallel.pp=2", nproc=4, resume=True)
    train_ranks(tmp_path / "shrink", *settings, "parallel.tp=2", "parallel.pp=2", nproc=4, stop_after=2)
    shrunk = train_ranks(tmp_path / "shrink", *settings, "parallel.tp=2", nproc=2, resume=True)
    for name, final in (("grow", grown), ("shrink", shrunk)):
        assert final["state_digest"] == one and metrics_bytes(tmp_path / name) == metrics_bytes(tmp_path / "one")
        verify = cli_here("receipts", "verify", str(tmp_path / name))
        assert verify.returncode == 0, verify.stdout + verify.stderr


def test_bisect_names_the_op_and_pipeline_stage_where_two_pipelined_runs_differ(tmp_path):
    """Two PP-2 runs traced alike at op level in step 2, one with one ULP planted in the last stage's final
    norm's backward: `samestep diff` finds the receipts apart at step 2, and `samestep bisect` replays step 2 from
    a checkpoint on the same layout, both runs at op level, and names the op, module, microbatch and rank, and
    where the rank sits (data rank 0, pipeline stage 1); the first stage's records differ only from what it was
    sent back. Control: the pair traced alike without the plant is identical to diff and to bisect. (A diff of
    two traced EP runs names the op and its rank's place: test_ep_training.py.)"""
    traced = (*PP, "parallel.pp=2", "train.steps=3", "train.checkpoint_every=1", "trace.level=op", "trace.steps=2")
    plant = (
        "trace.perturb=rank=1,step=2,microbatch=1,phase=backward,scope=transformer.ln_f,"
        "op=aten.native_layer_norm_backward.default",
    )
    for name, extra in (("a", ()), ("same", ()), ("b", plant)):
        train_ranks(tmp_path / name, *traced, *extra, nproc=2)
    same = cli_here("bisect", str(tmp_path / "a"), str(tmp_path / "same"), "--json")
    assert same.returncode == 0 and json.loads(same.stdout)["identical"], same.stdout + same.stderr
    diff = cli_here("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    assert diff.returncode != 0 and json.loads(diff.stdout)["first_divergent_step"] == 2, diff.stdout + diff.stderr
    doc, origin = origin_of(cli_here("bisect", str(tmp_path / "a"), str(tmp_path / "b"), "--json"))
    assert origin == (2, 1, 1, "transformer.ln_f", "aten.native_layer_norm_backward.default"), origin
    assert "rank 1 (data rank 0, pipeline stage 1)" in doc["summary"], doc["summary"]
    received = doc["per_rank"]["0"]["divergence"]  # the first stage: the gradients it was sent back
    assert received["kind"] != "origin" and (received["step"], received["microbatch"]) == (2, 1), received


def test_receipts_hold_where_a_run_moves_from_rank_0s_receipts_to_every_ranks(one_process, tmp_path):
    """An unsharded run on 2 data ranks (rank 0 alone keeps receipts, of the whole state, as a pipeline's and
    expert parallelism's do) stopped at step 2 and resumed under FSDP2 (every rank keeps receipts of its shards):
    the run ends on the bits of one process and its receipts hold, rank 1's from step 3. (A pipeline's moves to
    TP 2 and to FSDP2: the tests above.) Negative control: the same rank 1 receipts in a run that did not resume
    there are refused."""
    train_ranks(tmp_path / "run", *PP, nproc=2, stop_after=2)
    final = train_ranks(tmp_path / "run", *PP, "parallel.fsdp=true", nproc=2, resume=True)
    assert final["state_digest"] == one_process[1]
    verify = cli_here("receipts", "verify", str(tmp_path / "run"))
    assert verify.returncode == 0 and "rank 1: steps 3-4" in verify.stdout, verify.stdout + verify.stderr
    doc = json.loads((tmp_path / "run" / "run.json").read_text())
    doc["resumes"] = []  # as if the run had started under FSDP2
    (tmp_path / "run" / "run.json").write_text(json.dumps(doc))
    forged = cli_here("receipts", "verify", str(tmp_path / "run"))
    assert forged.returncode != 0 and "starts at step 3, not 1" in forged.stdout + forged.stderr


def test_fsdp2_over_pipeline_stages_gives_the_one_process_bits_and_moves_to_and_from_fsdp2(tmp_path):
    """A Llama in bf16 on 2 data x 2 pipeline ranks with FSDP2 (each stage's parameters sharded over its data
    ranks, its reduce-scatter the canonical one) stopped at step 2 resumes under FSDP2 on 2 processes, and one
    stopped under FSDP2 resumes on 2 x 2 with FSDP2: both end on the one process's bits, receipts holding."""
    settings = (*PP, "model.arch=llama", "train.precision=bf16", "parallel.fsdp=true")
    one = train_here(tmp_path / "one", *settings)["state_digest"]
    grid = ("parallel.pp=2",)
    train_ranks(tmp_path / "shrink", *settings, *grid, nproc=4, stop_after=2)
    shrunk = train_ranks(tmp_path / "shrink", *settings, nproc=2, resume=True)
    train_ranks(tmp_path / "grow", *settings, nproc=2, stop_after=2)
    grown = train_ranks(tmp_path / "grow", *settings, *grid, nproc=4, resume=True)
    for name, final in (("shrink", shrunk), ("grow", grown)):
        assert final["state_digest"] == one and metrics_bytes(tmp_path / name) == metrics_bytes(tmp_path / "one")
        verify = cli_here("receipts", "verify", str(tmp_path / name))
        assert verify.returncode == 0, verify.stdout + verify.stderr

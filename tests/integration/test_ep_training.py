"""Expert parallelism in the reference run (`samestep train --set parallel.ep=N`): a Llama MoE with dropout on at
EP 2 and 4 and on 2 groups of EP 2, and a GPT MoE in bf16 at EP 2, give the one-process bits; an EP-2 run killed
by SIGKILL resumes at EP 4, on one process and on 2 x EP 2 bit for bit, and its receipts and a replay hold; an
expert gradient summed in each source rank's arrival order gives other bits."""

from __future__ import annotations

import json

import pytest

from tests.controls import resume_without_the_optimizer_unchecked
from tests.support import TINY, cli_here, killed_in_step_4, metrics_bytes, origin_of, train_here, train_ranks

pytestmark = pytest.mark.slow

# 4 experts, top 2, dropout on (the Llama draws it on each block's output, none inside its experts)
EP = (
    *[s for s in TINY if not s.startswith("train.steps")],
    "model.arch=llama",
    "model.moe_experts=4",
    "model.dropout=0.1",
    "train.steps=4",
)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    d = tmp_path_factory.mktemp("ep1") / "run"
    return d, train_here(d, *EP)["state_digest"]


@pytest.mark.parametrize("nproc,ep", [(2, 2), (4, 4), (4, 2)], ids=["ep2", "ep4", "2xep2"])
def test_ep_2_and_4_and_2_groups_of_ep_2_give_the_one_process_bits(one_process, tmp_path, nproc, ep):
    """The final state digest and metrics.jsonl's bytes at EP 2 and 4, and on 2 groups of 2 (each expert on 2
    ranks, its replicas' trees combined as data ranks' are), are the one process's; run.json records the
    layout."""
    ref_dir, ref_digest = one_process
    final = train_ranks(tmp_path / "run", *EP, f"parallel.ep={ep}", nproc=nproc)
    assert final["state_digest"] == ref_digest and metrics_bytes(tmp_path / "run") == metrics_bytes(ref_dir)
    layout = json.loads((tmp_path / "run" / "run.json").read_text())["layout"]
    assert layout == {"world_size": nproc, "microbatches_per_process": 4 // nproc, "expert_parallel": ep}


def test_a_gpt_moe_in_bf16_at_ep_2_gives_the_one_process_bits(tmp_path):
    """A GPT whose MLPs are 4 routed experts, in bf16 under autocast (dropout off: its experts draw masks in
    expert order from one generator, refused under EP), at EP 2: the one process's bits."""
    settings = (
        *[s for s in EP if not s.startswith("model.")],
        "model.moe_experts=4",
        "model.dropout=0",
        "train.precision=bf16",
        "train.steps=3",
    )
    one = train_here(tmp_path / "one", *settings)["state_digest"]
    two = train_ranks(tmp_path / "two", *settings, "parallel.ep=2", nproc=2)["state_digest"]
    assert one == two and metrics_bytes(tmp_path / "one") == metrics_bytes(tmp_path / "two")


def test_an_ep_2_run_killed_resumes_at_ep_4_on_one_process_and_on_2_x_ep_2_bit_for_bit(one_process, tmp_path):
    """Rank 1 of an EP-2 run is SIGKILLed in step 4; its checkpoint of step 2 holds the whole state (the experts
    gathered from their ranks). Resumed at EP 4, and from copies on one process and on 2 groups of EP 2, each
    run ends on the one-process bits; the receipts and a replay hold, and run.json records each segment.
    Negative control of the resume: a copy resumed at EP 4 leaving the optimizer's state out (the receipts'
    check of it lifted) ends elsewhere."""
    ref_dir, ref_digest = one_process
    d = tmp_path / "run"
    killed_in_step_4(d, *EP, "parallel.ep=2", nproc=2, copies=("copy", "grid", "forgot"))
    forgot = train_ranks(
        tmp_path / "forgot", *EP, "parallel.ep=4", nproc=4, resume=True, patch=resume_without_the_optimizer_unchecked
    )
    assert forgot["state_digest"] != ref_digest
    finals = {
        "run": train_ranks(d, *EP, "parallel.ep=4", nproc=4, resume=True),
        "copy": train_here(tmp_path / "copy", *EP, resume=True),
        "grid": train_ranks(tmp_path / "grid", *EP, "parallel.ep=2", nproc=4, resume=True),
    }
    for name, final in finals.items():
        assert final["state_digest"] == ref_digest and metrics_bytes(tmp_path / name) == metrics_bytes(ref_dir), name
    resumes = json.loads((d / "run.json").read_text())["resumes"]
    assert [(r["step"], r["world_size"], r["expert_parallel"]) for r in resumes] == [(2, 4, 4)]
    verify = cli_here("receipts", "verify", str(d))
    assert verify.returncode == 0 and "rank 0: steps 1-4" in verify.stdout, verify.stdout + verify.stderr
    replay = cli_here("verify", "--yes", str(d))  # its segment on 4 processes: more than 2 cores need the word
    assert replay.returncode == 0 and "equal bit for bit" in replay.stdout, replay.stdout + replay.stderr


def _arrival_order() -> None:
    """Each expert gradient summed as it arrives from each source rank, one microbatch after another (what
    autograd's accumulation into ``p.grad`` gives), instead of along the canonical tree."""
    from samestep.distributed import expert_parallel

    class Running:
        def __init__(self):
            self.acc = None

        def push(self, leaf, size=1):
            self.acc = leaf if self.acc is None else self.acc + leaf

        def result(self):
            acc, self.acc = self.acc, None
            return acc

        def clear(self):
            self.acc = None

    expert_parallel.BinaryCounter = Running


def test_expert_gradients_summed_in_arrival_order_give_other_bits(tmp_path):
    """Negative control of the experts' trees: 8 microbatches, 4 a rank, each expert's gradient summed
    ((m0+m1)+m2)+m3 per source instead of (m0+m1)+(m2+m3): EP 2 leaves the one-process bits (the shared
    parameters' trees as before)."""
    settings = (*EP, "train.global_batch=16", "train.steps=3")
    one = train_here(tmp_path / "one", *settings)["state_digest"]
    plain = train_ranks(tmp_path / "plain", *settings, "parallel.ep=2", nproc=2, patch=_arrival_order)
    assert plain["state_digest"] != one


def test_diff_names_the_op_and_expert_rank_where_two_expert_parallel_runs_differ(tmp_path):
    """Two EP-2 runs traced at op level in step 2, one with one ULP planted in rank 1's first router in
    microbatch 3:
    `samestep diff` names that op, rank and microbatch as the origin, and where rank 1 sits (data rank 1,
    expert rank 1 of group 0); rank 0's records hold no origin."""
    settings = (*EP, "parallel.ep=2", "train.steps=2", "trace.level=op", "trace.steps=2")
    train_ranks(tmp_path / "a", *settings, nproc=2)
    train_ranks(
        tmp_path / "b",
        *settings,
        "trace.perturb=rank=1,step=2,microbatch=3,phase=forward,scope=layers.0.mlp.router,op=aten.mm.default",
        nproc=2,
    )
    doc, origin = origin_of(cli_here("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"))
    assert origin == (2, 1, 3, "layers.0.mlp.router", "aten.mm.default"), origin
    other = doc["per_rank"]["0"]  # no origin there: at most what the all-to-all brought it
    assert other["records_compared"] > 0 and (other["divergence"] or {}).get("kind") != "origin", other
    assert "rank 1 at step 2 is data rank 1, expert rank 1 of group 0 of the layout that wrote it" in doc["notes"]

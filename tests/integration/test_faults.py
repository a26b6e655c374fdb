"""Fault detection while training (train/checks.py) against faults planted by train/faults.py."""

from __future__ import annotations

import json
import re

import pytest

from tests.support import TINY, side_by_side, train_here, train_ranks

pytestmark = pytest.mark.slow

LN_F = "module=transformer.ln_f"  # a layer norm keeps its input, not its output, for backward
PARAM = "name=transformer.h.0.mlp.c_fc.weight"


def _train(run_dir, *settings, code: int = 0, nproc: int = 2) -> tuple[str, str | None]:
    """A run on ``nproc`` ranks that must end with exit code ``code`` (``train_ranks`` fails the test
    otherwise): its ranks' stderr, and the final state digest (None without final.json)."""
    stderr = run_dir.parent / f"{run_dir.name}.stderr"
    final = train_ranks(run_dir, *settings, nproc=nproc, exit_code=code or None, stderr=stderr)
    return stderr.read_text() if stderr.exists() else "", final and final["state_digest"]


def test_checks_raise_no_false_alarm_and_change_no_bit(tmp_path):
    """Both checks on every step of a clean 2-process run: no alarm, and the final digest and metrics bytes of
    the run without them (the recompute and the comparisons observe, never perturb)."""
    (err, checked), (err_b, plain) = side_by_side(
        lambda: _train(tmp_path / "checked", *TINY, "train.sdc_check_every=1"),
        lambda: _train(tmp_path / "plain", *TINY, "train.cross_rank_check=false"),
    )
    assert checked is not None and plain is not None, err + err_b  # both exited 0 (train_ranks checks)
    assert checked == plain
    assert (tmp_path / "checked" / "metrics.jsonl").read_bytes() == (tmp_path / "plain" / "metrics.jsonl").read_bytes()


def test_recompute_check_names_a_transient_fault(tmp_path, tiny_run):
    """One bit of one module's output flipped once, on rank 1 at step 3 in microbatch 2 (the one rank 1
    checks): the run stops with exit 4 on every rank, naming the step, microbatch, rank and first gradient,
    and the newest checkpoint before it. Control: without the check the same fault passes silently and
    changes the run."""
    fault = f"train.fault=output:rank=1,step=3,microbatch=2,{LN_F},bit=20"
    (err, final), (err_c, silent) = side_by_side(
        lambda: _train(tmp_path / "checked", *TINY, "train.sdc_check_every=1", fault, code=4),
        lambda: _train(tmp_path / "unchecked", *TINY, fault),
    )
    assert final is None, err  # and a rank exited 4 (train_ranks checks)
    assert "recompute check at step 3, microbatch 2 on rank 1: its loss differs" in err
    assert "gradients differ, first" in err and "the newest checkpoint before it is step_000002" in err
    assert silent is not None, err_c
    clean = json.loads((tiny_run / "final.json").read_text())["state_digest"]  # 2 processes give these bits
    assert silent != clean


@pytest.mark.parametrize(
    "kind,what",
    [
        ("param", "the parameter 'transformer.h.0.mlp.c_fc.weight' differs after the update"),
        ("grad", "the reduced gradient 'transformer.h.0.mlp.c_fc.weight' differs"),
    ],
)
def test_cross_rank_check_names_a_rank_whose_memory_changed(tmp_path, kind, what):
    """A bit flipped in one rank's parameter after step 3's update, or in its reduced gradient: the cross-rank
    check stops the run at that step (exit 4), naming the tensor."""
    err, final = _train(tmp_path / "run", *TINY, f"train.fault={kind}:rank=1,step=3,{PARAM},bit=20", code=4)
    assert final is None, err  # and a rank exited 4 (train_ranks checks)
    assert "cross-rank check at step 3: rank 1 and rank 0 disagree" in err and what in err, err


# 2 data x 2 tensor ranks: ranks 0 and 2 hold tensor rank 0's shards, ranks 1 and 3 tensor rank 1's
TP = (*[s for s in TINY if not s.startswith("model.n_head")], "model.n_head=4", "parallel.tp_chunks=8", "parallel.tp=2")


def test_under_tensor_parallelism_each_tensor_ranks_data_ranks_compare_and_recompute_together(tmp_path):
    """Both checks on every step of a run on 2 data x 2 tensor ranks. A bit flipped in rank 3's shard of a
    parameter after step 3's update stops every rank at that step (exit 4), naming ranks 3 and 1 (the data
    ranks that hold that shard) and the parameter; a bit flipped in an output on rank 1 in microbatch 0 is
    named by the recompute check, which a data rank's tensor ranks run together, and the other data rank's
    recompute agrees (each rank compares its own shards: DTensor's equal is a collective). Control: the clean
    run raises no alarm and ends on the bits of one process without the checks."""
    checks = ("train.sdc_check_every=1",)
    (err_p, stopped), (err_o, caught), (err_c, clean) = side_by_side(
        lambda: _train(
            tmp_path / "param", *TP, *checks, f"train.fault=param:rank=3,step=3,{PARAM},bit=20", code=4, nproc=4
        ),
        lambda: _train(
            tmp_path / "output",
            *TP,
            *checks,
            f"train.fault=output:rank=1,step=3,microbatch=0,{LN_F},bit=20",
            code=4,
            nproc=4,
        ),
        lambda: _train(tmp_path / "clean", *TP, *checks, nproc=4),
    )
    assert stopped is None and caught is None, err_p + err_o
    assert (
        "cross-rank check at step 3: rank 3 and rank 1 disagree (no majority of 2 ranks tells which is wrong): "
        "the parameter 'transformer.h.0.mlp.c_fc.weight' differs after the update"
    ) in err_p, err_p
    assert err_p.count("fault detected: cross-rank check at step 3") == 4, err_p  # every rank stops there
    # the flip shows in the loss bits or only in the gradients, as the data's values fall (the stdlib corpus is
    # this interpreter's own source): either way the rank that made it is named at its microbatch
    assert re.search(
        r"recompute check at step 3, microbatch 0 on rank 1: (its loss differs|\d+ of \d+ gradients "
        r"differ)",
        err_o,
    ), err_o
    assert "microbatch 2 on rank" not in err_o, err_o  # the other data rank's recompute agrees: shards compared alone
    one = train_here(tmp_path / "one", *[s for s in TP if s != "parallel.tp=2"], "train.cross_rank_check=false")
    assert clean == one["state_digest"], err_c

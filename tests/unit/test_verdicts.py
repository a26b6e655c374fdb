"""Verdicts never overstate: a diff that compared nothing is not "identical", a level without inputs names
no origin, a step that did not finish is not complete, and what changes numerics is recorded and compared."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import samestep
from samestep.analysis import DiffError, certify_trace, diff_runs
from samestep.cli import main


def _loop(
    run: Path,
    *,
    level: str = "step",
    steps: str | None = None,
    scale: float = 1.0,
    last: int = 3,
    resume: bool = False,
    first: int = 1,
    fail_at: int | None = None,
    between=None,
) -> None:
    """A small loop of the user's own, traced with samestep.trace: steps ``first`` to ``last``; ``scale``
    changes its inputs (a real difference); ``fail_at`` raises inside that step; ``between(step)`` runs
    before each step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = samestep.trace(run, level=level, steps=steps, worker="thread", resume=resume)
    rec.attach(model)
    try:
        for step in range(first, last + 1):
            if between is not None:
                between(step)
            with rec.step(step):
                for mb in (0, 1):
                    with rec.microbatch(mb):
                        model(torch.full((2, 4), scale * (mb + step))).sum().backward()
                if step == fail_at:
                    raise RuntimeError("the loop failed inside the step")
                rec.grads(model.named_parameters())
                opt.step()
                opt.zero_grad(set_to_none=True)
                rec.state(model, opt)
    finally:
        rec.close()


@pytest.fixture
def deterministic():
    with samestep.enable(threads=1):
        yield


def test_a_diff_that_compared_nothing_is_not_identical(tmp_path, deterministic, capsys):
    """Two runs that really differ, traced on steps that do not overlap (no metrics, no final state): the
    verdict is "nothing compared", not identical, and the command exits 2. Negative control: traced on
    the same steps, the same pair diverges (exit 1), and an identical pair still says identical (exit 0)."""
    _loop(tmp_path / "a", steps="1-2")
    _loop(tmp_path / "b", steps="3", scale=2.0)
    report = diff_runs(tmp_path / "a", tmp_path / "b")
    assert report["verdict"] == "nothing compared" and not report["identical"]
    assert report["compared"] == {
        "metric_steps": 0,
        "trace_records": 0,
        "ranks": 1,
        "final_state": False,
        "receipt_steps": 0,
        "receipt_states": False,
        "steps": "",
        "steps_held": "",
    }
    assert report["summary"].startswith("nothing compared:") and "no evidence" in report["summary"]
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    _loop(tmp_path / "c", steps="1-2", scale=2.0)
    assert diff_runs(tmp_path / "a", tmp_path / "c")["verdict"] == "diverged"
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    _loop(tmp_path / "d", steps="1-2")
    same = diff_runs(tmp_path / "a", tmp_path / "d")
    assert same["verdict"] == "identical" and same["compared"]["trace_records"] > 0
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "d")]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("level", ["step", "module"])
def test_levels_without_inputs_name_where_a_difference_was_seen_not_an_origin(tmp_path, deterministic, level):
    """At step and module level the records have no inputs: the diff names the first differing record as
    "first_seen" (no origin), says why, counts the records that differ at that step, and points at op
    level. Negative control: the same pair traced at op level names an origin whose inputs matched."""
    _loop(tmp_path / "a", level=level)
    _loop(tmp_path / "b", level=level, scale=2.0)
    report = diff_runs(tmp_path / "a", tmp_path / "b")
    first = report["first_difference"]
    assert report["origin"] is None and first["kind"] == "first_seen" and first["inputs_matched"] is None
    assert report["first_seen"] == first and report["summary"].startswith(
        "diverged at step 1: first difference seen: step 1, rank 0"
    )
    assert first["step"] == 1 and first["op"] == ("grad" if level == "step" else "output")
    assert "have no inputs" in first["note"] and "not a proven origin" in first["note"]
    assert "--set trace.level=op --set trace.steps=1" in first["note"]
    assert "this op is the origin" not in report["summary"]
    differing = int(first["note"].split(" record(s) differ")[0].rsplit("; ", 1)[1])
    assert differing > 1
    _loop(tmp_path / "opa", level="op")
    _loop(tmp_path / "opb", level="op", scale=2.0)
    op = diff_runs(tmp_path / "opa", tmp_path / "opb")
    assert op["origin"] is not None and op["origin"]["inputs_matched"] is True and op["origin"]["kind"] == "origin"


def test_tracing_into_a_traced_run_needs_resume_and_records_it(tmp_path):
    """A second samestep.trace() into a run directory that holds a trace is refused (nothing written); with
    resume=True the stream gets a new segment and run.json a resume record naming what differs from the
    run's start: under another thread count, the environment field and the knob. Negative control:
    resumed as it started, the record names nothing."""
    run = tmp_path / "run"
    with samestep.enable(threads=1):
        _loop(run, last=2)
        before = (run / "run.json").read_bytes()
        with pytest.raises(ValueError, match=r"already holds a trace .*pass resume=True"):
            _loop(run, first=3, last=4)
        assert (run / "run.json").read_bytes() == before
        _loop(run, first=3, last=4, resume=True)
    with samestep.enable(threads=2):
        _loop(run, first=5, last=5, resume=True)
    resumes = json.loads((run / "run.json").read_text())["resumes"]
    assert [(r["segment"], r["env_diff"], r["determinism_diff"]) for r in resumes] == [
        (1, [], []),
        (2, ["threads.intra_op"], ["torch.num_threads"]),
    ]
    assert sorted(p.name for p in (run / "trace").iterdir()) == [
        "rank_00000.1.arrows",
        "rank_00000.2.arrows",
        "rank_00000.arrows",
    ]


@pytest.mark.parametrize("level", ["step", "module"])
def test_a_step_that_did_not_finish_is_not_complete(tmp_path, deterministic, level):
    """A loop that raised inside step 2: certify names the step (at module level its records were
    written, without the step.end record that closes a finished step); resumed and finished, it
    certifies. A trace whose recorder was never closed (the run killed) is not complete either. Negative
    control: the same loop run to its end certifies complete."""
    with pytest.raises(RuntimeError, match="failed inside the step"):
        _loop(tmp_path / "failed", level=level, fail_at=2)
    cert = certify_trace(tmp_path / "failed")
    unfinished = (
        ["rank 0: step(s) 2 did not finish (no step.end record: the step raised, or the run was killed in it)"]
        if level == "module"
        else []
    )
    assert not cert["complete"]
    assert cert["problems"] == [*unfinished, "step 2 raised (segment 0): the run did not finish it"]
    _loop(tmp_path / "failed", level=level, first=2, resume=True)  # resumed: step 2 re-run and finished
    assert certify_trace(tmp_path / "failed")["complete"]
    _loop(tmp_path / "whole", level=level)
    assert certify_trace(tmp_path / "whole")["complete"]
    doc = json.loads((tmp_path / "whole" / "run.json").read_text())
    del doc["closes"]  # as if the process had been killed before its recorder closed
    (tmp_path / "whole" / "run.json").write_text(json.dumps(doc))
    assert certify_trace(tmp_path / "whole")["problems"] == [
        "rank 0's trace segment 0 was not closed: the run was killed, or is still running, so steps after its "
        "last recorded one may be missing"
    ]


def test_what_changes_numerics_is_recorded_and_compared(tmp_path):
    """enable(kernels=True) against enable(): diff refuses, naming samestep.kernels. A loop that turns
    deterministic algorithms off after enable(): run.json records the step and knob, certify reports it,
    diff refuses. samestep.trace() started before enable(): diff's refusal says so plainly. Negative
    control: two runs under the same enable() compare (identical)."""
    with samestep.enable(threads=1):
        _loop(tmp_path / "plain")
        _loop(tmp_path / "same")
    with samestep.enable(threads=1, kernels=True):
        _loop(tmp_path / "kernels")
    assert diff_runs(tmp_path / "plain", tmp_path / "same")["identical"]
    with pytest.raises(DiffError, match=r"deterministic modes differ: samestep\.kernels \(False vs True\)"):
        diff_runs(tmp_path / "plain", tmp_path / "kernels")

    def turn_off(step: int) -> None:
        if step == 2:
            torch.use_deterministic_algorithms(False)

    with samestep.enable(threads=1):
        with pytest.warns(RuntimeWarning, match=r"at step 2 deterministic mode no longer holds"):
            _loop(tmp_path / "turned", between=turn_off)
    doc = json.loads((tmp_path / "turned" / "run.json").read_text())
    # torch.use_deterministic_algorithms(False) turns Inductor's deterministic mode off too
    assert doc["determinism_changed"] == {
        "step": 2,
        "knobs": {
            "torch.use_deterministic_algorithms": [True, False],
            "torch._inductor.config.deterministic": [True, False],
        },
    }
    assert any(
        "deterministic mode stopped holding at step 2" in p for p in certify_trace(tmp_path / "turned")["problems"]
    )
    with pytest.raises(DiffError, match="changed during the run"):
        diff_runs(tmp_path / "plain", tmp_path / "turned")

    _loop(tmp_path / "late")  # traced before any enable()
    with pytest.raises(
        DiffError,
        match=r"Run B recorded no deterministic mode: its samestep\.trace\(\) started "
        r"before samestep\.enable\(\)",
    ):
        diff_runs(tmp_path / "plain", tmp_path / "late")


@pytest.mark.parametrize(
    "content,needle",
    [
        ("[]", "run.json: is list, expected a table"),
        ("null", "run.json: is NoneType, expected a table"),
        (b"\xff\xfe", "run.json: not valid JSON"),
        ('{"format": "samestep.run", "version": 1, "layout": {"world_size": "two"}}', "a world_size is 'two'"),
        ('{"format": "samestep.run", "version": 1, "config": 5}', "'config' is 5, expected a dict"),
        (
            '{"format": "samestep.run", "version": 99}',
            "version 99 of format 'samestep.run'; this samestep reads versions 1 to 1",
        ),
        ('{"format": "samestep.run"}', "version None of format 'samestep.run'"),
    ],
)
def test_a_malformed_run_json_is_one_line_naming_it(tmp_path, content, needle):
    """run.json that is no table, not UTF-8, has a non-numeric world size, or a format version this samestep does
    not know (or none): diff and certify refuse with one line naming the file (exit 2), no traceback. Negative
    control: a well-formed one is read."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DiffError, match=needle):
        certify_trace(run)
    assert main(["diff", str(run), str(run)]) == 2
    (run / "run.json").write_text('{"format": "samestep.run", "version": 1, "layout": {"world_size": 2}}')
    assert certify_trace(run)["ranks"] == {}


@pytest.mark.parametrize(
    "line,needle",
    [
        ("[1, 2]", "metrics.jsonl:2: '[1, 2]' is not a metrics row"),
        ('{"step": "2"}', 'metrics.jsonl:2: \'{"step": "2"}\' is not a metrics row'),
        ("garbage", "metrics.jsonl:2: not valid JSON; only the last line may be torn"),
    ],
)
def test_a_damaged_metrics_line_is_named_and_a_resume_refuses_to_cut_there(tmp_path, line, needle):
    """A metrics.jsonl line that is a list, has a string step, or is garbage before the last line: diff
    names the file and line; a resume refuses to cut the file there (every later step would be lost).
    Negative control: a torn last line alone is a killed run's, and the rows before it are read."""
    from samestep.records.metrics import read_metrics, truncate_metrics
    from samestep.records.rundir import RunDirError

    run = tmp_path / "run"
    run.mkdir()
    good = ['{"step": 1, "loss_hex": "0x1p+0"}', '{"step": 3, "loss_hex": "0x1p+0"}']
    (run / "metrics.jsonl").write_text("\n".join([good[0], line, good[1]]) + "\n")
    with pytest.raises(RunDirError, match=re.escape(needle)):
        read_metrics(run)
    with pytest.raises(RunDirError):
        truncate_metrics(run, 3)
    assert (run / "metrics.jsonl").read_text().count("\n") == 3  # nothing cut
    (run / "metrics.jsonl").write_text(good[0] + "\n" + '{"step": 2, "loss_hex": "0x1p+0"}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    truncate_metrics(run, 2)
    assert [r["step"] for r in read_metrics(run)] == [1, 2]


def test_a_gap_in_the_metrics_refuses_the_resume(tmp_path):
    """Metrics that lack a step before the checkpoint's: the resume refuses, naming the missing step.
    Negative control: contiguous steps are cut back to the checkpoint's."""
    from samestep.records.metrics import read_metrics, truncate_metrics
    from samestep.records.rundir import RunDirError

    run = tmp_path / "run"
    run.mkdir()
    rows = "".join(f'{{"step": {s}}}\n' for s in (1, 2, 4, 5))
    (run / "metrics.jsonl").write_text(rows)
    with pytest.raises(RunDirError, match=r"not 1..4 in order \(missing: \[3\]"):
        truncate_metrics(run, 4)
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in (1, 2, 3, 4, 5)))
    truncate_metrics(run, 3)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]


def _metrics(run: Path, losses: dict[int, float]) -> None:
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "loss_hex": float(v).hex(), "grad_norm_hex": "0x1p+0"}) + "\n"
            for s, v in losses.items()
        )
    )


def test_metrics_are_compared_by_step_number_not_by_line(tmp_path, deterministic):
    """Run B's metrics.jsonl lacks step 2 (a gap): diff names step 2 as missing from B, and still compares
    step 3 with step 3 (same bits: no other difference is claimed). Negative control: B with all three
    steps and step 3's loss one ULP off differs at step 3, in its loss."""
    for name in ("a", "b", "c"):
        _loop(tmp_path / name)
    _metrics(tmp_path / "a", {1: 1.5, 2: 1.25, 3: 1.0})
    _metrics(tmp_path / "b", {1: 1.5, 3: 1.0})
    _metrics(tmp_path / "c", {1: 1.5, 2: 1.25, 3: float.fromhex("0x1.0000000000001p+0")})
    gap = diff_runs(tmp_path / "a", tmp_path / "b")
    assert gap["metrics"] == {"step": 2, "fields": ["missing"], "a": {"has_step": True}, "b": {"has_step": False}}
    assert not gap["identical"] and gap["first_divergent_step"] == 2 and gap["compared"]["metric_steps"] == 2
    ulp = diff_runs(tmp_path / "a", tmp_path / "c")
    assert ulp["metrics"]["step"] == 3 and ulp["metrics"]["fields"] == ["loss_hex"]


def test_diff_takes_the_first_divergent_step_from_the_receipts(tmp_path):
    """A bit flipped in a parameter after step 2's update: the state differs from step 2 on, while the loss
    differs only from step 3 (it is computed before the update). diff reports step 2 from the receipts
    (metrics alone would say 3). Control: without receipts (train.receipts=false) only the metrics speak."""
    from tests.support import TINY, train_here

    fault = "train.fault=param:rank=0,step=2,name=transformer.h.0.mlp.c_fc.weight,bit=20"
    for name, extra in (
        ("a", ()),
        ("b", (fault,)),
        ("a_plain", ("train.receipts=false",)),
        ("b_plain", ("train.receipts=false", fault)),
    ):
        train_here(tmp_path / name, *TINY, *extra)
    report = diff_runs(tmp_path / "a", tmp_path / "b", force=True)
    assert report["receipts"]["step"] == 2 and report["receipts"]["fields"] == ["state"], report["receipts"]
    assert report["first_divergent_step"] == 2 and report["metrics"]["step"] == 3, report["summary"]
    plain = diff_runs(tmp_path / "a_plain", tmp_path / "b_plain", force=True)
    assert plain["receipts"] is None and plain["first_divergent_step"] == 3


def test_a_run_that_stopped_earlier_is_identical_only_over_the_steps_both_hold(tmp_path):
    """Runs of 3 and 8 steps of one config: "identical over steps 1-3 of 1-8" (exit 0; --strict exit 1), never
    plain "identical". Control: two whole runs are identical (exit 0 with --strict)."""
    from tests.support import TINY, train_here

    train_here(tmp_path / "short", *TINY, stop_after=3)
    for name in ("long", "long2"):
        train_here(tmp_path / name, *TINY)
    report = diff_runs(tmp_path / "short", tmp_path / "long")
    assert not report["identical"] and report["verdict"] == "identical over steps 1-3 of 1-8", report["summary"]
    assert main(["diff", str(tmp_path / "short"), str(tmp_path / "long")]) == 0
    assert main(["diff", str(tmp_path / "short"), str(tmp_path / "long"), "--strict"]) == 1
    assert main(["diff", str(tmp_path / "long"), str(tmp_path / "long2"), "--strict"]) == 0


class _FlipsAttention(torch.nn.Module):
    """A forward that turns cuDNN attention on around its own work and back off, as torchtitan's SDPA
    module does: between steps every knob reads as enable() set it."""

    def __init__(self, flip: bool) -> None:
        super().__init__()
        self.flip, self.inner = flip, torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(self.flip or before)
        try:
            return self.inner(x)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(before)


def _flip_loop(run: Path, level: str, flip: bool) -> dict:
    model = _FlipsAttention(flip)
    rec = samestep.trace(run, level=level, worker="thread")
    rec.attach(model)
    try:
        for step in (1, 2):
            with rec.step(step):
                with rec.microbatch(0):
                    model(torch.ones(2, 4)).sum().backward()
    finally:
        rec.close()
    return json.loads((run / "run.json").read_text())


def test_a_knob_flipped_inside_a_forward_is_seen_at_op_level(tmp_path):
    """cuDNN attention turned on and back off inside a module's forward: at op level the first op that runs
    while it is on is named in run.json and the warning; at step level, which looks between steps, it is
    not seen (docs/design.md says so). Negative control: the same module without the flip records nothing
    at op level."""
    with samestep.enable(threads=1):
        with pytest.warns(
            RuntimeWarning,
            match=r"at step 1 deterministic mode no longer holds .*cudnn_sdp: "
            r"False -> True, while aten\.\S+ in inner \(forward\) ran",
        ):
            doc = _flip_loop(tmp_path / "op", "op", flip=True)
        assert doc["determinism_changed"]["knobs"] == {"torch.backends.cuda.cudnn_sdp": [False, True]}
        assert doc["determinism_changed"]["step"] == 1
        assert "determinism_changed" not in _flip_loop(tmp_path / "step", "step", flip=True)
        assert "determinism_changed" not in _flip_loop(tmp_path / "plain", "op", flip=False)


def test_a_note_on_other_layouts_names_each_as_it_splits_the_tensors():
    """The note for steps written on other layouts says how each splits what its ranks record: FSDP2 over tensor
    parallelism (rows of a tensor rank's slice) is told apart from tensor parallelism alone (a slice) and
    from FSDP2 alone (dim-0 rows); steps on one layout get no note."""
    from samestep.analysis.layouts import steps_on_other_layouts

    grid = {"layout": {"world_size": 4, "sharded": "fsdp2", "tensor_parallel": 2}}
    notes: list[str] = []
    tp4, fsdp2 = {"layout": {"world_size": 4, "tensor_parallel": 4}}, {"layout": {"world_size": 2, "sharded": "fsdp2"}}
    for other in (tp4, fsdp2):
        assert steps_on_other_layouts(grid, other, {1, 2}, notes) == {1, 2}
    assert "2 data ranks holding FSDP2 shards of each of 2 tensor ranks' slices" in notes[0]
    assert "over 4 tensor ranks (rank r records its slice" in notes[0]
    assert "records its dim-0 rows" in notes[1]
    assert steps_on_other_layouts(grid, grid, {1, 2}, notes) == set() and len(notes) == 2
    assert "and the final state digest are compared" in notes[0]
    # a loop of one's own writes no final.json: the note says what is then not seen
    assert steps_on_other_layouts(grid, tp4, {1}, notes, final=False) == {1}
    assert "no final state (final.json: not both runs wrote one)" in notes[2]
    assert "final state digest are compared" not in notes[2]


def test_the_text_names_the_first_step_the_receipts_differ_at(tmp_path):
    """Two samestep.Run loops whose learning rates differ, traced on steps 2-3: their state differs after step 1's
    update (the receipts), their traces first at step 2. The summary begins with step 1 and
    what differs there, then where the traces first differ, as the JSON's first_divergent_step says. Negative
    control: with receipts off the first step anything differs at is the traces' step 2."""

    def loop(run: Path, lr: float, receipts: bool = True) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        with samestep.Run(run, model=model, optimizer=opt, trace_steps="2-3", receipts=receipts) as r:
            for step in r.steps(3):
                model(torch.full((2, 4), float(step))).sum().backward()
                opt.step()
                opt.zero_grad()

    loop(tmp_path / "a", 0.1)
    loop(tmp_path / "b", 0.2)
    report = diff_runs(tmp_path / "a", tmp_path / "b")
    assert report["first_divergent_step"] == 1 and report["receipts"]["step"] == 1, report
    assert report["summary"].startswith(
        "diverged at step 1: the receipts' state differ (rank 0); the traces first "
        "differ at step 2: first difference seen: step 2"
    ), report["summary"]
    loop(tmp_path / "c", 0.1, receipts=False)
    loop(tmp_path / "d", 0.2, receipts=False)
    report = diff_runs(tmp_path / "c", tmp_path / "d")
    assert report["first_divergent_step"] == 2 and report["summary"].startswith(
        "diverged at step 2: first difference seen: step 2"
    ), report["summary"]


def _rounded_loop(run_dir: Path, perturb: str | None) -> None:
    """A loop of one's own whose hidden layer is rounded to bf16 and back: a ULP planted in the first linear's
    output is absorbed there before any step's state; one in the loss is the loss's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with samestep.Run(run_dir, model=model, optimizer=opt, level="op", perturb=perturb) as run:
        for step in run.steps(3):
            hidden = model[0](torch.full((2, 4), float(step)))
            loss = model[1](hidden.to(torch.bfloat16).float()).sum()
            loss.backward()
            run.metric("loss", loss)
            opt.step()
            opt.zero_grad(set_to_none=True)


def test_diff_and_bisect_give_one_verdict_of_a_difference_rounding_absorbed(tmp_path):
    """A ULP in an op's output that a bf16 rounding takes out before any step's state: every receipt and the
    final state agree, the op records do not. diff and bisect both say diverged at that step (exit 1), name
    the op and say rounding absorbed it; bisect replays nothing. Controls: a ULP in the loss's sum, which no
    rounding follows, reaches the receipts (not absorbed), and two runs without one are identical to both,
    trace records too."""
    from samestep.replay.bisect import bisect_runs

    ulp = "rank=0,step=2,microbatch=0,phase=forward,scope={},op=aten.{}.default"
    for name, perturb in (("a", None), ("b", None), ("ulp", ulp.format(0, "addmm")), ("raw", ulp.format("", "sum"))):
        _rounded_loop(tmp_path / name, perturb)
    diff, bisect = diff_runs(tmp_path / "a", tmp_path / "ulp"), bisect_runs(tmp_path / "a", tmp_path / "ulp")
    for report in (diff, bisect):
        assert not report["identical"] and report["first_divergent_step"] == 2, report["summary"]
        assert report["origin"]["op"] == "aten.addmm.default", report["summary"]
        assert "Rounding absorbed it" in report["summary"], report["summary"]
    assert diff["absorbed"] and diff["receipts"] is None and bisect["attempts"] == 0
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "ulp")]) == 1
    assert main(["bisect", str(tmp_path / "a"), str(tmp_path / "ulp")]) == 1
    raw = diff_runs(tmp_path / "a", tmp_path / "raw")
    assert not raw["absorbed"] and raw["receipts"]["step"] == 2, raw["summary"]
    assert "absorbed" not in raw["summary"]
    same = bisect_runs(tmp_path / "a", tmp_path / "b")
    assert same["identical"] and "trace records agree" in same["summary"], same["summary"]
    assert diff_runs(tmp_path / "a", tmp_path / "b")["identical"]

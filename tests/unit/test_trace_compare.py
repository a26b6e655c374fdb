"""diff and certify on traces: hand-built streams (identical, origin, receiver, structural, torn), runs traced
at other levels or steps, a traced run of one's own loop."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch

import samestep
from samestep.analysis import DiffError, certify_trace, diff_runs
from samestep.tracing import Perturb, read_stream, stream_path
from samestep.tracing.stream import END, FORMAT, SCHEMA, VERSION, StreamWriter
from tests.support import traced_step
from tests.support.traces import Tiny, described, record

module_level = importlib.import_module("samestep.tracing.module_level")
step_level = importlib.import_module("samestep.tracing.step_level")


def test_runs_traced_at_other_levels_or_steps_are_compared_on_what_both_recorded(tmp_path):
    """An op-level and a module-level trace of the same work are identical at module level (not a
    "structural divergence: code paths differ"); a real difference still shows through that cut; runs
    that traced other steps are compared on the steps both traced, with a note each time."""

    def run(name: str, level: str, scale: float = 1.0, steps: set[int] | None = None) -> Path:
        record(tmp_path / name, level, scale=scale, steps=steps)
        return described(
            tmp_path / name, {"level": level, "steps": "all" if steps is None else ",".join(map(str, sorted(steps)))}
        )

    op, module = run("op", "op"), run("module", "module")
    report = diff_runs(op, module)
    modules = read_stream(stream_path(module, 0)).table.num_rows
    assert report["identical"] and report["per_rank"]["0"]["records_compared"] == modules
    assert report["notes"] == [
        "A was traced at op level, B at module: compared at module level (run A's finer records are left out)"
    ]
    other = diff_runs(run("other", "op", scale=2.0), module)  # the negative control: the cut hides no difference
    first = other["first_difference"]
    assert not other["identical"] and (first["kind"], first["op"], first["step"]) == ("first_seen", "output", 1)
    report = diff_runs(run("step2", "module", steps={2}), module)
    assert report["identical"] and 0 < report["per_rank"]["0"]["records_compared"] < modules
    assert "traced steps differ (A: 2, B: all): traces compared on the steps both traced (2)" in report["notes"]


def test_torn_tail_is_reported_not_fatal(tmp_path):
    """Cutting the file mid-batch keeps every complete batch and reports the torn tail."""
    record(tmp_path, "op")
    path = stream_path(tmp_path, 0)
    full = read_stream(path).table.num_rows
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    s = read_stream(path)
    assert s.torn is not None and 0 < s.table.num_rows < full


def _run_dir(
    root: Path,
    name: str,
    rows: list[dict],
    config: dict | None = None,
    version: int = VERSION,
    ranks: dict[int, list[dict]] | None = None,
    ends: bool = False,
) -> Path:
    """A run directory with ``rows`` as rank 0's stream, or one stream per rank of ``ranks``; ``ends``: each
    step's records close with its step.end record."""
    run = root / name
    run.mkdir(parents=True)
    described(run, config=config or {"train": {"seed": 1}, "trace": {"level": "op"}}, world=len(ranks) if ranks else 1)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss_hex": "0x1p+0", "grad_norm_hex": "0x1p+0"}) + "\n")
    writer = StreamWriter(stream_path(run, 0), {"rank": 0})
    if version != VERSION:
        writer._writer.close()
        writer._file.close()
        with open(stream_path(run, 0), "wb") as f:
            w = pa.ipc.new_stream(f, SCHEMA.with_metadata({"format": FORMAT, "version": str(version)}))
            w.close()
        return run
    for rank, rank_rows in (ranks or {0: rows}).items():
        if ends:
            rank_rows = rank_rows + [
                {
                    "seq": len(rank_rows) + i,
                    "step": step,
                    "microbatch": -1,
                    "phase": "step",
                    "scope": "",
                    "op": END,
                    "occurrence": 0,
                    "inputs": b"",
                    "outputs": b"",
                }
                for i, step in enumerate(sorted({r["step"] for r in rank_rows}))
            ]
        if rank:
            writer = StreamWriter(stream_path(run, rank), {"rank": rank})
        writer.write({c: [r[c] for r in rank_rows] for c in SCHEMA.names})
        writer.close()
    return run


def _rows(n: int = 5, **changes) -> list[dict]:
    rows = [
        {
            "seq": i,
            "step": 1,
            "microbatch": 0,
            "phase": "forward",
            "scope": "m",
            "op": f"aten.op{i}.default",
            "occurrence": 0,
            "inputs": bytes([i]) * 16,
            "outputs": bytes([i + 1]) * 16,
        }
        for i in range(n)
    ]
    for idx, fields in changes.items():
        rows[int(idx[1:])].update(fields)
    return rows


def test_diff_identical_origin_receiver_structural(tmp_path):
    """Hand-built streams: identical; an output change with matched inputs (origin); a changed input
    (receiver); a different op at the same position (structural, reported first)."""
    a = _run_dir(tmp_path, "a", _rows())
    assert diff_runs(a, _run_dir(tmp_path, "same", _rows()))["identical"]
    origin = diff_runs(a, _run_dir(tmp_path, "o", _rows(r2={"outputs": b"x" * 16})))
    assert not origin["identical"] and origin["origin"]["op"] == "aten.op2.default"
    assert origin["origin"]["inputs_matched"] and "origin" in origin["summary"]
    recv = diff_runs(a, _run_dir(tmp_path, "r", _rows(r3={"inputs": b"y" * 16, "outputs": b"y" * 16})))
    assert recv["origin"] is None and recv["first_difference"]["kind"] == "receiver"
    assert "no origin found" in recv["summary"] and "widen" in recv["summary"]
    struct = diff_runs(a, _run_dir(tmp_path, "s", _rows(r1={"op": "aten.other.default"}, r2={"outputs": b"z" * 16})))
    assert struct["first_difference"]["kind"] == "structural" and struct["origin"] is None
    assert struct["first_difference"]["other"]["op"] == "aten.other.default"
    short = diff_runs(a, _run_dir(tmp_path, "short", _rows(3)))
    assert short["first_difference"]["kind"] == "structural"


def test_human_report_names_ops_in_full_and_folds_ranks_that_match(tmp_path, capsys, monkeypatch):
    """`samestep diff` without --json, piped: the summary and a table whose consecutive ranks with no
    difference are one row each (a 1,024-rank diff stays a few rows); names are never cut short."""
    from samestep.cli import main

    ranks = 40
    a = _run_dir(tmp_path, "a", [], ranks={r: _rows() for r in range(ranks)})
    changed = {r: _rows(r2={"outputs": b"x" * 16}) if r in (5, 6, 39) else _rows() for r in range(ranks)}
    b = _run_dir(tmp_path, "b", [], ranks=changed)
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "origin on rank(s) 5-6,39 only, of 40 (0-39)" in out
    rows = [line.split("│")[1:-1] for line in out.splitlines() if line.startswith("│")]
    assert [(cells[0].strip(), cells[1].strip(), cells[2].strip()) for cells in rows] == [
        ("0-4", "25 (5 ranks)", "none"),
        ("5", "2", "origin"),
        ("6", "2", "origin"),
        ("7-38", "160 (32 ranks)", "none"),
        ("39", "2", "origin"),
    ]
    assert all("aten.op2.default #0" in cells[6] for cells in rows if cells[2].strip() == "origin")
    assert main(["diff", str(a), str(a)]) == 0
    assert [
        [c.strip() for c in line.split("│")[1:4]]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("│")
    ] == [["0-39", "200 (40 ranks)", "none"]]


def test_copy_like_op_diverging_points_outside_the_dispatcher(tmp_path):
    """A clone whose inputs matched but output differs: the note blames a write outside the dispatcher."""
    rows = _rows()
    rows[2]["op"] = "aten.clone.default"
    b_rows = [dict(r) for r in rows]
    b_rows[2]["outputs"] = b"q" * 16
    report = diff_runs(_run_dir(tmp_path, "a", rows), _run_dir(tmp_path, "b", b_rows))
    assert report["origin"]["op"] == "aten.clone.default" and "outside the dispatcher" in report["summary"]


def test_diff_refuses_other_config_environment_or_schema(tmp_path):
    """Different config or trace schema version: refused with the fields, unless --force (config)."""
    a = _run_dir(tmp_path, "a", _rows())
    b = _run_dir(tmp_path, "b", _rows(), config={"train": {"seed": 2}, "trace": {"level": "op"}})
    with pytest.raises(DiffError, match=r"train\.seed \(1 vs 2\)"):
        diff_runs(a, b)
    assert "config differs" in diff_runs(a, b, force=True)["notes"][0]
    v1 = _run_dir(tmp_path, "v1", [], version=1)
    with pytest.raises(DiffError, match="trace schema version '1'"):
        diff_runs(a, v1)
    with pytest.raises(DiffError, match="run.json: missing"):
        diff_runs(a, tmp_path / "nope")


def test_diff_leaves_out_state_records_that_streams_of_other_versions_digest_otherwise(tmp_path, monkeypatch):
    """A version-3 stream digests parameters and optimizer state by samestep's tensor digest, a version-4 one by
    their state checksum: diff compares the rest and leaves those out, a note naming both; a difference in the
    rest is still found. Control: between two version-4 streams the same state records are compared, and the
    changed one is the first difference."""
    from samestep.tracing import stream

    state = {
        "seq": 5,
        "step": 1,
        "microbatch": -1,
        "phase": "step",
        "scope": "w",
        "op": "param",
        "occurrence": 0,
        "inputs": b"",
        "outputs": b"s" * 16,
    }
    moved = [*_rows(), {**state, "outputs": b"t" * 16}]
    with monkeypatch.context() as m:
        m.setattr(stream, "VERSION", 3)
        old = _run_dir(tmp_path, "old", [*_rows(), state])
    assert read_stream(stream_path(old, 0)).meta["stream_version"] == 3
    report = diff_runs(old, _run_dir(tmp_path, "new", moved))
    assert report["identical"] and report["per_rank"]["0"]["records_compared"] == 5
    assert any(
        "state records (param, optim.*) are left out: A's trace digests them by tensor digest, B's by "
        "state checksum" in n
        for n in report["notes"]
    ), report["notes"]
    report = diff_runs(old, _run_dir(tmp_path, "other", [*_rows(r2={"outputs": b"x" * 16}), state]))
    assert not report["identical"] and report["origin"]["op"] == "aten.op2.default"
    report = diff_runs(_run_dir(tmp_path, "v4", [*_rows(), state]), tmp_path / "new")  # control
    assert not report["identical"] and report["first_difference"]["op"] == "param"
    assert not any("left out" in n for n in report["notes"])


def test_diff_refuses_a_selection_with_nothing_to_compare(tmp_path):
    """--ranks naming an untraced rank, or --steps the runs do not have, is an input error naming what the
    runs hold (not an "identical" verdict over nothing); steps the runs have but did not trace get a note."""
    a, b = _run_dir(tmp_path, "a", _rows()), _run_dir(tmp_path, "b", _rows())
    with pytest.raises(DiffError, match=r"--ranks 0-1,3: rank\(s\) 1,3 have no trace in either run \(A traced 0, B 0"):
        diff_runs(a, b, ranks={0, 1, 3})
    with pytest.raises(DiffError, match=r"--steps 2-3: neither run has these steps \(A: 1, B: 1\)"):
        diff_runs(a, b, steps={2, 3})
    assert diff_runs(a, b, ranks={0}, steps={1, 2})["per_rank"]["0"]["records_compared"] == 5
    untraced = [dict(r, step=2) for r in _rows()]  # step 1's metrics, but records of step 2 only
    c, d = _run_dir(tmp_path, "c", untraced), _run_dir(tmp_path, "d", untraced)
    report = diff_runs(c, d, steps={1})
    assert report["identical"] and report["summary"] == "identical: the metric bits of 1 step(s) match"
    assert any("no trace records fall in --steps 1" in n for n in report["notes"])


def _own_loop(run: Path, perturb: Perturb | None = None) -> None:
    """A user's own training loop, traced with the public samestep.trace() (no samestep train around it)."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    rec = samestep.trace(run, level="op", steps="1-2", perturb=perturb)
    rec.attach(model)
    for step in (1, 2, 3):
        traced_step(rec, model, opt, step, [(mb, torch.full((2, 4), 0.5 * (mb + 1))) for mb in (0, 1)], model)
    rec.close()


def test_a_traced_run_of_your_own_loop_diffs_and_certifies(tmp_path):
    """samestep.trace() in a loop of the user's own gives its run directory a run.json, so diff and
    certify work on it: two runs are identical, a planted ULP is found as the origin, certify sees the
    selected steps and deterministic mode; without enable() certify says so; a run.json already there
    (samestep train writes its own first) is kept."""
    from samestep.cli import main

    with samestep.enable(threads=1):
        for name in ("a", "b"):
            _own_loop(tmp_path / name)
        _own_loop(
            tmp_path / "ulp",
            Perturb(rank=0, step=2, microbatch=1, phase="forward", scope="head", op="aten.addmm.default"),
        )
    doc = json.loads((tmp_path / "a" / "run.json").read_text())
    assert doc["config"] == {"trace": {"level": "op", "steps": "1-2", "ranks": "all"}}
    assert doc["written_by"] == "samestep.trace" and doc["determinism"]["threads"] == 1
    same = diff_runs(tmp_path / "a", tmp_path / "b")
    assert same["identical"] and same["summary"].startswith("identical: ") and "metric bit" not in same["summary"]
    assert same["per_rank"]["0"]["records_compared"] > 100
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    o = diff_runs(tmp_path / "a", tmp_path / "ulp")["origin"]  # the negative control: the same check sees one ULP
    assert (o["step"], o["microbatch"], o["scope"], o["op"], o["inputs_matched"]) == (
        2,
        1,
        "head",
        "aten.addmm.default",
        True,
    )
    cert = certify_trace(tmp_path / "a")
    assert cert["complete"], cert["problems"]
    assert cert["selected_steps"] == "1-2" and cert["ranks"]["0"]["steps"] == "1-2"

    _own_loop(tmp_path / "off")  # deterministic mode not in force
    assert certify_trace(tmp_path / "off")["problems"] == [
        "deterministic mode is not recorded in run.json (samestep.enable() was not in force when "
        "samestep.trace() started)"
    ]
    (tmp_path / "kept").mkdir()
    kept = '{"format": "samestep.run", "version": 1, "config": {"train": {}}}'
    (tmp_path / "kept" / "run.json").write_text(kept)
    _own_loop(tmp_path / "kept")
    assert (tmp_path / "kept" / "run.json").read_text() == kept


def test_certify_complete_and_gaps(tmp_path):
    """A contiguous trace of every step certifies; a sequence gap and a missing step are named."""
    good = _run_dir(tmp_path, "good", _rows(), ends=True)
    assert certify_trace(good)["complete"]
    bad_rows = _rows()
    bad_rows[3]["seq"] = 9
    bad = _run_dir(tmp_path, "bad", bad_rows, ends=True)
    (bad / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    problems = certify_trace(bad)["problems"]
    assert any("sequence jumps from 2 to 9" in p for p in problems)
    assert any("no records for step(s) 2" in p for p in problems)

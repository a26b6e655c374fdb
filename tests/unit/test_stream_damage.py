"""Trace streams carry a checksum per record batch: a changed byte is refused by file and offset, never
read as a difference of the runs; steps one run's trace lacks are reported as missing, not as code paths
that differ (docs/formats.md, trace streams)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

import samestep
from samestep.analysis import DiffError, certify_trace, diff_runs
from samestep.cli import main
from samestep.tracing import read_stream, stream_path
from samestep.tracing.stream import END, SCHEMA, DamagedStream, StreamWriter
from tests.support import traced_step

stream_module = importlib.import_module("samestep.tracing.stream")


def _loop(run: Path, steps: int = 3) -> None:
    """A user's own loop, traced at op level on every step, in deterministic mode."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with samestep.enable(threads=1):
        rec = samestep.trace(run, level="op")
        rec.attach(model)
        for step in range(1, steps + 1):
            traced_step(
                rec,
                model,
                opt,
                step,
                [(mb, torch.full((2, 4), 0.5 * (mb + 1))) for mb in (0, 1)],
                lambda x: model(x).sum(),
            )
        rec.close()


def _flips_read(path: Path, positions: list[int]) -> dict[str, int]:
    """Each single-bit flip at ``positions`` (bit offsets) read back: refused, intact (the flip hit padding
    or unused bytes: the records are the written ones), torn, or read as other records."""
    original, data = read_stream(path).table, path.read_bytes()
    out = {"refused": 0, "intact": 0, "torn": 0, "other records": 0}
    flipped = path.with_name("flipped.arrows")
    for pos in positions:
        d = bytearray(data)
        d[pos // 8] ^= 1 << (pos % 8)
        flipped.write_bytes(bytes(d))
        try:
            got = read_stream(flipped)
        except ValueError:  # DamagedStream, or a header that no longer parses
            out["refused"] += 1
            continue
        if not got.table.equals(original):
            out["other records"] += 1
        else:
            out["torn" if got.torn else "intact"] += 1
    return out


def test_no_single_bit_flip_is_read_as_other_records(tmp_path, monkeypatch):
    """Flipping any of ~1,500 bits spread over a real stream: each is refused or leaves the records as
    written, none is read back as other records. Negative control: the same flips with the checksum not
    compared are read back as other records, silently."""
    _loop(tmp_path / "run")
    path = stream_path(tmp_path / "run", 0)
    bits = path.stat().st_size * 8
    positions = list(range(3, bits, max(bits // 1500, 1)))
    counts = _flips_read(path, positions)
    assert counts["other records"] == 0, counts
    assert counts["refused"] > len(positions) // 2, counts

    monkeypatch.setattr(stream_module, "_matches", lambda got: True)
    unchecked = _flips_read(path, positions)
    assert unchecked["other records"] > 0, unchecked


def _flip_a_digest_of_step_2(path: Path) -> None:
    """Flips a bit of an output digest of an op record of step 2, where the file's bytes hold that value
    (a digest recurs as later records' inputs, and a batch's buffers may hold unused bytes)."""
    table = read_stream(path).table
    data = path.read_bytes()
    wanted = [
        table.column("outputs")[i].as_py()[:16]
        for i in range(table.num_rows)
        if table.column("step")[i].as_py() == 2 and table.column("op")[i].as_py().startswith("aten.")
    ]
    for digest in filter(None, wanted):
        for at in (m.start() for m in re.finditer(re.escape(digest), data)):
            flipped = bytearray(data)
            flipped[at + 5] ^= 8
            read = pa.ipc.open_stream(pa.BufferReader(bytes(flipped))).read_all()
            if not read.column("outputs").equals(table.column("outputs")):
                path.write_bytes(bytes(flipped))
                return
    raise AssertionError("no digest of step 2 whose bytes hold a record's value")


def test_diff_and_certify_refuse_a_damaged_batch_by_file_and_offset(tmp_path, monkeypatch, capsys):
    """One flipped bit in a digest of step 2 in run B: without the checksum, diff reports a divergence at
    step 2 that never happened (the negative control); with it, diff and certify refuse,
    exit 2, and name the file and the batch's byte offset."""
    from samestep.cli import main

    _loop(tmp_path / "a")
    _loop(tmp_path / "b")
    assert diff_runs(tmp_path / "a", tmp_path / "b")["identical"]
    path = stream_path(tmp_path / "b", 0)
    _flip_a_digest_of_step_2(path)

    with monkeypatch.context() as m:  # the negative control: read without comparing checksums
        m.setattr(stream_module, "_matches", lambda got: True)
        wrong = diff_runs(tmp_path / "a", tmp_path / "b")
        assert not wrong["identical"] and wrong["first_divergent_step"] == 2

    with pytest.raises(
        DiffError,
        match=re.escape(str(path)) + r": damaged: the record batch at byte \d+ does not "
        "match its checksum",
    ):
        diff_runs(tmp_path / "a", tmp_path / "b")
    with pytest.raises(DiffError, match=r"damaged: the record batch at byte \d+"):
        certify_trace(tmp_path / "b")
    for argv in (["diff", str(tmp_path / "a"), str(tmp_path / "b")], ["trace", "certify", str(tmp_path / "b")]):
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count(f"{path}: damaged: the record batch at byte") == 2 and "Traceback" not in err


def test_a_closed_stream_cut_short_is_damage_and_an_unclosed_one_a_torn_tail(tmp_path):
    """A stream its writer closed ends with the end-of-stream marker: a message that runs past the end
    of such a file is damage (its length was changed), not a torn tail; in a stream with no marker (its
    writer was killed) it is the torn tail, reported, with every whole batch before it."""
    _loop(tmp_path / "run")
    path = stream_path(tmp_path / "run", 0)
    data = path.read_bytes()
    whole = read_stream(path).table.num_rows
    source = pa.memory_map(str(path))
    reader, starts = pa.ipc.open_stream(source), []
    while True:  # each batch's byte offset
        starts.append(source.tell())
        try:
            reader.read_next_batch()
        except StopIteration:
            break
    last = starts[-2]
    # the last batch's metadata length, grown: its end now lies past the end of the file
    bad = bytearray(data)
    bad[last + 5] ^= 0x40
    path.write_bytes(bytes(bad))
    with pytest.raises(DamagedStream, match=rf"byte {last}"):
        read_stream(path)
    path.write_bytes(data[: len(data) - 8 - 40])  # killed mid-batch: no marker, last message cut
    torn = read_stream(path)
    assert torn.torn is not None and f"byte {last}" in torn.torn and 0 < torn.table.num_rows < whole


def _rewrite(source: Path, target: Path, rows) -> None:
    """A stream of ``rows`` (a table of records) at ``target``, numbered afresh, with ``source``'s metadata."""
    cols = {c: rows.column(c).to_pylist() for c in SCHEMA.names}
    cols["seq"] = list(range(rows.num_rows))
    tmp = target.with_name("rewritten.arrows")  # ``rows`` may be mapped from ``target``: replaced, not overwritten
    writer = StreamWriter(tmp, read_stream(source).meta)
    writer.write(cols)
    writer.close()
    tmp.replace(target)


def test_steps_one_trace_lacks_are_missing_not_a_divergence(tmp_path):
    """Run B's trace without step 2 (its records lost, as when a run is killed before they are written):
    diff compares steps 1 and 3 and says so: "identical over steps 1,3 of 1-3", not plain identical (exit 0,
    1 with --strict), naming step 2 as missing from B; it is not "code paths differ". Negative control:
    the same trace with one output digest of step 3 changed instead diverges there."""
    for name in ("a", "b", "c"):
        _loop(tmp_path / name)
    table = read_stream(stream_path(tmp_path / "b", 0)).table
    assert END in table.column("op").to_pylist()
    _rewrite(
        stream_path(tmp_path / "a", 0),
        stream_path(tmp_path / "b", 0),
        table.filter(pc.not_equal(table.column("step"), 2)),
    )
    outputs = table.column("outputs").to_pylist()
    i = next(
        i
        for i, (s, op) in enumerate(zip(table.column("step").to_pylist(), table.column("op").to_pylist()))
        if s == 3 and op.startswith("aten.") and outputs[i]
    )
    outputs[i] = bytes(a ^ 1 for a in outputs[i])
    changed = table.set_column(
        table.schema.get_field_index("outputs"), "outputs", pa.array(outputs, SCHEMA.field("outputs").type)
    )
    _rewrite(stream_path(tmp_path / "a", 0), stream_path(tmp_path / "c", 0), changed)

    report = diff_runs(tmp_path / "a", tmp_path / "b")
    assert not report["identical"] and report["partial"], report["summary"]
    assert report["verdict"] == "identical over steps 1,3 of 1-3", report["summary"]
    assert report["per_rank"]["0"]["missing_steps"] == {"A": [], "B": [2]}
    assert any("run B's trace has no records of step(s) 2" in n for n in report["notes"])
    assert "structural" not in report["summary"]
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--strict"]) == 1
    other = diff_runs(tmp_path / "a", tmp_path / "c")
    assert not other["identical"] and other["first_divergent_step"] == 3 and other["origin"] is not None


def test_a_stream_whose_header_names_another_rank_is_refused(tmp_path, capsys):
    """Rank 0's stream copied over rank 1's (its header says rank 0): certify and diff refuse with one line
    naming the file and what its header says (exit 2), never "complete" or a divergence at rank 1. Negative
    control: the same records under a header that says rank 1 certify and diff as a rank-1 stream."""
    import json

    from samestep.tracing.stream import iter_stream

    for name in ("a", "b"):
        _loop(tmp_path / name)
        doc = json.loads((tmp_path / name / "run.json").read_text())
        doc["layout"]["world_size"] = 2  # as a run of 2 ranks
        (tmp_path / name / "run.json").write_text(json.dumps(doc))
    meta = dict(read_stream(stream_path(tmp_path / "a", 0)).meta, rank=1)
    meta.pop("stream_version")
    writer = StreamWriter(stream_path(tmp_path / "a", 1), meta)
    table = read_stream(stream_path(tmp_path / "a", 0)).table
    writer.write({c: table.column(c).to_pylist() for c in SCHEMA.names})
    writer.close()
    stream_path(tmp_path / "b", 1).write_bytes(stream_path(tmp_path / "a", 1).read_bytes())
    assert certify_trace(tmp_path / "a")["complete"] and diff_runs(tmp_path / "a", tmp_path / "b")["identical"]
    stream_path(tmp_path / "b", 1).write_bytes(stream_path(tmp_path / "b", 0).read_bytes())
    with pytest.raises(ValueError, match=r"rank_00001.arrows: its header says rank 0; a stream is named"):
        iter_stream(stream_path(tmp_path / "b", 1))
    for argv in (["trace", "certify", str(tmp_path / "b")], ["diff", str(tmp_path / "a"), str(tmp_path / "b")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "rank_00001.arrows: its header says rank 0" in err, err

"""Where a replay enters a framework's run: the checkpoints found from run.json (resume_points.py)."""

from __future__ import annotations

from pathlib import Path

from samestep.resume_points import HF, HF_FINGERPRINT, LIGHTNING, RUN, index, points, resumed_by, resumes, stage
from samestep.rundir import RUN_FORMAT, RUN_VERSION, read_run, write_run


def _run(run_dir: Path, resumed: dict) -> dict:
    write_run(run_dir, {"format": RUN_FORMAT, "version": RUN_VERSION, "written_by": "samestep.trace", "programs": [
        {"from_step": 0, "resumes": resumed}]})
    return read_run(run_dir)


def test_the_trainers_checkpoints_are_those_the_callback_finished(tmp_path):
    """The HF Trainer's checkpoint-N directories under the recorded output directory (relative to the run
    directory: a copy of the run finds its own), each with the callback's samestep.json. Control: one without
    it (the Trainer's files written, the callback's not yet) and a directory of another name are not."""
    run = tmp_path / "run"
    doc = _run(run, resumes(HF, run, run))
    assert doc["programs"][0]["resumes"] == {"by": HF, "checkpoints": "."} and resumed_by(doc) == HF
    for name, finished in (("checkpoint-3", True), ("checkpoint-6", False), ("checkpoint-x", True)):
        (run / name).mkdir()
        if finished:
            (run / name / HF_FINGERPRINT).write_text("{}")
    assert points(run, doc) == {3: run / "checkpoint-3"}
    staged = stage(run / "checkpoint-3", tmp_path / "scratch", doc)
    assert staged == tmp_path / "scratch" / "checkpoint-3" and (staged / HF_FINGERPRINT).read_text() == "{}"


def test_lightnings_checkpoints_are_the_indexed_files_still_there(tmp_path):
    """The files the Lightning callback indexed, by step (a file indexed again replaces its entry). Control: an
    indexed file deleted since (ModelCheckpoint's top k) is not a point; a Run's run has none of these."""
    run = tmp_path / "run"
    _run(run, resumes(LIGHTNING, run))
    files = [tmp_path / f"step={s}.ckpt" for s in (3, 6, 9)]
    for step, f in zip((3, 6, 9), files):
        f.write_bytes(b"ckpt")
        index(run, step, f)
    index(run, 6, files[1])
    files[2].unlink()
    assert points(run, read_run(run)) == {3: files[0].resolve(), 6: files[1].resolve()}
    assert len(read_run(run)["checkpoints"]) == 3
    assert points(run, _run(tmp_path / "own", {"by": RUN})) == {} and resumed_by({}) == RUN

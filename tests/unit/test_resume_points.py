"""Where a replay enters a framework's run: the checkpoints found from run.json (replay/resume_points.py)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from samestep.records.rundir import RUN_FORMAT, RUN_VERSION, RunDirError, read_run, write_run
from samestep.replay.resume_points import HF, HF_FINGERPRINT, LIGHTNING, RUN, index, points, resumed_by, resumes, stage


def _run(run_dir: Path, resumed: dict) -> dict:
    write_run(
        run_dir,
        {
            "format": RUN_FORMAT,
            "version": RUN_VERSION,
            "written_by": "samestep.trace",
            "programs": [{"from_step": 0, "resumes": resumed}],
        },
    )
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
    """The files the Lightning callback indexed, by step (a file indexed again replaces its entry), recorded
    relative to the run directory: a copy of the run finds its own. Control: an indexed file deleted since
    (ModelCheckpoint's top k) is not a point; a Run's run has none of these."""
    run = tmp_path / "run"
    _run(run, resumes(LIGHTNING, run))
    (run / "checkpoints").mkdir()
    files = [run / "checkpoints" / f"step={s}.ckpt" for s in (3, 6, 9)]
    for step, f in zip((3, 6, 9), files):
        f.write_bytes(b"ckpt")
        index(run, step, f)
    index(run, 6, files[1])
    files[2].unlink()
    assert points(run, read_run(run)) == {3: files[0].resolve(), 6: files[1].resolve()}
    assert [e["path"] for e in read_run(run)["checkpoints"]] == [
        "checkpoints/step=3.ckpt",
        "checkpoints/step=9.ckpt",
        "checkpoints/step=6.ckpt",
    ]
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    assert points(copy, read_run(copy)) == {
        3: (copy / "checkpoints" / "step=3.ckpt").resolve(),
        6: (copy / "checkpoints" / "step=6.ckpt").resolve(),
    }
    assert points(run, _run(tmp_path / "own", {"by": RUN})) == {} and resumed_by({}) == RUN


@pytest.mark.parametrize(
    "by,field,value",
    [
        (LIGHTNING, "checkpoints[0].path", "ABSOLUTE"),
        (LIGHTNING, "checkpoints[0].path", "../outside/step=3.ckpt"),
        (LIGHTNING, "checkpoints[0].path", "link/step=3.ckpt"),
        (HF, "programs[0].resumes.checkpoints", "ABSOLUTE"),
        (HF, "programs[0].resumes.checkpoints", "../outside"),
    ],
)
def test_a_recorded_path_outside_the_run_directory_is_refused_naming_the_field(tmp_path, by, field, value):
    """A checkpoint path in run.json that is absolute, climbs out with .., or passes through a link to elsewhere
    is refused by name (it would have a replay read another directory's files: a copy of a run checked against
    the original's checkpoints). Control: the same file recorded inside the run directory is a point."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    (outside / "step=3.ckpt").write_bytes(b"ckpt")
    (outside / "checkpoint-3").mkdir()
    (outside / "checkpoint-3" / HF_FINGERPRINT).write_text("{}")
    run.mkdir()
    (run / "link").symlink_to(outside)
    value = str(outside) if value == "ABSOLUTE" else value
    if by == LIGHTNING:
        doc = _run(run, resumes(LIGHTNING, run))
        doc["checkpoints"] = [{"step": 3, "path": value}]
    else:
        doc = _run(run, {"by": HF, "checkpoints": value})
    says = r"(relative to the run directory|leads out of the run)"
    with pytest.raises(RunDirError, match=rf"{re.escape(field)}=.*{says}"):
        points(run, doc)
    (run / "in").mkdir()
    shutil.copy(outside / "step=3.ckpt", run / "in")
    shutil.copytree(outside / "checkpoint-3", run / "in" / "checkpoint-3")
    if by == LIGHTNING:
        doc["checkpoints"] = [{"step": 3, "path": "in/step=3.ckpt"}]
    else:
        doc["programs"][0]["resumes"]["checkpoints"] = "in"
    assert list(points(run, doc)) == [3]


def test_a_staging_folder_that_is_not_a_name_is_refused(tmp_path):
    """torchtitan's recorded checkpoint folder is a name in the scratch directory; one with .. or a separator
    (which would copy the checkpoint elsewhere) is refused. Control: a plain name stages there."""
    (tmp_path / "step-2").mkdir()
    for folder in ("..", "../x", "a/b"):
        with pytest.raises(RunDirError, match="resumes.folder"):
            stage(tmp_path / "step-2", tmp_path / "scratch", {"programs": [{"resumes": {"folder": folder}}]})
    assert (
        stage(tmp_path / "step-2", tmp_path / "scratch", {"programs": [{"resumes": {"folder": "ckpt"}}]})
        == tmp_path / "scratch" / "ckpt" / "step-2"
    )

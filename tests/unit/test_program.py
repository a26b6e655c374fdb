"""The program a loop of one's own records for replay (samestep.replay.program) and the replay request it runs under
(samestep.replay.request): what can run again, how, and what is refused by name."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import samestep
from samestep.replay import program
from samestep.replay.request import REPLAY_VAR, ReplayRequest


@pytest.mark.parametrize(
    "argv,why",
    [
        (["python", "-c", "print(1)"], "a `python -c` command"),
        (["python"], "the interactive interpreter or stdin"),
        (["python", "-"], "the interactive interpreter or stdin"),
        (["python", "-m", "ipykernel_launcher", "-f", "k.json"], "a notebook"),
        (["python", "/x/ipykernel_launcher.py", "-f", "k.json"], "a notebook"),
        (["python", "-m", "pkg.train", "--steps", "4"], None),
    ],
)
def test_a_program_that_is_not_on_disk_is_refused_naming_why(monkeypatch, tmp_path, argv, why):
    """A `python -c` command, stdin, the interactive interpreter and a notebook kernel record why they cannot run
    again, and a replay is refused with that line; a `python -m` module is a program (control)."""
    monkeypatch.setattr(sys, "orig_argv", argv)
    monkeypatch.chdir(tmp_path)
    described = program.describe(tmp_path / "run")
    if why is None:
        assert (described["entry"], described["target"]) == ("module", "pkg.train")
        assert program.check(described, tmp_path / "run") == []
        return
    assert why in described["not_replayable"]
    with pytest.raises(program.ProgramError, match=f"{tmp_path / 'run'} was run from {why}.*cannot be replayed"):
        program.check(described, tmp_path / "run")


def test_a_script_records_its_hash_and_an_edit_or_deletion_is_named(monkeypatch, tmp_path):
    """The entry script and the modules imported from the working tree are hashed; an edit of one and the
    script's deletion are named (control: untouched, nothing is)."""
    (tmp_path / "train.py").write_text("print('train')\n")
    (tmp_path / "mine.py").write_text("X = 1\n")
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-u", "train.py", "runs/a"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("mine")
    try:
        described = program.describe(tmp_path / "runs" / "a")
    finally:
        sys.modules.pop("mine", None)
    assert set(described["sources"]) == {"train.py", "mine.py"} and described["run_dir"] == "runs/a"
    assert program.check(described, tmp_path) == []
    (tmp_path / "mine.py").write_text("X = 2\n")
    assert program.check(described, tmp_path) == ["mine.py: edited since the run"]
    (tmp_path / "train.py").unlink()
    with pytest.raises(program.ProgramError, match="train.py, which is gone"):
        program.check(described, tmp_path)


def test_torchrun_is_relaunched_on_one_node_with_the_recorded_process_count_and_several_nodes_are_refused(tmp_path):
    ran = {
        "argv": ["/usr/bin/python3", "-u", "train.py", "runs/a"],
        "cwd": str(tmp_path),
        "run_dir": "runs/a",
        "executable": sys.executable,
        "entry": "script",
        "target": "train.py",
        "env": {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": None},
        "launcher": {"name": "torchrun", "nproc_per_node": 2, "nnodes": 1},
        "sources": {},
    }
    cmd, cwd, env = program.relaunch(ran)
    assert cmd == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "train.py",
        "runs/a",
    ]
    assert cwd == tmp_path and env["OMP_NUM_THREADS"] == "1" and "PYTHONHASHSEED" not in env
    assert program.run_dir_of(ran) == tmp_path / "runs" / "a"
    module = {**ran, "argv": ["/usr/bin/python3", "-u", "-m", "pkg.train", "x"]}
    assert program.relaunch(module)[0][-3:] == ["--module", "pkg.train", "x"]
    with pytest.raises(program.ProgramError, match="ran on 2 nodes"):
        program.check({**ran, "launcher": {"name": "torchrun", "nproc_per_node": 2, "nnodes": 2}}, tmp_path)


def test_a_resume_by_another_program_is_recorded_from_its_step(tmp_path):
    """run.json's programs: a resume under the same program adds nothing, under another one adds it from the
    step it resumed after; program_at picks the one that ran a step."""
    from samestep.records.rundir import new_run, read_run, write_run

    write_run(tmp_path, new_run({}, {"world_size": 1}, None, written_by="samestep.trace"))
    first, second = {"argv": ["p", "a.py"]}, {"argv": ["p", "b.py"]}
    program.record(tmp_path, 0, first)
    program.record(tmp_path, 2, first)
    program.record(tmp_path, 4, second)
    doc = read_run(tmp_path)
    assert [p["from_step"] for p in doc["programs"]] == [0, 4]
    assert program.program_at(doc, 4)["argv"] == first["argv"] and program.program_at(doc, 5)["argv"] == second["argv"]


def test_a_replay_request_for_another_run_directory_is_refused_before_anything_is_written(monkeypatch, tmp_path):
    """Under a request, a Run of the replayed directory works in the scratch one; a Run of another directory is
    refused (it would write that directory as the run did), and so is a request that is not one."""
    request = ReplayRequest(run_dir=str(tmp_path / "run"), into=str(tmp_path / "scratch"), stop_after=1)
    monkeypatch.setenv(REPLAY_VAR, request.to_env()[REPLAY_VAR])
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="this process replays .*run, and a run of another run directory"):
        samestep.Run(tmp_path / "other", model=model, optimizer=opt)
    assert not (tmp_path / "other").exists()
    with pytest.raises(SystemExit) as ended:  # the replay ends the process after its last step
        with samestep.Run(tmp_path / "run", model=model, optimizer=opt, level="off") as run:
            for _ in run.steps(3):
                model(torch.ones(1, 2)).sum().backward()
                opt.step()
    assert ended.value.code == 0 and not (tmp_path / "run").exists()
    assert json.loads((tmp_path / "scratch" / "run.json").read_text())["written_by"] == "samestep.trace"
    monkeypatch.setenv(REPLAY_VAR, "{not json")
    with pytest.raises(ValueError, match=f"{REPLAY_VAR}=.*not a samestep replay request"):
        ReplayRequest.from_env()

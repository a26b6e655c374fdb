"""The verifier's word before a replay runs a run's program (replay/consent.py), the replay's lifetime
(replay/scratch.py) and what a replay takes from a program record (replay/program.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from samestep.replay import program
from samestep.replay.consent import Consent, ConsentError, Launch
from samestep.replay.request import alive, process_mark
from samestep.replay.scratch import OWNER, remove_stale, run_child

IDENTITY = {
    "entry": "train.py",
    "entry_sha256": "ab" * 32,
    "files": {"train.py": "ab" * 32},
    "commit": None,
    "program": "cd" * 32,
}


def _launch(run: str, **kw) -> Launch:
    return Launch(run_dir=Path(run), cmd=[sys.executable, "train.py", run], cwd=Path("/work"), **kw)


def test_a_runs_program_needs_a_yes_and_samestep_train_or_a_given_program_does_not():
    """No word: a launch of the run's program is refused in one line naming the command, the directory and the
    code, nothing asked. Control: samestep train's replay (no program of the run's) and a program the verifier
    gave need no word; --yes grants."""
    with pytest.raises(ConsentError) as refused:
        Consent().grant([_launch("runs/a", identity=IDENTITY)], "samestep verify")
    line = str(refused.value)
    assert "\n" not in line and "train.py runs/a` in /work (1 process" in line and "--yes" in line
    assert f"train.py sha256:{'ab' * 6}" in line and "nothing ran" in line, line
    Consent().grant([_launch("runs/a"), _launch("runs/b", identity=IDENTITY, given=True)], "samestep verify")
    Consent(yes=True).grant([_launch("runs/a", identity=IDENTITY)], "samestep verify")


def test_more_processes_than_processors_need_a_word_even_for_samestep_train():
    """samestep train's replay on more processes than this machine's cores is refused without a word, naming
    both counts; as many as the cores need none (control), and --yes grants, shown where asked to."""
    with pytest.raises(ConsentError, match=r"\(5 processes, more than this machine's 4 CPU cores\)"):
        Consent().grant([_launch("runs/t", nproc=5, cap=(4, "CPU cores"))], "samestep verify")
    Consent().grant([_launch("runs/t", nproc=4, cap=(4, "CPU cores"))], "samestep verify")
    shown = []
    Consent(yes=True, show=shown.append).grant([_launch("runs/t", nproc=5, cap=(4, "CPU cores"))], "samestep verify")
    assert len(shown) == 1 and "processes:  5 (this machine has 4 CPU cores)" in shown[0], shown


def test_the_prompt_shows_every_launch_once_and_a_no_runs_nothing():
    """Two runs' programs are shown in one prompt (command, directory, processes, every file's hash), asked once;
    a launch agreed to is not asked again (bisect's retries). A no is refused (control)."""
    asked = []

    def answer(text: str, reply: bool) -> bool:
        asked.append(text)
        return reply

    launches = [
        _launch("runs/a", identity=IDENTITY, env={"OMP_NUM_THREADS": "1"}, ignored=("PYTHONPATH",)),
        _launch("runs/b", identity=IDENTITY),
    ]
    consent = Consent(ask=lambda text: answer(text, True))
    consent.grant(launches, "samestep bisect")
    consent.grant(launches, "samestep bisect")
    assert len(asked) == 1 and asked[0].count("command:") == 2 and "ab" * 32 + "  train.py" in asked[0]
    assert "OMP_NUM_THREADS=1" in asked[0] and "not applied" in asked[0] and "PYTHONPATH" in asked[0]
    with pytest.raises(ConsentError, match="not agreed to"):
        Consent(ask=lambda text: answer(text, False)).grant(launches, "samestep bisect")


def test_the_process_count_is_capped_by_this_machine():
    """A CPU run's process count up to the cores this process may use replays; one past it, and a count that is
    not one, are refused naming the field. A GPU run is capped by the GPUs."""
    cores = len(os.sched_getaffinity(0))
    ran = {"launcher": {"name": "torchrun", "nproc_per_node": cores, "nnodes": 1}}
    assert program.process_cap(ran, Path("run"), None) == cores
    for bad in (cores + 1, 0, "2", True):
        with pytest.raises(program.ProgramError, match=r"launcher.nproc_per_node="):
            program.process_cap({"launcher": {"nproc_per_node": bad}}, Path("run"), None)
    with pytest.raises(program.ProgramError, match="this machine has 0 GPUs"):
        program.process_cap({"launcher": {"nproc_per_node": 1}}, Path("run"), 0)


def test_only_the_variables_that_change_bits_are_applied():
    """relaunch applies the record's bit-changing variables and no other (control: OMP_NUM_THREADS is), runs
    this interpreter whatever the record's executable, and ignored_env names the rest."""
    ran = {
        "argv": ["/evil/python", "train.py"],
        "cwd": "/work",
        "executable": "/evil/python",
        "launcher": {},
        "env": {"OMP_NUM_THREADS": "3", "PYTHONPATH": "/evil", "LD_PRELOAD": "/evil.so"},
    }
    cmd, _, env = program.relaunch(ran)
    assert cmd == [sys.executable, "train.py"] and env["OMP_NUM_THREADS"] == "3"
    for name in ("PYTHONPATH", "LD_PRELOAD"):  # the verifier's own, whatever the record says
        assert env.get(name) == os.environ.get(name)
    assert program.ignored_env(ran) == ["LD_PRELOAD", "PYTHONPATH"]


def test_the_identity_reads_the_git_commit_without_running_git(tmp_path):
    """identity names the commit a working tree's .git says (a branch ref, or packed-refs), hashes each recorded
    file as it is now (None: gone), and binds them into one program hash that changes with any file."""
    (tmp_path / "train.py").write_text("print(1)\n")
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "packed-refs").write_text("# pack-refs\n" + "1" * 40 + " refs/heads/main\n")
    ran = {"argv": ["python", "train.py"], "cwd": str(tmp_path), "sources": {"train.py": "x", "gone.py": "y"}}
    first = program.identity(ran)
    assert first["commit"] == "1" * 40 and first["entry"] == "train.py" and first["files"]["gone.py"] is None
    (git / "refs" / "heads" / "main").write_text("2" * 40 + "\n")
    (tmp_path / "train.py").write_text("print(2)\n")
    second = program.identity(ran)
    assert second["commit"] == "2" * 40 and second["program"] != first["program"]


def test_a_stale_scratch_is_removed_only_when_its_verifier_is_gone(tmp_path):
    """A scratch root whose owner mark is a process that ended is removed; one of a live process, and a
    directory without an owner file, are kept (controls)."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_mark = process_mark(ended.pid)
    ended.wait()
    assert alive(process_mark()) and not alive(dead_mark)
    roots = {name: tmp_path / f"samestep-verify-{name}" for name in ("dead", "live", "unowned")}
    for root in roots.values():
        root.mkdir()
    (roots["dead"] / OWNER).write_text(json.dumps({"mark": dead_mark}))
    (roots["live"] / OWNER).write_text(json.dumps({"mark": process_mark()}))
    assert remove_stale(tmp_path) == [roots["dead"]]
    assert not roots["dead"].exists() and roots["live"].exists() and roots["unowned"].exists()


def test_a_replay_process_is_killed_with_its_group_when_the_wait_ends_early(tmp_path):
    """A timeout (as Ctrl-C or SIGTERM would) kills the child and the processes of its group (a grandchild).
    Control: a child that finishes returns its output."""
    assert run_child([sys.executable, "-c", "print('done')"], timeout=60).stdout == "done\n"
    pidfile = tmp_path / "grandchild"
    script = (
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
        f"time.sleep(60)']); open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        run_child([sys.executable, "-c", script], timeout=8)
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while (
        time.monotonic() < deadline
        and Path(f"/proc/{grandchild}").exists()
        and Path(f"/proc/{grandchild}/stat").read_text().split()[2] != "Z"
    ):
        time.sleep(0.1)
    assert not Path(f"/proc/{grandchild}").exists() or Path(f"/proc/{grandchild}/stat").read_text().split()[2] == "Z"


@pytest.mark.parametrize(
    "field,value",
    [
        ("cwd", 3),
        ("launcher", {"nnodes": "2"}),
        ("launcher", []),
        ("sources", {"train.py": 1}),
        ("env", []),
        ("run_dir", None),
    ],
)
def test_a_record_of_other_types_than_a_run_writes_is_refused_by_field(tmp_path, field, value):
    """A program record whose field is not of the type samestep.Run writes (a record made by hand) is refused
    naming the field, not a crash. Control: the record as written passes."""
    (tmp_path / "train.py").write_text("pass\n")
    ran = {
        "argv": ["python", "train.py"],
        "cwd": str(tmp_path),
        "entry": "script",
        "target": "train.py",
        "sources": {
            "train.py": program.identity(
                {"argv": ["python", "train.py"], "cwd": str(tmp_path), "sources": {"train.py": ""}}
            )["files"]["train.py"]
        },
        "launcher": {"name": "python", "nproc_per_node": 1, "nnodes": 1},
        "env": {},
        "run_dir": "a",
    }
    assert program.check(ran, tmp_path) == []
    with pytest.raises(program.ProgramError, match=rf"programs\[\]\.{field}="):
        program.check({**ran, field: value}, tmp_path)


def test_only_verify_takes_a_program_after_the_double_dash(capsys):
    """`--` before a program is verify's alone: another command, or verify with nothing after it, exits 2 naming
    it (argparse's usage error). Control: verify's own parse takes the program (its run directory is missing:
    the error is that, not the `--`)."""
    from samestep.cli import main

    for argv in (["diff", "a", "b", "--", "python", "x.py"], ["verify", "a", "--"]):
        with pytest.raises(SystemExit) as ended:
            main(argv)
        assert ended.value.code == 2 and "--" in capsys.readouterr().err
    assert main(["verify", "no_such_run", "--", sys.executable, "train.py"]) == 2
    assert "no_such_run" in capsys.readouterr().err

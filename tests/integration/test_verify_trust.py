"""`samestep verify` and `bisect` of a run directory handed over by someone else: what its run.json records
decides nothing that runs without the verifier's word, and a verdict names what ran (docs/debugging.md,
"Verifying someone else's run"). Each attack edits a copy of an honest run of tests/programs/replayed_loop.py;
the honest run verifying "reproduced" with --yes is the control of each (the first test)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import cli_here

pytestmark = pytest.mark.slow

PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "replayed_loop.py"
# A program that leaves a mark where it runs, then runs the honest one: foreign code that would still reproduce.
EVIL = """import pathlib, runpy, sys
pathlib.Path(__file__).with_name("RAN").write_text("foreign code ran")
sys.argv = ["replayed_loop.py", *sys.argv[1:]]
runpy.run_path("replayed_loop.py", run_name="__main__")
"""


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """The program's working tree with an honest run ``a`` (4 steps, a checkpoint each step), one ``p`` with a
    ULP planted after step 3, and evil.py."""
    root = tmp_path_factory.mktemp("trust")
    shutil.copy(PROGRAM, root)
    (root / "evil.py").write_text(EVIL)
    env = {k: v for k, v in os.environ.items() if k != "SAMESTEP_REPLAY"}
    procs = [
        subprocess.Popen(
            [sys.executable, "replayed_loop.py", *args],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        for args in (["a"], ["p", "--plant-step", "3"])
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
    return root


def _forged(tree: Path, name: str, edit) -> Path:
    """A copy of run a whose program record ``edit`` changed (run.json rewritten as a forger would)."""
    copy = tree / name
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(tree / "a", copy)
    doc = json.loads((copy / "run.json").read_text())
    edit(doc["programs"][0])
    (copy / "run.json").write_text(json.dumps(doc))
    return copy


def _ran(tree: Path) -> bool:
    mark = tree / "RAN"
    found = mark.exists()
    mark.unlink(missing_ok=True)
    return found


def test_a_program_runs_only_on_the_verifiers_word_and_the_verdict_names_what_ran(tree):
    """Without a terminal and without --yes, verify and bisect of a run whose program is another script (its
    record consistent: argv, target and hash of evil.py) run nothing: exit 2, one line naming the command, the
    directory and the code. With --yes it runs (control: the mark appears), and the verdict names evil.py by
    its hash, not "reproduced": the replay also ran replayed_loop.py, which the record does not hash. The
    honest run, with --yes: "reproduced by replayed_loop.py sha256:..."."""

    def to_evil(p):
        p.update(argv=[p["argv"][0], "evil.py", "a"], target="evil.py", sources={"evil.py": _sha(tree / "evil.py")})

    forged = _forged(tree, "to_evil", to_evil)
    for argv in (("verify", str(forged), "--steps", "4"), ("bisect", str(forged), str(tree / "p"))):
        proc = cli_here(*argv)
        assert proc.returncode == 2 and not _ran(tree), proc.stdout + proc.stderr
        line = proc.stderr.strip()
        assert "\n" not in line and "evil.py a`" in line and str(tree) in line and "--yes" in line, line
        assert f"evil.py sha256:{_sha(tree / 'evil.py')[:12]}" in line and "nothing ran" in line, line
    report = json.loads(cli_here("verify", "--yes", str(forged), "--steps", "4", "--json").stdout)
    assert _ran(tree) and not report["reproduced"], report
    assert report["by"]["entry"] == "evil.py" and report["program_differs"] == [
        "replayed_loop.py: not hashed by the run"
    ], report
    honest = cli_here("verify", "--yes", str(tree / "a"), "--steps", "4")
    assert (
        honest.returncode == 0
        and "reproduced by replayed_loop.py sha256:" + _sha(tree / "replayed_loop.py")[:12] in honest.stdout
    ), honest.stdout + honest.stderr


@pytest.mark.parametrize(
    "attack,says",
    [
        ("argv", "its argv runs the script 'evil.py'"),
        ("argv_and_target", "does not hash evil.py"),
        ("dash_c", "runs a `python -c` command"),
        ("dash_m", "its argv runs the module 'evil'"),
        ("cwd", "replayed_loop.py: edited since the run"),
        ("nproc", "nproc_per_node=1000000"),
        ("launcher_in_argv", "runs the launcher torch.distributed.run"),
    ],
)
def test_a_record_that_does_not_say_what_runs_is_refused_even_with_yes(tree, attack, says):
    """argv pointing at evil.py with the record's target and hashes left as they were; argv and target, the
    hashes not; `python -c CODE` or `-m evil` while the entry still says the script; the directory moved to
    another tree whose replayed_loop.py is other code; a million processes; torchrun in the arguments (a launcher
    whose process count no cap sees): refused by name (exit 2) with --yes, and nothing ran."""
    other = tree / "other_tree"
    other.mkdir(exist_ok=True)
    (other / "replayed_loop.py").write_text(EVIL)
    edits = {
        "argv": lambda p: p.update(argv=[p["argv"][0], "evil.py", "a"]),
        "argv_and_target": lambda p: p.update(argv=[p["argv"][0], "evil.py", "a"], target="evil.py"),
        "dash_c": lambda p: p.update(argv=[p["argv"][0], "-c", "open('RAN', 'w')"]),
        "dash_m": lambda p: p.update(argv=[p["argv"][0], "-m", "evil", "a"]),
        "cwd": lambda p: p.update(cwd=str(other)),
        "nproc": lambda p: p["launcher"].update(nproc_per_node=1000000),
        "launcher_in_argv": lambda p: p.update(
            argv=[p["argv"][0], "-m", "torch.distributed.run", "--nproc_per_node", "64", "evil.py", "a"],
            entry="module",
            target="torch.distributed.run",
        ),
    }
    forged = _forged(tree, f"attack_{attack}", edits[attack])
    proc = cli_here("verify", "--yes", str(forged), "--steps", "4")
    assert proc.returncode == 2 and says in proc.stderr, proc.stdout + proc.stderr
    assert not _ran(tree) and not (other / "RAN").exists()


def test_an_interpreter_and_variables_from_the_record_are_not_used(tree, tmp_path):
    """executable pointing at a wrapper that leaves a mark and then execs python, and env holding PYTHONPATH (a
    sitecustomize.py that leaves a mark), LD_PRELOAD and PYTHONINSPECT: with --yes the replay runs under this
    interpreter with only the variables that change bits, reproduces, and names what it did not apply. Control:
    the wrapper and the sitecustomize leave their marks when run."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\necho wrapped > {tmp_path / "WRAPPED"}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(f"open({str(tmp_path / 'SITE')!r}, 'w').write('ran')\n")

    def edit(p):
        p["executable"] = str(wrapper)
        p["env"].update(PYTHONPATH=str(tmp_path / "site"), LD_PRELOAD="/nonexistent/preload.so", PYTHONINSPECT="1")

    forged = _forged(tree, "wrapped", edit)
    report = json.loads(cli_here("verify", "--yes", str(forged), "--steps", "4", "--json").stdout)
    assert report["reproduced"], report
    assert not (tmp_path / "WRAPPED").exists() and not (tmp_path / "SITE").exists()
    notes = " ".join(report["notes"])
    assert "not applied from the record: LD_PRELOAD, PYTHONINSPECT, PYTHONPATH" in notes, notes
    assert f"not the recorded {wrapper}" in notes, notes
    subprocess.run([str(wrapper), "-c", "pass"], env={**os.environ, "PYTHONPATH": str(tmp_path / "site")}, check=True)
    assert (tmp_path / "WRAPPED").exists() and (tmp_path / "SITE").exists()


def _replay_pids(marker: str) -> list[int]:
    """The processes whose environment holds a replay request naming ``marker``."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                environ = (d / "environ").read_bytes()
                if marker.encode() in environ and b"SAMESTEP_REPLAY" in environ:
                    found.append(int(d.name))
            except OSError:
                continue
    return found


def _wait(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_replay_dies_with_its_verifier_and_its_scratch_does_not_outlive_it(tree, tmp_path, how):
    """A run whose steps take 3 s each, verified from scratch; the verifier is stopped once its replay runs:
    the replay ends within seconds (SIGKILL: by the parent-death signal; SIGTERM: the verifier kills it and
    exits 130), and the scratch directory is gone: at once for SIGTERM, by the next verifier's start for
    SIGKILL (a scratch whose verifier lives is kept: the control)."""
    env = {k: v for k, v in os.environ.items() if k != "SAMESTEP_REPLAY"}
    slow = f"slow_{how}"
    proc = subprocess.run(
        [sys.executable, "replayed_loop.py", slow, "--steps", "2", "--sleep", "3"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    temp = tmp_path / "temp"
    temp.mkdir()
    verifier = subprocess.Popen(
        [sys.executable, "-m", "samestep", "verify", "--yes", str(tree / slow), "--steps", "1-2"],
        env={**env, "TMPDIR": str(temp)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert _wait(lambda: _replay_pids(str(temp)), 120), verifier.stderr.read() if verifier.poll() is not None else ""
    scratch = list(temp.glob("samestep-verify-*"))
    assert len(scratch) == 1
    from samestep.replay.scratch import remove_stale

    assert remove_stale(temp) == [] and scratch[0].exists()  # its verifier lives: kept
    verifier.send_signal(getattr(signal, how))
    code = verifier.wait(timeout=60)
    assert _wait(lambda: not _replay_pids(str(temp)), 15), "the replay outlived its verifier"
    if how == "SIGTERM":
        assert code == 130 and not scratch[0].exists(), (code, verifier.stderr.read())
    else:
        assert code == -signal.SIGKILL and scratch[0].exists()
        assert remove_stale(temp) == scratch and not scratch[0].exists()


def _at_a_terminal(argv: list[str], answer: str, env: dict[str, str]) -> tuple[int, str]:
    """``python -m samestep ARGV`` with a terminal for stdin and stderr: ``answer`` typed at its prompt (the
    first "[y/N]" it shows). Returns its exit code and what the terminal showed."""
    import pty
    import select

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "samestep", *argv],
        stdin=follower,
        stdout=subprocess.PIPE,
        stderr=follower,
        env=env,
        text=True,
    )
    os.close(follower)
    shown, answered, deadline = b"", False, time.monotonic() + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the process closed the terminal
                break
            shown += chunk
            if not answered and b"[y/N]" in shown:
                os.write(leader, answer.encode() + b"\n")
                answered = True
        elif proc.poll() is not None:
            break
    code = proc.wait(timeout=300)
    os.close(leader)
    return code, shown.decode(errors="replace") + proc.stdout.read()


def test_at_a_terminal_the_program_is_shown_and_runs_on_yes_only(tree):
    """With a terminal, verify shows the command, the directory and every file with its SHA-256, and asks: a no
    runs nothing (exit 2), a yes replays and reproduces (exit 0)."""
    env = {k: v for k, v in os.environ.items() if k != "SAMESTEP_REPLAY"}
    argv = ["verify", str(tree / "a"), "--steps", "4"]
    code, shown = _at_a_terminal(argv, "n", env)
    assert code == 2 and "not agreed to" in shown, shown
    assert "command:" in shown and f"{_sha(tree / 'replayed_loop.py')}  replayed_loop.py" in shown, shown
    code, shown = _at_a_terminal(argv, "y", env)
    assert code == 0 and "reproduced by replayed_loop.py" in shown, shown


def test_a_program_the_verifier_gives_runs_without_asking_and_is_checked_against_the_runs_hashes(
    tree, tmp_path, monkeypatch
):
    """`samestep verify RUN -- python replayed_loop.py a`, in the verifier's own checkout of the program: it runs
    with no --yes (the verifier's own word), under the run's launcher, and reproduces, naming that code. A
    checkout whose script differs from the run's hashes is refused (exit 2) as a changed program is; a command
    line that is not `python SCRIPT` is refused by name (controls)."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy(tree / "replayed_loop.py", checkout)
    monkeypatch.chdir(checkout)
    proc = cli_here("verify", str(tree / "a"), "--steps", "4", "--", sys.executable, "replayed_loop.py", "a")
    assert proc.returncode == 0 and "reproduced by replayed_loop.py sha256:" in proc.stdout, proc.stdout + proc.stderr
    assert not (checkout / "a").exists() and not _ran(tree)  # the replay wrote its scratch directory only
    with open(checkout / "replayed_loop.py", "a") as f:
        f.write("# another version\n")
    proc = cli_here("verify", str(tree / "a"), "--steps", "4", "--", sys.executable, "replayed_loop.py", "a")
    assert proc.returncode == 2 and "replayed_loop.py: edited since the run" in proc.stderr, proc.stderr
    proc = cli_here("verify", str(tree / "a"), "--steps", "4", "--", "bash", "-c", "true")
    assert proc.returncode == 2 and "give it as `python SCRIPT ARGS`" in proc.stderr, proc.stderr

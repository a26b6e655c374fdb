"""Preemption: a signal stops samestep train after the step it is in, with a checkpoint of that step, and
--resume continues bit for bit; a second signal stops at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from samestep.determinism.preempt import EXIT_PREEMPTED
from samestep.records.metrics import last_logged_step
from tests.support import TINY, Forked, metrics_bytes, run_train, train_cmd, train_here

# Checkpoints only at the end: without the signal handler a stop loses every step.
LONG = (*TINY, "train.steps=120", "train.checkpoint_every=1000")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The run straight through, in this process (its bits are a fresh process's, test_train shows)."""
    d = tmp_path_factory.mktemp("preempt") / "reference"
    train_here(d, *LONG)
    return d


def _signalled(run_dir: Path, *settings: str, sig: int = signal.SIGTERM) -> Forked:
    """Starts a run, sends it ``sig`` once it has logged step 3; returns the finished process."""
    proc = Forked(train_cmd(run_dir, *LONG, *settings)[3:])
    deadline = time.monotonic() + 300
    while proc.poll() is None and last_logged_step(run_dir) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be signalled"
    proc.send_signal(sig)
    proc.wait(timeout=300)
    return proc


def test_sigterm_saves_the_step_and_resume_is_exact(reference, tmp_path):
    """SIGTERM after step 3: the run finishes the step it is in, checkpoints it, exits 75 naming the step;
    --resume ends with the uninterrupted run's final digest and metrics bytes. Negative control: with
    train.exit_signals='' the same signal kills the run at once and nothing is saved."""
    run = tmp_path / "run"
    proc = _signalled(run)
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-2000:]
    step = last_logged_step(run)
    assert 3 <= step < 120
    assert f"samestep train: stopped by SIGTERM after step {step}, with a checkpoint" in proc.stderr
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{step:06d}"
    final = train_here(run, *LONG, resume=True)
    assert final["state_digest"] == json.loads((reference / "final.json").read_text())["state_digest"]
    assert metrics_bytes(run) == metrics_bytes(reference)

    killed = tmp_path / "killed"
    proc = _signalled(killed, "train.exit_signals=")
    assert proc.returncode == -signal.SIGTERM
    assert not (killed / "checkpoints").exists() or not any((killed / "checkpoints").glob("step_*"))


def test_a_second_signal_stops_at_once(tmp_path):
    """The first signal only asks for a stop (the loop goes on to its step boundary); the second, a second
    later, stops the process at once with the code a shell gives one that signal ended (143 for SIGTERM, as the
    `--nproc` launcher passes on its processes' codes); the same signal twice at once
    (a job's every process signalled, and a launcher forwarding it) is one request. Negative control: one
    signal alone leaves it running to its own end."""
    script = (
        "import os, signal, sys, time\n"
        "from samestep.determinism.preempt import StopRequest\n"
        "with StopRequest(('SIGTERM',)) as stop:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    if sys.argv[1] == 'duplicated':\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.2)\n"
        "    print(stop.requested, flush=True)\n"
        "    if sys.argv[1] == 'twice':\n"
        "        time.sleep(1)\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(5)\n"
        "print('ended by itself', flush=True)\n"
    )
    for how in ("once", "duplicated"):
        once = Forked([how], code=script)
        assert once.wait(60) == 0 and once.stdout.split() == ["SIGTERM", "ended", "by", "itself"], once.stderr
    twice = Forked(["twice"], code=script)
    assert twice.wait(60) == 128 + signal.SIGTERM and twice.stdout.split() == ["SIGTERM"], twice.stderr
    assert "SIGTERM again: stopping now, without saving (exit 143)" in twice.stderr


def test_two_processes_stop_as_one_job_with_exit_75_and_resume_exact(reference, tmp_path):
    """`samestep train --nproc 2` signalled as a scheduler or a terminal does (SIGTERM to the launcher's
    whole process group): both processes finish the same step and save it, the job exits 75 (torchrun
    would make it 1), and --resume on 2 processes ends with the one-process run's final digest and
    metrics bytes."""
    run = tmp_path / "run"
    proc = Forked(train_cmd(run, *LONG, nproc=2)[3:], new_session=True)
    deadline = time.monotonic() + 300
    while proc.poll() is None and last_logged_step(run) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be signalled"
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(300)
    err = proc.stderr
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    step = last_logged_step(run)
    assert 3 <= step < 120 and f"stopped by SIGTERM after step {step}, with a checkpoint" in err
    final = run_train(run, *LONG, resume=True, nproc=2)
    assert final["state_digest"] == json.loads((reference / "final.json").read_text())["state_digest"]
    assert metrics_bytes(run) == metrics_bytes(reference)


def test_a_signal_while_the_stopped_process_exits_leaves_its_exit_code_its_own(tmp_path):
    """After a stop was asked for and the loop has left its block, the process exits with its own code (75)
    even when a second signal arrives while the interpreter tears down (torch's teardown takes a second or so;
    here an object that takes 3 s to go): the interpreter has put its handlers back to the default by then.
    Negative control: the same teardown without a stop request is ended by the signal (-15)."""
    script = (
        "import os, signal, sys, time\n"
        "from samestep.determinism.preempt import StopRequest\n"
        "class Slow:\n"
        "    def __del__(self, sleep=time.sleep):\n"
        "        print('tearing down', flush=True)\n"
        "        sleep(3)\n"
        "keep = Slow()\n"
        "if sys.argv[1] == 'stopped':\n"
        "    with StopRequest(('SIGTERM',)):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(0.2)\n"
        "sys.exit(75)\n"
    )
    codes = {}
    for how in ("stopped", "plain"):
        proc = subprocess.Popen(
            [sys.executable, "-c", script, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for line in proc.stdout:
            if "tearing down" in line:
                proc.send_signal(signal.SIGTERM)
                break
        codes[how] = proc.wait(timeout=60)
    assert codes == {"stopped": EXIT_PREEMPTED, "plain": -signal.SIGTERM}, codes

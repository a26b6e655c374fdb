"""The README's quick start is examples/quickstart.py as it runs, and the examples do what they say."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import Forked, cli_here, script_here, side_by_side

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "own_loop.py"


def _together(*runs: tuple[Path, tuple[str, ...], int]) -> list[str]:
    """Runs the example side by side (independent runs), each in a process of its own (``Forked``) and
    expected to exit with its code; their digests."""
    procs = [Forked([str(run_dir), *args], script=EXAMPLE) for run_dir, args, _ in runs]
    out = []
    for p, (_, _, code) in zip(procs, runs):
        assert p.wait() == code, p.stderr[-3000:]
        out.append(p.stdout.strip())
    return out


def _here(run_dir: Path, *args: str) -> str:
    """The example run to its end in this process; its digest."""
    done = script_here(EXAMPLE, str(run_dir), *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def _diff(a: Path, b: Path) -> int:
    return cli_here("diff", str(a), str(b)).returncode


def test_the_readme_shows_the_quick_start_as_it_is_and_it_runs_as_printed(tmp_path):
    """The README's code block is examples/quickstart.py, whole; run as the README prints it, twice, it gives
    one digest; interrupted (SIGINT after 20 steps) it exits 75 (EXIT_PREEMPTED) printing nothing, and run
    again, it prints the same digest. The weights of the newest checkpoint, digested as the script digests its
    model's, are that digest for the finished run. Negative control: those of the interrupted run's
    checkpoint are another digest (its weights stopped early)."""
    import signal
    import time

    from safetensors.torch import load_file

    import samestep

    def saved(run: Path) -> str:
        newest = sorted((run / "checkpoints").glob("step_*"))[-1]
        state = load_file(newest / "model.safetensors")
        order = ("0.weight", "0.bias", "2.weight", "2.bias")  # model.parameters()' order
        return samestep.digest(torch.cat([state[k].reshape(-1) for k in order]))

    code = (ROOT / "examples" / "quickstart.py").read_text(encoding="utf-8")
    assert f"```python\n{code}```" in (ROOT / "README.md").read_text(encoding="utf-8")
    script = str(ROOT / "examples" / "quickstart.py")
    runs = [
        script_here(script, str(tmp_path / "a")),  # as printed, in a fresh process and in this one
        subprocess.run([sys.executable, script, str(tmp_path / "b")], capture_output=True, text=True, timeout=300),
    ]
    assert runs[0].returncode == 0 and runs[0].stdout == runs[1].stdout, runs[0].stderr[-2000:]
    assert saved(tmp_path / "a") == runs[0].stdout.strip()
    proc = Forked([str(tmp_path / "c")], script=Path(script))
    deadline = time.monotonic() + 300
    while not list((tmp_path / "c" / "checkpoints").glob("step_*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(300) == 75 and proc.stdout == "", proc.stderr[-2000:]
    stopped = saved(tmp_path / "c")
    again = script_here(script, str(tmp_path / "c"))
    assert again.stdout == runs[0].stdout and stopped != runs[0].stdout.strip()


def test_the_example_resumes_to_the_same_bits_and_diffs_identical(tmp_path):
    """Stopped by a signal after 3 of 6 steps (exit 75, EXIT_PREEMPTED) and resumed, the example ends with
    the parameters' digest of the run straight through, and `samestep diff` says identical (exit 0).
    Negative control: another seed ends elsewhere, and the diff exits 1."""
    (halfway,) = _together((tmp_path / "resumed", ("--stop-after", "3"), 75))  # a signal: in a process of its own
    straight = _here(tmp_path / "straight")
    assert halfway != straight
    assert sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").glob("step_*"))[-1] == "step_000003"
    resumed, other = _here(tmp_path / "resumed"), _here(tmp_path / "other", "--seed", "1")
    assert resumed == straight
    assert _diff(tmp_path / "straight", tmp_path / "resumed") == 0
    assert other != straight
    assert _diff(tmp_path / "straight", tmp_path / "other") == 1


@pytest.mark.slow
def test_the_parallel_loop_example_prints_one_digest_on_one_process_ddp_and_fsdp2(tmp_path):
    """examples/parallel_loop.py as its docstring prints it: on one process, and under torchrun on 2 processes
    with DDP (samestep's communication hook) and with FSDP2 (samestep's reduce-scatter), each through
    samestep.Run: the same digest of the final parameters (the bits of one process; the hook's and the
    reduce-scatter's negative controls are in test_ddp_hook.py and test_run_sharded.py)."""
    script = str(ROOT / "examples" / "parallel_loop.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script]
    cmds = [
        [sys.executable, script, str(tmp_path / "one")],
        [*torchrun, str(tmp_path / "ddp"), "--layout", "ddp"],
        [*torchrun, str(tmp_path / "fsdp"), "--layout", "fsdp"],
    ]
    runs = side_by_side(
        *(lambda c=c: subprocess.run(c, capture_output=True, text=True, timeout=300, env=env) for c in cmds)
    )
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    digests = [run.stdout.strip() for run in runs]
    assert len(digests[0]) == 32 and digests == [digests[0]] * 3
    assert (tmp_path / "fsdp" / "checkpoints" / "step_000006" / "model.rank_00001.safetensors").is_file()

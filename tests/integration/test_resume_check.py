"""A resume checks itself, in a loop of one's own under samestep.Run (docs/api.md, "What stays yours"): a loop
that keeps its LR scheduler outside Run, killed with SIGKILL and resumed, stops at the first step it computes
again, exit 7, one line; the same loop with ``scheduler=`` resumes to the uninterrupted run's bits."""

from __future__ import annotations

import json
import signal

import pytest

from samestep.exit_codes import RESUME_DIVERGED
from samestep.records.receipts import receipts_path
from tests.support import Forked, cli_here

pytestmark = pytest.mark.slow

# argv: RUN_DIR held|outside [KILL_AT [SIGNAL]]: a per-step LambdaLR, handed to Run or not; SIGKILL (or the
# signal named) after the update of step KILL_AT (killed after step 6: the receipts of steps 1..5 on disk, the
# checkpoint of step 3 the newest; stopped by SIGTERM after step 5: a checkpoint of step 5, nothing after it)
LOOP = """
import os, signal, sys
import torch
import samestep

run_dir, held = sys.argv[1], sys.argv[2] == "held"
kill_at = int(sys.argv[3]) if len(sys.argv) > 3 else 0
sig = getattr(signal, sys.argv[4]) if len(sys.argv) > 4 else signal.SIGKILL
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
with samestep.Run(run_dir, model=model, optimizer=opt, scheduler=sched if held else None, checkpoint_every=3) as run:
    for step in run.steps(8):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        run.metric("loss", loss)
        opt.step()
        if step == kill_at:
            os.kill(os.getpid(), sig)
        opt.zero_grad(set_to_none=True)
        sched.step()
"""


def _run(*argv: str, script=None) -> Forked:
    proc = Forked([str(a) for a in argv], code=None if script else LOOP, script=script)
    proc.wait()
    return proc


def test_a_scheduler_kept_outside_run_stops_the_resume_at_the_first_step_computed_again(tmp_path):
    """Outside: warned at start, naming the fix; killed after step 6's update (receipts 1..5, checkpoint 3);
    the resume stops at step 4, exit 7, one line naming the step, the state that differs and scheduler=, and
    the receipts file is as the kill left it. Control: with ``scheduler=`` the same kill and resume exit 0, and
    the receipts are the uninterrupted run's, byte for byte."""
    whole, held, outside = tmp_path / "whole", tmp_path / "held", tmp_path / "outside"
    assert _run(whole, "held").returncode == 0
    assert _run(held, "held", 6).returncode == -signal.SIGKILL
    resumed = _run(held, "held")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert receipts_path(held, 0).read_bytes() == receipts_path(whole, 0).read_bytes()
    assert "scheduler" not in resumed.stderr

    killed = _run(outside, "outside", 6)
    assert killed.returncode == -signal.SIGKILL
    assert "an LR scheduler steps this optimizer, but Run was not given it" in killed.stderr
    before = receipts_path(outside, 0).read_bytes()
    assert before.count(b"\n") == 6  # the header and the receipts of steps 1..5
    stopped = _run(outside, "outside")
    assert stopped.returncode == RESUME_DIVERGED == 7, stopped.stderr[-2000:]
    line = stopped.stderr.strip().splitlines()[-1]
    assert "the resume from step 3 computed step 4 again to other bits" in line and "scheduler=" in line
    assert "Traceback" not in stopped.stderr
    assert receipts_path(outside, 0).read_bytes() == before


def test_bisect_names_a_resume_that_lost_state_not_a_race(tmp_path):
    """A loop with its scheduler outside Run, stopped by SIGTERM after step 5 (a checkpoint of step 5, no receipt
    after it: nothing to check) and resumed, ends on other bits than the same loop straight through; bisect
    finds step 6, and its replays from step 3 agree (both lose the scheduler alike), so it names the resume
    from step 5, not a race. Control: the same stop and resume with ``scheduler=`` bisects identical."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    for name, held in (("a", "outside"), ("b", "outside"), ("held_a", "held"), ("held_b", "held")):
        argv = (tmp_path / name, held, *((5, "SIGTERM") if name.endswith("b") else ()))
        assert _run(*argv, script=script).returncode == 0
        if name.endswith("b"):
            assert _run(tmp_path / name, held, script=script).returncode == 0
    lost = cli_here("bisect", str(tmp_path / "a"), str(tmp_path / "b"), "--yes", "--json")
    report = json.loads(lost.stdout)
    assert lost.returncode == 1 and report["first_divergent_step"] == 6, lost.stdout + lost.stderr
    assert "the first step after run B's resume from step 5" in report["summary"], report["summary"]
    assert "not a race" in report["summary"] and not report["reproduced"]
    held = cli_here("bisect", str(tmp_path / "held_a"), str(tmp_path / "held_b"), "--yes", "--json")
    assert held.returncode == 0 and json.loads(held.stdout)["identical"], held.stdout + held.stderr

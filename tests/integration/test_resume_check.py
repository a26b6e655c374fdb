"""A resume checks itself, in a loop of one's own under samestep.Run (docs/api.md, "What stays yours"): a loop
that keeps its LR scheduler outside Run, killed with SIGKILL and resumed, stops at the first step it computes
again, exit 7, one line; the same loop with ``scheduler=`` resumes to the uninterrupted run's bits."""

from __future__ import annotations

import signal

import pytest

from samestep.exit_codes import RESUME_DIVERGED
from samestep.records.receipts import receipts_path
from tests.support import Forked

pytestmark = pytest.mark.slow

# argv: RUN_DIR held|outside [KILL_AT]: a per-step LambdaLR, handed to Run or not; SIGKILL after the update of
# step KILL_AT (the receipts of the steps before it on disk, the checkpoint of step 3 the newest)
LOOP = """
import os, signal, sys
import torch
import samestep

run_dir, held = sys.argv[1], sys.argv[2] == "held"
kill_at = int(sys.argv[3]) if len(sys.argv) > 3 else 0
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
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad(set_to_none=True)
        sched.step()
"""


def _run(*argv: str) -> Forked:
    proc = Forked([str(a) for a in argv], code=LOOP)
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

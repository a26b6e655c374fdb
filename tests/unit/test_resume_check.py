"""A resume checks itself (records/resume_check.py): the receipts a killed segment wrote after the checkpoint
are kept, each recomputed step's receipt is checked against its old one, and the first that differs stops the
run with the file unchanged."""

from __future__ import annotations

import pytest
import torch

from samestep.exit_codes import RESUME_DIVERGED
from samestep.records.receipt_writer import continue_receipts
from samestep.records.receipts import receipts_path
from samestep.records.resume_check import ResumeDiverged, receipts_after

GENESIS = "0" * 64


def _state(step: int, off: int = 0) -> dict:
    return {"w": torch.arange(4, dtype=torch.float32) * step + (off if step == 4 else 0)}


def _segment(run_dir, start: int, last: int, off: int = 0, check: bool = True, close: bool = True):
    """The receipts of steps start+1..last, written as a run that resumed after ``start`` writes them."""
    w = continue_receipts(run_dir, 0, start, GENESIS, check=check)
    try:
        for step in range(start + 1, last + 1):
            w.add(step, lambda s=step: _state(s, off), float(step), 0.5)
        w.sync()
    finally:
        if close:
            w.close()
    return w


def test_a_resume_that_computes_the_old_steps_again_keeps_them_and_goes_on(tmp_path):
    """Killed after step 5 (receipts 1..5 on disk), resumed after step 2: steps 3..5 are checked, not written
    again, and steps 6..7 follow; the file is the uninterrupted run's, byte for byte."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    _segment(whole, 0, 7)
    _segment(killed, 0, 5)
    assert [r["step"] for r in receipts_after(killed, 0, 2)] == [3, 4, 5]
    _segment(killed, 2, 7)
    assert receipts_path(killed, 0).read_bytes() == receipts_path(whole, 0).read_bytes()


def test_a_recomputed_step_with_other_bits_stops_the_resume_and_keeps_the_old_receipts(tmp_path):
    """Negative control: the same resume whose step 4 comes out other stops at step 4 (its own exit code,
    naming the step and what differs) and the file holds the killed segment's receipts unchanged; nothing
    after it is written."""
    run = tmp_path / "run"
    _segment(run, 0, 5)
    before = receipts_path(run, 0).read_bytes()
    with pytest.raises(ResumeDiverged) as caught:
        _segment(run, 2, 7, off=1)
    e = caught.value
    assert e.step == 4 and e.exit_code == RESUME_DIVERGED == 7
    assert "resume from step 2 computed step 4 again" in str(e) and "state " in str(e) and "loss" not in str(e)
    assert "scheduler=" in str(e) and "\n" not in str(e)
    assert receipts_path(run, 0).read_bytes() == before
    # the check repeats on the next resume: the old receipts are still there to check against
    assert [r["step"] for r in receipts_after(run, 0, 2)] == [3, 4, 5]


def test_without_the_check_a_resume_cuts_the_later_receipts(tmp_path):
    """A run that is not deterministic (check=False) goes on from the checkpoint's receipt, as before."""
    run = tmp_path / "run"
    _segment(run, 0, 5)
    _segment(run, 2, 6, off=1, check=False)
    assert [r["step"] for r in receipts_after(run, 0, 0)] == [1, 2, 3, 4, 5, 6]


def test_a_torn_line_after_the_kept_receipts_is_cut(tmp_path):
    """A killed segment's torn last line: the whole receipts before it are checked, the torn line dropped."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    _segment(whole, 0, 6)
    _segment(killed, 0, 4)
    with receipts_path(killed, 0).open("a") as f:
        f.write('{"step": 5, "sta')
    _segment(killed, 1, 6)
    assert receipts_path(killed, 0).read_bytes() == receipts_path(whole, 0).read_bytes()


def test_a_run_started_afresh_under_another_genesis_is_not_checked_against_the_old(tmp_path):
    """Killed before its first checkpoint and started again under another config (another genesis): nothing of
    the old start is checked; its receipts are replaced."""
    run = tmp_path / "run"
    _segment(run, 0, 3)
    w = continue_receipts(run, 0, 0, "1" * 64)
    w.add(1, lambda: _state(1, 9), 1.0, 0.5)
    w.close()
    assert [r["prev"] for r in receipts_after(run, 0, 0)] == ["1" * 64]


def test_receipts_of_shards_are_not_checked_against_a_resume_of_the_whole_state(tmp_path):
    """A run whose rank 0 receipted its shards, resumed on one process (receipts of the whole state): the old
    receipts are of another thing, so they are cut, not checked (a check would stop every such resume)."""
    run = tmp_path / "run"
    w = continue_receipts(run, 0, 0, GENESIS, state_of="rank")
    for step in range(1, 4):
        w.add(step, lambda s=step: _state(s), float(step), 0.5)
    w.close()
    w = continue_receipts(run, 0, 1, GENESIS, state_of="run")
    w.add(2, lambda: _state(2, 5), 2.0, 0.5)
    w.close()
    assert [(r["step"], r["state_of"]) for r in receipts_after(run, 0, 0)] == [(1, "rank"), (2, "run")]


def test_receipts_held_until_every_rank_agreed_are_written_only_on_release(tmp_path):
    """A rank of a sharded job whose own old receipts end before the job's last step computed again holds the
    receipts of the steps up to it (``hold_until``) and writes them on ``release`` (every rank's check passed):
    the file is then the straight run's. Negative control: closed without a release (another rank's check
    refused), none of them is written."""
    whole, held, dropped = tmp_path / "whole", tmp_path / "held", tmp_path / "dropped"
    _segment(whole, 0, 5)
    for run in (held, dropped):
        _segment(run, 0, 2)
        w = continue_receipts(run, 0, 2, GENESIS)
        w.hold_until = 4
        for step in range(3, 5):
            w.add(step, lambda s=step: _state(s), float(step), 0.5)
        w.wait()
        assert [r["step"] for r in receipts_after(run, 0, 0)] == [1, 2]
        if run == held:
            w.release()
            w.add(5, lambda: _state(5), 5.0, 0.5)
        w.close()
    assert receipts_path(held, 0).read_bytes() == receipts_path(whole, 0).read_bytes()
    assert [r["step"] for r in receipts_after(dropped, 0, 0)] == [1, 2]

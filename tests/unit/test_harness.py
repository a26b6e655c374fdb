"""The suite's own guard: a spawned process that never ends fails its test, naming where it is stuck."""

import time

import _pytest.outcomes
import pytest

import tests.support.processes as processes


def _stuck_forever(rank: int) -> None:
    while True:
        time.sleep(0.1)


def _quick(rank: int) -> None:
    pass


@pytest.mark.slow
def test_a_stuck_spawned_process_fails_its_test_with_its_stack_and_is_killed(monkeypatch):
    monkeypatch.setattr(processes, "SPAWN_DEADLINE_S", 3)
    processes.spawn(_quick, (), 2)  # the control: processes that end pass within the same deadline
    with pytest.raises(_pytest.outcomes.Failed) as failed:  # a guard that never fired would hang to pytest's timeout
        processes.spawn(_stuck_forever, (), 2)
    message = str(failed.value)
    assert "_stuck_forever's processes still running after 3 s" in message
    for rank in (0, 1):
        assert f"rank {rank} (pid " in message
    assert message.count("in _stuck_forever") == 2, message  # each rank's stack names the function it is stuck in


def _rank_1_exits_3_and_rank_0_fails_after(rank: int) -> None:
    import os

    if rank == 1:
        os._exit(3)
    time.sleep(0.5)
    raise RuntimeError("a peer's error, found first or not")


@pytest.mark.slow
def test_an_expected_exit_code_is_looked_for_in_every_process():
    """``spawn(..., exit_code=3)`` passes when any process ended with 3, though a peer failed too; the same
    check fails when none did (the control)."""
    processes.spawn(_rank_1_exits_3_and_rank_0_fails_after, (), 2, exit_code=3)
    with pytest.raises(AssertionError, match="no process of _quick ended with exit code 3"):
        processes.spawn(_quick, (), 2, exit_code=3)

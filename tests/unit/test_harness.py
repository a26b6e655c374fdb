"""The suite's own guard: a spawned process that never ends fails its test, naming where it is stuck."""

import time

import _pytest.outcomes
import pytest

import tests.conftest as conftest


def _stuck_forever(rank: int) -> None:
    while True:
        time.sleep(0.1)


def _quick(rank: int) -> None:
    pass


@pytest.mark.slow
def test_a_stuck_spawned_process_fails_its_test_with_its_stack_and_is_killed(monkeypatch):
    monkeypatch.setattr(conftest, "SPAWN_DEADLINE_S", 3)
    conftest.spawn(_quick, (), 2)  # the control: processes that end pass within the same deadline
    started = time.monotonic()
    with pytest.raises(_pytest.outcomes.Failed) as failed:
        conftest.spawn(_stuck_forever, (), 2)
    assert time.monotonic() - started < 60
    message = str(failed.value)
    assert "_stuck_forever's processes still running after 3 s" in message
    for rank in (0, 1):
        assert f"rank {rank} (pid " in message
    assert message.count("in _stuck_forever") == 2, message  # each rank's stack names the function it is stuck in

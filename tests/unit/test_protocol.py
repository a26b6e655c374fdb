"""The step protocol's shared rules (samestep/protocol.py): the stop every rank agrees on, and the order
in which a checkpoint's records are made durable before it is saved."""

from __future__ import annotations

import os

from samestep.preempt import StopRequest
from samestep.protocol import agreed_stop, save_after_records


class _Synced:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def sync(self) -> None:
        self.calls.append(self.name)


def test_a_checkpoint_is_saved_after_the_trace_the_receipts_and_the_metrics_are_durable(tmp_path, monkeypatch):
    """The trace, then the receipts, then metrics.jsonl's fsync, then the save; what a loop lacks is
    skipped. Control: the save alone is the last and only call without them."""
    calls: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("metrics"), real_fsync(fd)))
    with open(tmp_path / "metrics.jsonl", "w", encoding="utf-8") as metrics:
        save_after_records(lambda: calls.append("save"), _Synced("trace", calls), _Synced("receipts", calls),
                           metrics)
    assert calls == ["trace", "receipts", "metrics", "save"]
    calls.clear()
    save_after_records(lambda: calls.append("save"))
    assert calls == ["save"]


def test_every_rank_stops_after_the_same_step():
    """A rank's own signal stops it by name; another rank's stops it too ("a signal to another rank"); none
    goes on. Without signals watched there is no collective to call (a loop on one rank may skip it)."""
    stop = StopRequest(("SIGTERM",))
    assert agreed_stop(stop, lambda mine: mine) is None
    assert agreed_stop(stop, lambda mine: True) == "a signal to another rank"
    stop.requested = "SIGTERM"
    assert agreed_stop(stop, lambda mine: mine) == "SIGTERM"

    def no_collective(_flag: bool) -> bool:
        raise AssertionError("called a collective though no signal is watched")

    assert agreed_stop(StopRequest(()), no_collective) is None

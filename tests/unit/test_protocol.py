"""The step protocol's shared rules (samestep/loop/protocol.py): the stop every rank agrees on, and the order
in which a checkpoint's records are made durable before it is saved."""

from __future__ import annotations

import os

from samestep.determinism.preempt import StopRequest
from samestep.loop.protocol import agreed_stop, save_after_records


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
        save_after_records(lambda: calls.append("save"), _Synced("trace", calls), _Synced("receipts", calls), metrics)
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


def test_a_run_protocol_owns_deterministic_mode_it_turned_on_and_refuses_other_settings(tmp_path):
    """A RunProtocol turns deterministic mode on and, at its close, off again; one that finds it on with the same
    settings uses it and leaves it on. Negative control: other settings (a thread count the bits depend on)
    are refused, naming both, and the mode in force is left as it was."""
    import pytest

    from samestep.determinism import mode
    from samestep.loop.protocol import RunProtocol

    assert not mode.is_enabled()
    own = RunProtocol()
    report = own.enable(threads=1)
    assert mode.is_enabled() and report is mode.active_report()
    guest = RunProtocol()
    assert guest.enable(threads=1) is report
    guest.close()
    assert mode.is_enabled()  # the guest did not turn it on, so it leaves it on
    with pytest.raises(ValueError, match=r"already on in this process with threads=1.*asks for threads=2"):
        RunProtocol().enable(threads=2, who="a loop")
    assert mode.active_report() is report
    own.close()
    assert not mode.is_enabled()
    own.close()  # a second close does nothing


def test_a_run_protocol_holds_the_run_directory_and_closes_the_trace_before_the_receipts(tmp_path):
    """The run directory is held from the RunProtocol's start (a second writer is refused before anything) to its
    close; ``end`` closes the trace, then the receipts; the receipts' last step is in the file after it."""
    import pytest

    from samestep.loop.protocol import RunProtocol
    from samestep.records.lock import hold
    from samestep.records.rundir import RunDirError

    calls: list[str] = []

    class _Closes(_Synced):
        def close(self) -> None:
            self.calls.append(self.name)

    proto = RunProtocol(tmp_path / "run", hold_dir=True)
    with pytest.raises(RunDirError):
        RunProtocol(tmp_path / "run", hold_dir=True)
    proto.adopt(_Closes("trace", calls))
    proto.receipts = _Closes("receipts", calls)
    proto.save(lambda: calls.append("save"))
    proto.close()
    assert calls == ["trace", "receipts", "save", "trace", "receipts"]
    hold(tmp_path / "run").release()  # released at the close


def test_the_protocol_is_driven_from_run_protocol_alone():
    """The reference trainer, samestep.Run and both callbacks reach deterministic mode, the run directory's hold,
    the receipts' lifecycle, the stop signals and the durable order through ``protocol.RunProtocol`` only: none of
    them calls those mechanisms itself. Negative control: a module that turns the mode on itself is caught."""
    import ast
    from pathlib import Path

    import samestep

    owned = {
        "enable",
        "disable",
        "hold",
        "continue_receipts",
        "check_restored",
        "truncate_receipts",
        "save_after_records",
        "make_durable",
        "StopRequest",
        "agreed_stop",
        "trace",
    }
    modules = {"samestep", "mode", "rundir", "receipts", "preempt", "protocol", "start"}

    def calls(source: str) -> set[str]:
        found = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call):
                f = node.func  # a function imported by name, or called on its module; not a RunProtocol's method
                if isinstance(f, ast.Name):
                    found.add(f.id)
                elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules:
                    found.add(f.attr)
        return found & owned

    root = Path(samestep.__file__).parent
    drivers = [
        root / "train" / "loop.py",
        root / "train" / "resume.py",
        root / "loop" / "run.py",
        *(root / "integrations" / f"{name}.py" for name in ("steps", "huggingface", "lightning")),
    ]
    assert {d.name: calls(d.read_text(encoding="utf-8")) for d in drivers} == {d.name: set() for d in drivers}
    assert calls("from samestep import mode\nmode.enable(threads=1)\nproto.enable()\n") == {"enable"}


def _receipts(run_dir, rank: int, steps: range) -> None:
    """A receipts file of ``rank`` holding ``steps`` (their chain is not what is checked here)."""
    import json

    from samestep.records.receipts import RECEIPTS_FORMAT, RECEIPTS_VERSION, receipts_path

    path = receipts_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {"format": RECEIPTS_FORMAT, "version": RECEIPTS_VERSION, "rank": rank, "state_hash": "xxh3-128", "genesis": "g"}
    ]
    rows += [
        {"step": s, "state": "s", "state_of": "rank", "loss_hex": "l", "grad_norm_hex": "n", "prev": "p", "hash": "h"}
        for s in steps
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_resume_refuses_a_ranks_receipts_file_lost_while_another_ranks_holds_the_step(tmp_path):
    """A rank that keeps receipts resuming from step 2 on the layout that wrote the checkpoint, its file gone
    while rank 0's holds step 2: refused, naming the missing file and the one that shows it was kept. Negative
    controls: the same with receipts turned on only after step 2 (rank 0's file starts at step 3), and a resume
    on another layout (the rank keeps receipts only from now on), go on."""
    import pytest

    from samestep.loop.protocol import RunProtocol
    from samestep.records.receipts import ReceiptError

    _receipts(tmp_path / "kept", 0, range(1, 3))
    proto = RunProtocol(tmp_path / "kept")
    with pytest.raises(
        ReceiptError,
        match=r"rank_00001.jsonl: missing, though the run kept receipts at step 2 "
        r"\(rank_00000.jsonl holds that step's\)",
    ):
        proto.check_receipts(1, 2, lambda: {}, same_layout=True)
    proto.check_receipts(1, 2, lambda: {}, same_layout=False)
    _receipts(tmp_path / "later", 0, range(3, 5))
    RunProtocol(tmp_path / "later").check_receipts(1, 2, lambda: {}, same_layout=True)


def test_a_resume_check_is_agreed_by_every_rank_before_any_writes(tmp_path):
    """Under ``agree`` (``any_rank``, a collective), every rank calls it once its checks are done, keeping
    receipts or not, from step 0 too: no rank starts its files while rank 0 may still read them. A rank that
    refuses says so to the others before raising its own error; a rank whose checks passed raises that another
    rank refused, and writes nothing. Negative control: without ``agree`` the same rank goes on."""
    import pytest

    from samestep.loop.protocol import RunProtocol
    from samestep.records.receipts import ReceiptError, RefusedElsewhere

    _receipts(tmp_path / "kept", 0, range(1, 3))
    told: list[bool] = []

    def others_refused(flag: bool) -> bool:
        told.append(flag)
        return True

    def nobody(flag: bool) -> bool:
        told.append(flag)
        return flag

    with pytest.raises(ReceiptError, match=r"rank_00001.jsonl: missing"):
        RunProtocol(tmp_path / "kept").check_receipts(1, 2, lambda: {}, same_layout=True, agree=nobody)
    assert told == [True]
    with pytest.raises(ReceiptError) as own:  # the refusing rank's own error is no echo of another's
        RunProtocol(tmp_path / "kept").check_receipts(1, 2, lambda: {}, same_layout=True, agree=nobody)
    assert not isinstance(own.value, RefusedElsewhere)
    del told[1:]
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(RefusedElsewhere, match=r"another rank refused this resume .*nothing was written"):
        RunProtocol(tmp_path / "kept").check_receipts(2, 2, None, agree=others_refused)
    assert told == [True, False] and sorted(tmp_path.rglob("*")) == before
    RunProtocol(tmp_path / "kept").check_receipts(2, 2, None)  # the control: alone, it goes on
    RunProtocol(tmp_path / "new").check_receipts(3, 0, None, agree=nobody)
    assert told == [True, False, False]


def test_a_receipts_header_that_cannot_be_written_leaves_no_file(tmp_path, monkeypatch):
    """A new receipts file appears whole, with its header, or not at all (another rank may be reading the run's
    files as this one starts): a write that fails leaves no empty file. Negative control: the writer on a
    working disk leaves the header, which ``read_header`` reads."""
    import pytest

    import samestep.records.durable
    from samestep.records.receipt_writer import ReceiptWriter
    from samestep.records.receipts import read_header, receipts_path

    def full(path, data):
        path.write_bytes(data[:0])
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(samestep.records.durable, "write_durable", full)
        with pytest.raises(OSError, match="No space"):
            ReceiptWriter(tmp_path, 1, "g")
    assert list(receipts_path(tmp_path, 1).parent.iterdir()) == []
    ReceiptWriter(tmp_path, 1, "g").close()
    assert read_header(receipts_path(tmp_path, 1))["rank"] == 1

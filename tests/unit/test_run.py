"""samestep.Run: the protocol of a loop of one's own in one object. Its hooks record what the hand-written
protocol records, a stop ends the loop with a checkpoint, a resume continues bit for bit, and a step whose
body raised is neither saved nor called complete."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

import samestep
from samestep.analysis import certify_trace, diff_runs
from samestep.analysis.receipt_check import check_receipts
from samestep.checkpoint import committed_steps
from samestep.records.receipts import ReceiptError, read_receipts, read_run_receipts


def _train(
    run_dir: Path, *, total: int = 4, stop_at: int | None = None, fail_at: int | None = None, lr: float = 0.05, **kw
) -> tuple[torch.Tensor, samestep.Run]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.25), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with samestep.Run(run_dir, model=model, optimizer=opt, scheduler=sched, **kw) as run:
        for step in run.steps(total):
            for mb in (0, 1):
                with run.microbatch(mb):
                    g = samestep.rng.generator(0, step, mb, "data")
                    model(torch.randn(3, 4, generator=g)).square().mean().backward()  # dropout: torch's RNG
            if step == fail_at:
                raise RuntimeError("the loop failed inside the step")
            run.metric("loss", torch.tensor(float(step)))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step == stop_at:
                signal.raise_signal(signal.SIGTERM)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), run


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_a_stopped_and_resumed_run_is_the_run_straight_through(tmp_path):
    """A SIGTERM after step 2 of 4: the step ends, is saved, the loop stops (run.stopped names it); the
    resume continues to the bits of the run straight through (dropout draws torch's RNG, which the
    checkpoint restores), `samestep diff` says identical, and its receipts are the straight run's bytes. Negative
    control: the same resume without
    its RNG state restored (the checkpoint's rank RNG file gone from the comparison: another seed
    before the resume) differs."""
    straight, _ = _train(tmp_path / "straight")
    half, run = _train(tmp_path / "cut", stop_at=2)
    assert run.stopped == "SIGTERM" and [s for s, _ in committed_steps(tmp_path / "cut" / "checkpoints")] == [2, 1]
    assert not (tmp_path / "cut" / "final.json").exists()  # a stopped run is not finished
    resumed, run = _train(tmp_path / "cut")
    assert run.start == 2 and run.stopped is None
    assert torch.equal(_bits(resumed), _bits(straight))
    finals = [json.loads((d / "final.json").read_text()) for d in (tmp_path / "straight", tmp_path / "cut")]
    assert finals[0] == finals[1] and finals[0]["step"] == 4 and finals[0]["state_digest_of"] == "whole"
    same = diff_runs(tmp_path / "straight", tmp_path / "cut")
    assert same["identical"] and same["compared"]["final_state"]
    assert certify_trace(tmp_path / "cut")["complete"]
    receipts = [d / "receipts" / "rank_00000.jsonl" for d in (tmp_path / "straight", tmp_path / "cut")]
    assert receipts[0].read_bytes() == receipts[1].read_bytes() and len(read_receipts(receipts[0])[1]) == 4
    checked = check_receipts(tmp_path / "cut")
    assert checked["ok"] and "final.json's step, loss bits and state against the last receipt" in checked["checked"]
    last = read_receipts(receipts[1])[1][-1]
    assert finals[1]["state_checksum"] == {read_receipts(receipts[1])[0]["state_hash"]: last["state"]}
    edited = {**finals[1], "state_checksum": {k: "0" * len(v) for k, v in finals[1]["state_checksum"].items()}}
    (tmp_path / "straight" / "final.json").write_text(json.dumps(edited))  # control: a final state not the receipt's
    assert not check_receipts(tmp_path / "straight")["ok"]
    (tmp_path / "straight" / "final.json").write_text(json.dumps(finals[0]))
    # negative control: the same stop and resume, but the RNG a resumed run starts from is not the saved one
    _train(tmp_path / "norng", stop_at=2)
    original = samestep.Run.__init__

    def reseed_after_load(self, *a, **kw):
        original(self, *a, **kw)
        torch.manual_seed(123)

    samestep.Run.__init__ = reseed_after_load
    try:
        other, _ = _train(tmp_path / "norng")
    finally:
        samestep.Run.__init__ = original
    assert not torch.equal(_bits(other), _bits(straight))
    assert json.loads((tmp_path / "norng" / "final.json").read_text())["state_digest"] != finals[0]["state_digest"]
    assert not diff_runs(tmp_path / "straight", tmp_path / "norng")["identical"]
    assert (tmp_path / "norng" / "receipts" / "rank_00000.jsonl").read_bytes() != receipts[0].read_bytes()
    # a run's receipts read once, by rank; a file under another rank's name is refused by name
    assert read_run_receipts(tmp_path / "cut") == {0: read_receipts(receipts[1])}
    shutil.copy(receipts[0], tmp_path / "straight" / "receipts" / "rank_00003.jsonl")
    with pytest.raises(ReceiptError, match="rank_00003.jsonl: its header says rank 0"):
        read_run_receipts(tmp_path / "straight")


def test_the_hooks_record_gradients_and_state_at_every_step(tmp_path):
    """The optimizer's hooks record every parameter's gradient before the update and the state after it:
    a run whose update differs (another learning rate, same gradients at step 1) diverges first in the
    parameters after step 1's update, after its 4 gradients and its metric matched."""
    _train(tmp_path / "a", total=2)
    _train(tmp_path / "b", total=2, lr=0.07)
    report = diff_runs(tmp_path / "a", tmp_path / "b")
    first = report["first_difference"]
    assert (first["step"], first["op"], first["scope"]) == (1, "param", "0.weight"), first
    assert report["per_rank"]["0"]["records_compared"] == 5  # the 4 gradients and the metric matched


def test_the_trace_takes_its_state_records_from_the_receipts_pass(tmp_path, monkeypatch):
    """With step tracing on (Run's default) each state tensor is hashed once a step, for the receipt and the
    trace's state records both (one ``checksums.StepChecksums``, which the RunProtocol hands to each): as many
    tensors are hashed as with the trace off, none of the parameters or optimizer state reaches the trace's
    lanes, and the last step's state records are the state checksums of the final parameters and optimizer
    state. Control: a recorder with a pass of its own hashes each of those tensors a second time a step."""
    from samestep.hashing import checksums
    from samestep.loop.protocol import RunProtocol
    from samestep.tracing import read_stream, stream_path, thread_worker

    hashed: list[tuple] = []
    laned: list[int] = []
    real_hash, real_lanes = checksums._xxh3, thread_worker.batch_lanes
    monkeypatch.setattr(checksums, "_xxh3", lambda t, key: hashed.append(key) or real_hash(t, key))
    monkeypatch.setattr(
        thread_worker,
        "batch_lanes",
        lambda packs, tensors: laned.extend(t.data_ptr() for t in tensors) or real_lanes(packs, tensors),
    )

    def counted(name: str, **kw) -> tuple[int, set[int], samestep.Run]:
        hashed.clear()
        laned.clear()
        _, run = _train(tmp_path / name, total=3, **kw)
        return len(hashed), set(laned), run

    alone, _, _ = counted("untraced", level="off")
    traced, laned_at, run = counted("traced")
    state = [p for p in run.model.parameters()] + [
        v for s in run.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    assert traced == alone >= 3 * len(state)
    assert not laned_at & {t.data_ptr() for t in state} and laned_at  # the gradients and the metric went there
    rows = [
        r
        for r in read_stream(stream_path(tmp_path / "traced", 0)).table.to_pylist()
        if r["step"] == 3 and (r["op"] == "param" or r["op"].startswith("optim."))
    ]
    assert len(rows) == len(state) == 16
    assert sorted(r["outputs"] for r in rows) == sorted(bytes.fromhex(s) for s in checksums.Checksums().of(state))
    # control: the recorder's own pass, as a loop that shares none would have
    trace = RunProtocol.trace

    def apart(self, *args, **kw):
        recorder = trace(self, *args, **kw)
        recorder.checksums = checksums.StepChecksums()
        return recorder

    monkeypatch.setattr(RunProtocol, "trace", apart)
    twice, _, _ = counted("apart")
    assert twice == alone + 3 * len(state)


def test_a_receipt_is_of_the_buffers_at_its_steps_end_whatever_the_next_forward_does(tmp_path, monkeypatch):
    """A BatchNorm's running statistics change in place at every forward in training mode, and the receipt
    thread reads the state while the next step's forward runs (between checkpoints, whose save waits for
    it): the receipt takes copies of the model's buffers at the step's end (``receipt_state.buffers_now``). With
    the receipt thread held back until that forward has run, the receipts are those of an unhurried run and
    ``receipts verify`` finds the newest checkpoint its receipt. Control: the live buffers in the tree (no
    copies) give steps 1 and 2 other receipts, of statistics a later forward made (a resume from either would
    be refused)."""
    import threading

    from samestep.records import receipt_state, receipt_writer

    forwards, seen, held = [0], threading.Condition(), [0]

    def counted(*_) -> None:
        with seen:
            forwards[0] += 1
            seen.notify_all()

    def run(name: str) -> list[str]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
        model.register_forward_hook(counted)
        forwards[0] = 0
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with samestep.Run(tmp_path / name, model=model, optimizer=opt, level="off", checkpoint_every=3) as r:
            for step in r.steps(3):
                with r.microbatch(0):
                    model(torch.randn(6, 4, generator=samestep.rng.generator(0, step, 0, "data"))).sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return [x["state"] for x in read_receipts(tmp_path / name / "receipts" / "rank_00000.jsonl")[1]]

    unhurried = run("unhurried")
    checksum = receipt_writer.state_checksum

    def held_back(tree, *args, **kwargs):  # until the next step's forward ran (the last step has none)
        held[0] += 1
        with seen:
            seen.wait_for(lambda: forwards[0] > tree["step"] or tree["step"] == 3, timeout=60)
        return checksum(tree, *args, **kwargs)

    monkeypatch.setattr(receipt_writer, "state_checksum", held_back)
    assert run("held") == unhurried and check_receipts(tmp_path / "held")["ok"]
    assert held[0] >= 3  # the receipt thread was held back (the patch is where the thread checksums)
    monkeypatch.setattr(receipt_state, "buffers_now", lambda buffers: {})  # control: the live buffers
    live = run("live")
    assert live[0] != unhurried[0] and live[1] != unhurried[1] and live[2] == unhurried[2]


def test_a_step_that_raised_is_not_saved_nor_complete(tmp_path):
    """The body of step 3 raises: steps 1-2 are saved, step 3 is not, the run directory's lock is free and
    deterministic mode is off again; certify names step 3. Negative control: a whole run is complete."""
    with pytest.raises(RuntimeError, match="inside the step"):
        _train(tmp_path / "failed", fail_at=3)
    assert [s for s, _ in committed_steps(tmp_path / "failed" / "checkpoints")] == [2, 1]
    assert not samestep.is_enabled()
    cert = certify_trace(tmp_path / "failed")
    assert not cert["complete"] and any("step 3" in p for p in cert["problems"]), cert
    _train(tmp_path / "whole", total=2)
    assert certify_trace(tmp_path / "whole")["complete"]


def test_resume_choices_are_checked(tmp_path):
    """resume=False refuses a run directory that holds checkpoints, resume=True one that holds none, and
    nothing is written by a refused run."""
    _train(tmp_path / "run", total=1)
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(ValueError, match="already holds checkpoints"):
        _train(tmp_path / "run", total=2, resume=False)
    with pytest.raises(ValueError, match="holds no checkpoint"):
        _train(tmp_path / "new", total=1, resume=True)
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before
    assert not (tmp_path / "new").exists() and not samestep.is_enabled()


def _two_rank_worker(rank: int, init: str, run_dir: str, out: str, signal_at: int | None) -> None:
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with samestep.Run(run_dir, model=model, optimizer=opt) as run:
        for step in run.steps(4):
            model(torch.full((2, 4), float(step))).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == signal_at and rank == 1:
                signal.raise_signal(signal.SIGTERM)  # this rank only
    Path(out, f"rank{rank}.json").write_text(json.dumps({"stopped": run.stopped, "start": run.start}))


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Two processes; SIGTERM reaches rank 1 alone during step 2. Both stop after step 2 (rank 0 names
    another rank's signal, which it never received: without agreeing, it would have gone on into step
    3's checkpoint barrier alone), the checkpoint of step 2 is committed by both, and both resume from it."""
    import json

    from tests.support import spawn

    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    spawn(_two_rank_worker, (str(tmp_path / "init1"), str(run), str(out), 2), 2)
    first = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert first == [{"stopped": "a signal to another rank", "start": 0}, {"stopped": "SIGTERM", "start": 0}]
    assert [s for s, _ in committed_steps(run / "checkpoints")][0] == 2
    spawn(_two_rank_worker, (str(tmp_path / "init2"), str(run), str(out), None), 2)
    again = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert again == [{"stopped": None, "start": 2}] * 2
    assert [s for s, _ in committed_steps(run / "checkpoints")][0] == 4


def _parts_worker(rank: int, init: str, run_dir: str, out: str, split: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    torch.manual_seed(0)
    # split: each rank holds another part of a model, as a pipeline stage of one's own placing does
    model = torch.nn.Linear(4, 1 + rank) if split else torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with samestep.Run(run_dir, model=model, optimizer=opt) as run:
            for _ in run.steps(1):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        Path(out, f"rank{rank}.txt").write_text("ran")
    except ValueError as e:
        Path(out, f"rank{rank}.txt").write_text(str(e))


@pytest.mark.slow
def test_ranks_holding_other_parts_of_a_model_are_refused_on_every_rank(tmp_path):
    """Rank 0 saves the whole state of a model no DTensor splits: ranks whose models differ (a loop's own
    pipeline stages) are refused on every rank alike, before a checkpoint, naming the ranks and the fix.
    Control: the same model on both ranks runs."""
    from tests.support import spawn

    for split, name in ((True, "split"), (False, "same")):
        (tmp_path / name).mkdir()
        spawn(
            _parts_worker,
            (str(tmp_path / f"init_{name}"), str(tmp_path / f"run_{name}"), str(tmp_path / name), split),
            2,
        )
    said = [(tmp_path / "split" / f"rank{r}.txt").read_text() for r in range(2)]
    assert said[0] == said[1] and said[0].startswith("samestep.Run: rank(s) 1 hold another model than rank 0"), said
    assert not committed_steps(tmp_path / "run_split" / "checkpoints")
    assert [(tmp_path / "same" / f"rank{r}.txt").read_text() for r in range(2)] == ["ran", "ran"]


def _declared_loop(
    run_dir: Path, total: int = 4, width: int = 16, weight_decay: float = 0.01, config: dict | None = None
) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=weight_decay)
    with samestep.Run(run_dir, model=model, optimizer=opt, config=config or {"seed": 0}, checkpoint_every=2) as run:
        for step in run.steps(total):
            g = samestep.rng.generator((config or {"seed": 0})["seed"], step, 0, "data")
            model(torch.randn(3, 4, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize(
    "change,named",
    [
        ({"config": {"seed": 1}}, "config.seed: 0 -> 1"),
        ({"width": 8}, "model:"),
        ({"weight_decay": 0.1}, "optimizer.groups.0.weight_decay: 0.01 -> 0.1"),
    ],
)
def test_a_run_continued_under_other_settings_is_refused(tmp_path, change, named):
    """samestep.Run(resume="auto") on a directory started under other settings (another seed passed as config,
    another model shape, another optimizer hyperparameter) is refused in one line naming the field, before
    anything is restored or written. Control: continued as it started, the run ends on the bits of the run
    straight through."""
    straight = _declared_loop(tmp_path / "straight", total=6)
    run = tmp_path / "run"
    _declared_loop(run, total=6)
    shutil.rmtree(run / "checkpoints" / "step_000006")  # as if killed after step 4's checkpoint
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".samestep.lock"}
    with pytest.raises(ValueError, match=re.escape(named)):
        _declared_loop(run, total=6, **change)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".samestep.lock"} == before
    assert torch.equal(_bits(_declared_loop(run, total=6)), _bits(straight))


def test_another_step_count_is_refused(tmp_path):
    """The step count given to run.steps() is part of what a run holds fixed: continued with another, refused."""
    _declared_loop(tmp_path / "run", total=4)
    with pytest.raises(ValueError, match=r"steps: 4 -> 6"):
        _declared_loop(tmp_path / "run", total=6)


def test_determinism_off_for_the_other_half_of_an_a_b(tmp_path):
    """Run(deterministic=False) leaves PyTorch's defaults and records deterministic mode as off in run.json;
    by default Run turns it on (the control). A loop that turns it off by hand is warned at its own line."""
    import json
    import warnings

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {}
    for name, det in (("off", False), ("on", True)):
        with samestep.Run(tmp_path / name, model=model, optimizer=opt, deterministic=det) as run:
            for step in run.steps(1):
                seen[name] = torch.are_deterministic_algorithms_enabled()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    assert seen == {"off": False, "on": True}
    assert json.loads((tmp_path / "off" / "run.json").read_text())["determinism"] is None
    assert json.loads((tmp_path / "on" / "run.json").read_text())["determinism"] is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with samestep.Run(tmp_path / "drift", model=model, optimizer=opt) as run:
            torch.use_deterministic_algorithms(False)
            for step in run.steps(1):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    drift = [w for w in caught if "no longer holds" in str(w.message)]
    assert drift and drift[0].filename == __file__


def test_verify_refuses_a_loop_that_recorded_no_program_and_receipts_verify_checks_its_checkpoint(tmp_path, capsys):
    """`samestep verify` cannot replay a loop of one's own whose run.json records no program to run again (one
    that traced itself with samestep.trace): exit 2, one line saying so, not a false "not the run's" (a Run's
    program replayed: tests/integration/test_replay_own_loop.py). `samestep receipts verify` checks the run's
    newest checkpoint against its receipt (its parts rebuilt from the checkpoint's files); with a weight of it
    changed and resealed, it names the checkpoint (the control)."""
    from samestep.cli import main
    from samestep.records.rundir import read_run, write_run

    _train(tmp_path / "run", total=4)
    doc = read_run(tmp_path / "run")
    assert doc["programs"][0]["run_dir"] == str((tmp_path / "run").resolve())  # outside the working directory
    del doc["programs"]
    write_run(tmp_path / "run", doc)
    assert main(["verify", str(tmp_path / "run")]) == 2
    assert "records no program to run again" in capsys.readouterr().err
    assert main(["receipts", "verify", str(tmp_path / "run")]) == 0
    assert "checkpoint step_000004 against its step's receipt" in capsys.readouterr().out
    step_dir = tmp_path / "run" / "checkpoints" / "step_000004"
    from tests.forgery import flip_a_weight, reseal

    reseal(step_dir, "model.safetensors", flip_a_weight((step_dir / "model.safetensors").read_bytes()))
    assert main(["receipts", "verify", str(tmp_path / "run")]) == 1
    assert "step_000004: its state checksum" in capsys.readouterr().out


def _loader_run(run_dir: Path, generator: bool, stop_at: int | None = None) -> torch.Tensor:
    """A loop whose data comes from torchdata's StatefulDataLoader (shuffled) as samestep.Run's data cursor,
    its model drawing dropout from torch's global RNG; SIGTERM after ``stop_at``."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = [torch.randn(4, generator=torch.Generator().manual_seed(i)) for i in range(32)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = StatefulDataLoader(
        data, batch_size=4, shuffle=True, **({"generator": torch.Generator().manual_seed(5)} if generator else {})
    )
    batches = None
    with samestep.Run(run_dir, model=model, optimizer=opt, data_cursor=loader, level="off") as run:
        for step in run.steps(12):
            x = next(batches, None) if batches is not None else None
            if x is None:  # a new epoch, or the resumed one (a resume at an epoch's end finds it ended)
                batches = iter(loader)
                x = next(batches, None)
            if x is None:
                batches = iter(loader)
                x = next(batches)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == stop_at:
                signal.raise_signal(signal.SIGTERM)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_dataloader_cursor_that_draws_the_global_rng_is_refused_before_step_1(tmp_path, monkeypatch):
    """A shuffled StatefulDataLoader without a generator as the data cursor: refused before anything is written,
    naming generator=. With one (its state in each checkpoint), runs stopped mid-epoch (step 5) and at an epoch's
    end (step 8) and resumed are the run straight through bit for bit, the next epoch's order included. Negative
    controls: the resumed epoch's iterator made after the generators are restored (it draws from them) differs;
    with the refusal taken away, the same resume without a generator differs (its new iterator draws
    the global RNG where the straight run drew nothing)."""
    import samestep.loop.run as run_module

    with pytest.raises(
        ValueError,
        match=r"data_cursor=StatefulDataLoader\(...\)\): it draws from torch's global "
        r"RNG .* generator=torch.Generator\(\).manual_seed\(SEED\)",
    ):
        _loader_run(tmp_path / "refused", generator=False)
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())
    straight = _loader_run(tmp_path / "straight", generator=True)
    for stop in (5, 8):
        _loader_run(tmp_path / f"cut{stop}", generator=True, stop_at=stop)
        assert torch.equal(_bits(_loader_run(tmp_path / f"cut{stop}", generator=True)), _bits(straight)), stop
    monkeypatch.setattr(run_module, "resume_epoch", lambda loader, generators: None)
    _loader_run(tmp_path / "unprimed", generator=True, stop_at=5)
    assert not torch.equal(_bits(_loader_run(tmp_path / "unprimed", generator=True)), _bits(straight))
    monkeypatch.setattr(run_module, "loader_generators", lambda cursor: None)
    unkeyed = _loader_run(tmp_path / "unkeyed", generator=False)
    _loader_run(tmp_path / "unkeyed_cut", generator=False, stop_at=5)
    assert not torch.equal(_bits(_loader_run(tmp_path / "unkeyed_cut", generator=False)), _bits(unkeyed))


def test_an_optimizer_of_other_tensors_than_the_models_parameters_is_refused_by_name(tmp_path):
    """An optimizer built before the model's parameters were replaced (as fully_shard and parallelize_module
    replace them), or holding a tensor kept outside the model, is refused at Run's start naming the cause and
    the fix, before anything is written (it would train nothing, or lose that tensor at a resume). Control: the
    optimizer built after the replacement starts."""
    model = torch.nn.Linear(4, 2)
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    model.weight = torch.nn.Parameter(model.weight.detach().clone())  # what sharding does to each parameter
    with pytest.raises(
        ValueError,
        match=r"the optimizer updates 1 tensor\(s\) that are not the model's parameters "
        r"\(the first of shape \[2, 4\]\): it was built before fully_shard",
    ):
        samestep.Run(tmp_path / "early", model=model, optimizer=early)
    outside = torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.ones(3))], lr=0.1)
    with pytest.raises(ValueError, match="holds a tensor kept outside the model"):
        samestep.Run(tmp_path / "outside", model=model, optimizer=outside)
    assert not (tmp_path / "early").exists() and not (tmp_path / "outside").exists()
    with samestep.Run(
        tmp_path / "late", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), level="off"
    ) as run:
        assert run.start == 0


def test_a_loop_left_with_break_says_what_was_not_saved(tmp_path, capsys):
    """nanoGPT's `if iter_num > max_iters: break` inside `for step in run.steps(5)` at step 3 (checkpoints every
    2 steps): the program goes on (no error of its own), but stderr says the loop left step 3 of 5 unsaved, no
    final.json, and that a resume goes on from step 2's checkpoint. Control: the loop run to its end says
    nothing of it and writes final.json."""

    def loop(run_dir: Path, leave_at: int | None) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with samestep.Run(run_dir, model=model, optimizer=opt, checkpoint_every=2, level="off") as run:
            for step in run.steps(5):
                if step == leave_at:
                    break
                model(torch.ones(3, 4)).sum().backward()
                opt.step()
                opt.zero_grad()

    loop(tmp_path / "left", 3)
    said = capsys.readouterr().err
    assert "samestep.Run: the loop left step 3 of 5 before that step ended" in said, said
    assert "the newest checkpoint is of step 2, which a resume goes on from" in said
    assert not (tmp_path / "left" / "final.json").exists()
    loop(tmp_path / "whole", None)
    assert "the loop left" not in capsys.readouterr().err and (tmp_path / "whole" / "final.json").exists()


def test_at_op_level_a_step_that_names_no_microbatch_is_microbatch_0(tmp_path):
    """A loop that never calls run.microbatch() (the README's quick start), traced at op level: its forward and
    backward are recorded as microbatch 0's ops, the same records (identity and digests) the loop wrapped in
    run.microbatch(0) writes (but for the batch's draw before it, and the profiler mark optimizer.step() enters
    before its hooks run), and the update stays outside (its step-level records at microbatch -1). Negative
    control: the loop's own ops are what is recorded (a bigger batch in step 2 changes their digests)."""
    from samestep.tracing import read_stream, stream_path

    def loop(run_dir: Path, named: bool, rows: int = 16) -> list[dict]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with samestep.Run(run_dir, model=model, optimizer=opt, level="op", trace_steps="2") as run:
            for step in run.steps(2):
                x = torch.randn(rows, 8, generator=samestep.rng.generator(0, step, 0, "data"))
                with run.microbatch(0) if named else contextlib.nullcontext():
                    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
                    loss.backward()
                opt.step()
                opt.zero_grad()
        return read_stream(stream_path(run_dir, 0)).table.to_pylist()

    def ops(rows: list[dict]) -> list[tuple]:
        return [
            (r["microbatch"], r["phase"], r["scope"], r["op"], r["occurrence"], r["outputs"])
            for r in rows
            if r["microbatch"] == 0 and r["op"] != "aten.randn.generator" and not r["op"].startswith("profiler.")
        ]

    implicit, named = loop(tmp_path / "implicit", False), loop(tmp_path / "named", True)
    assert len(ops(implicit)) > 20 and ops(implicit) == ops(named)
    assert {r["phase"] for r in implicit if r["microbatch"] == 0} == {"forward", "backward"}
    assert all(r["microbatch"] == -1 for r in implicit if r["phase"] == "step")
    assert ops(loop(tmp_path / "other", False, rows=17)) != ops(implicit)

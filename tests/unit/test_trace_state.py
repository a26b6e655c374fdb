"""The step level's records: gradients (copied, or digested where they lie and checked unchanged), and the state
after each update (parameters, optimizer state, buffers) as it was then."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from samestep.digests import digest
from samestep.hashing.checksums import Checksums
from samestep.tracing import Recorder, read_stream, stream_path
from samestep.tracing.stream import END
from tests.support import traced_step
from tests.support.traces import Tiny, without_ends

module_level = importlib.import_module("samestep.tracing.module_level")
step_level = importlib.import_module("samestep.tracing.step_level")


def test_gradients_in_one_buffer_digest_like_separate_ones(tmp_path):
    """Gradients that are pieces of one buffer (one staged copy, split by the worker) get the digests
    of the same gradients as separate tensors."""
    torch.manual_seed(0)
    model = Tiny()
    grads = [torch.randn(p.shape) for p in model.parameters()]
    flat = torch.cat([torch.randn(3)] + [g.reshape(-1) for g in grads])  # a gap before the first piece
    tables = []
    for layout in ("separate", "one buffer", "changed"):
        offset = 3
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone() if layout == "separate" else flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
        if layout == "changed":
            flat[-1] += 1.0  # negative control: the last gradient's last element
        rec = Recorder(tmp_path / layout, level="step")
        with rec.step(1):
            rec.grads(model.named_parameters())
            flat.zero_()  # the buffer changes after grads(): the staged copy does not
        rec.close()
        tables.append(without_ends(read_stream(stream_path(tmp_path / layout, 0)).table))
        flat = torch.cat([torch.randn(3)] + [g.reshape(-1) for g in grads])
    assert tables[0].num_rows == len(grads) and tables[0].equals(tables[1])
    assert tables[2].column("outputs").to_pylist()[:-1] == tables[0].column("outputs").to_pylist()[:-1]
    assert tables[2].column("outputs").to_pylist()[-1] != tables[0].column("outputs").to_pylist()[-1]


@pytest.mark.parametrize("worker", [pytest.param("process", marks=pytest.mark.slow), "thread"])
def test_gradients_digested_where_they_lie_match_copies_and_a_later_change_is_refused(tmp_path, worker):
    """grads(copy="checked") digests the gradients themselves, in one buffer or separate: the same stream
    as copies. A gradient changed in place after it was recorded (a clip after grads()) stops the run
    naming the record (the buffer's first piece, or the tensor) and the fix, and nothing of it is written."""
    torch.manual_seed(0)
    model = Tiny()
    grads = [torch.randn(p.shape) for p in model.parameters()]

    def give(layout: str) -> None:
        flat, offset = torch.cat([torch.randn(3)] + [g.reshape(-1) for g in grads]), 3
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone() if layout == "separate" else flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()

    tables = {}
    for layout in ("separate", "one buffer"):
        for copy in (True, "checked"):
            give(layout)
            rec = Recorder(tmp_path / f"{layout}-{copy}", level="step", worker=worker)
            with rec.step(1):
                rec.grads(model.named_parameters(), copy=copy)
            rec.close()
            tables[layout, copy] = without_ends(read_stream(stream_path(tmp_path / f"{layout}-{copy}", 0)).table)
    assert tables["separate", True].num_rows == len(grads)
    assert all(t.equals(tables["separate", True]) for t in tables.values())
    for layout, named in (("separate", "inner.0.bias"), ("one buffer", "inner.0.weight")):
        give(layout)
        rec = Recorder(tmp_path / f"{layout}-changed", level="step", worker=worker)
        with rec.step(1):
            rec.grads(model.named_parameters(), copy="checked")
        model.inner[0].bias.grad.mul_(2.0)
        with pytest.raises(
            RuntimeError,
            match=rf"scope='{named}' op='grad' occurrence=0 was changed in place.*"
            r"gradients are final.*copy=True",
        ):
            rec.close()
        assert read_stream(stream_path(tmp_path / f"{layout}-changed", 0)).table.num_rows == 0
    rec = Recorder(tmp_path / "bad", level="step", worker=worker)
    with pytest.raises(ValueError, match=r"grads\(copy=False\): use True"):
        rec.grads(model.named_parameters(), copy=False)
    rec.close()


def test_a_closed_recorder_records_nothing_and_its_ddp_hook_only_reduces(tmp_path):
    """After close() nothing is recorded: a DDP hook of the recorder's (whose model may run on after the
    traced steps) calls the reduction alone, without touching the bucket."""
    rec = Recorder(tmp_path, level="step", worker="thread")
    hook = rec.ddp_comm_hook(inner=lambda state, bucket: ("reduced", bucket))
    with rec.step(1):
        with pytest.raises(AttributeError):  # open and on a traced step: it copies the bucket first
            hook(None, None)
    rec.close()
    assert not rec.active and hook(None, None) == ("reduced", None)
    rec.record("loss", [torch.ones(())])
    rec.flush()
    ops = read_stream(stream_path(tmp_path, 0)).table.column("op").to_pylist()
    assert ops == [END]  # step 1 closed (it recorded nothing else), and nothing after close()


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_step_level_records_buffers_as_they_were_after_the_update(tmp_path, worker):
    """Persistent buffers (BatchNorm's running statistics) are model state that can diverge too: recorded
    at step level after the update, as copies, since the next forward changes them in place while the
    digests are still being computed. A non-persistent buffer (not in state_dict) is not state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model[0].register_buffer("constant", torch.ones(2), persistent=False)  # not state: not recorded
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(tmp_path, level="step", worker=worker)
    after: dict[tuple[int, str], torch.Tensor] = {}
    for step in (1, 2, 3):
        traced_step(rec, model, opt, step, [(0, torch.randn(8, 4))], lambda x: model(x).square().mean())
        after.update({(step, name): b.clone() for name, b in model.named_buffers() if name != "0.constant"})
    rec.close()
    rows = [r for r in read_stream(stream_path(tmp_path, 0)).table.to_pylist() if r["op"] == "buffer"]
    assert [(r["step"], r["scope"]) for r in rows] == list(after)
    assert [r["outputs"] for r in rows] == [bytes.fromhex(digest(b)) for b in after.values()]
    assert len({r["outputs"] for r in rows if r["scope"] == "1.running_mean"}) == 3  # it changed every step


def _state_through_changes(run: Path, worker: str) -> tuple[list[tuple], list[tuple], int]:
    """Seven traced steps of a small AdamW loop, changing between steps what ``state()`` records without
    changing a byte of it: a parameter turned into a transposed view of its own storage (same address,
    other strides), another reshaped in place of its storage (same address, other shape), a new optimizer,
    a new optimizer-state key. Returns the state records, what they must be (each tensor's state checksum
    when recorded: ``xxh3-128`` in host memory, docs/formats.md) and how many times ``state()`` made a new
    plan."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    rec = Recorder(run, level="step", worker=worker)
    made = [0]
    plan_state = rec._steps.plan_state

    def counted(*args):
        made[0] += 1
        return plan_state(*args)

    rec._steps.plan_state = counted
    truth = []
    for step in range(1, 8):
        with rec.step(step):
            hidden = model.inner(torch.ones(2, 4))
            # from step 4 on, head.weight (reshaped) gets no gradient: AdamW leaves it, state() still records it
            out = model.head(hidden) if step < 4 else hidden @ torch.ones(4, 1) + model.head.bias
            out.square().sum().backward()
            rec.grads(model.named_parameters())  # the last step's live tensors are digested: they may change
            if step == 3:
                w = model.inner[0].weight
                w.data = w.data.t()  # the same bytes read in another order
            if step == 4:
                model.head.weight.data = model.head.weight.data.view(4, 1)  # (1, 4) -> (4, 1): the same bytes
            if step == 5:
                opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            if step == 6:
                opt.state[model.head.bias]["extra"] = torch.full((3,), float(step))
            opt.step()
            opt.zero_grad()
            rec.state(model, opt)
        names = {id(p): name for name, p in model.named_parameters()}
        truth += [(step, name, "param", Checksums().of([p])[0]) for name, p in model.named_parameters()]
        truth += [
            (step, names[id(p)], f"optim.{k}", Checksums().of([st[k]])[0])
            for p, st in opt.state.items()
            for k in sorted(st)
        ]
    rec.close()
    rows = [r for r in read_stream(stream_path(run, 0)).table.to_pylist() if r["op"] not in ("grad", END)]
    return [(r["step"], r["scope"], r["op"], r["outputs"].hex()) for r in rows], truth, made[0]


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_state_records_follow_parameters_and_optimizer_state_that_change_between_steps(tmp_path, worker, monkeypatch):
    """``state()`` keeps what it records from step to step (a plan: see step_level.StatePlan) and makes a new
    one when the tensors are other objects, lie otherwise at the same address, or have other keys: each
    record is the state checksum of the tensor as it was then. Negative control, where the child reads by the
    plan's descriptions (the process worker): a plan kept through those changes (until the number of tensors
    changes) records stale headers (head.weight's old shape at step 4) and stale layouts (inner.0.weight read
    untransposed at steps 3 and 4); the same comparison catches exactly those. The thread worker's checksums
    read each tensor's dtype, shape and bytes where it lies, so such a plan changes none of its records."""
    rows, truth, made = _state_through_changes(tmp_path / "a", worker)
    assert rows == truth
    assert made == 5  # steps 1, 3, 4, 5 and 6; steps 2 and 7 used the plan of the step before
    monkeypatch.setattr(step_level.StatePlan, "matches", lambda self, names, objs, *rest: len(objs) == len(self.refs))
    monkeypatch.setattr(step_level, "layout", lambda tensors: ())
    rows, truth, made = _state_through_changes(tmp_path / "b", worker)
    assert made == 3  # steps 1, 5 and 6: other numbers of tensors (head.weight has no state in the new optimizer)
    assert len(rows) == len(truth)
    wrong = [row[:3] for row, expected in zip(rows, truth) if row != expected]
    stale = [(3, "inner.0.weight", "param"), (4, "inner.0.weight", "param"), (4, "head.weight", "param")]
    assert wrong == (stale if worker == "process" else [])


def test_step_records_made_twice_in_a_step_count_their_occurrences(tmp_path):
    """A step record whose op and scope were already recorded in the step gets the next occurrence,
    whether the earlier one came from state() (made in bulk) or from record() (one at a time); a list of
    named parameters kept by the caller gives the records that state() finds itself."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).backward()
    opt.step()
    first = next(model.parameters())
    rec = Recorder(tmp_path, level="step")
    with rec.step(1):
        rec.record("param", [first], scope="inner.0.weight")  # one at a time, then in bulk
        rec.state(model, opt)
        rec.state(model, opt, named_params=list(model.named_parameters()))
        rec.record("param", [first], scope="inner.0.weight")
    rec.close()
    rows = without_ends(read_stream(stream_path(tmp_path, 0)).table).to_pylist()
    n = len(rows) // 2 - 1  # the records of one state() call
    assert n == 4 * 4  # 4 parameters, each with its optimizer state: step, exp_avg, exp_avg_sq
    keys = [(r["scope"], r["op"], r["occurrence"]) for r in rows]
    assert len(set(keys)) == len(keys)  # no identity twice (it fails if the bulk path ignores earlier counts)
    assert keys[0] == ("inner.0.weight", "param", 0) and keys[-1] == ("inner.0.weight", "param", 3)
    once, twice = rows[1 : 1 + n], rows[1 + n : 1 + 2 * n]
    assert [r["occurrence"] for r in once] == [1] + [0] * (n - 1)
    assert [r["occurrence"] for r in twice] == [2] + [1] * (n - 1)
    assert [(r["scope"], r["op"], r["outputs"]) for r in once] == [(r["scope"], r["op"], r["outputs"]) for r in twice]

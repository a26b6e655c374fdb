"""The recorder, the stream format, and diff/certify on hand-built traces."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

import samestep
from samestep.analysis import DiffError, certify_trace, diff_runs
from samestep.digests import digest
from samestep.hashing.checksums import Checksums
from samestep.tracing import Perturb, Recorder, format_selection, parse_selection, read_stream, stream_path
from samestep.tracing.stream import END, FORMAT, SCHEMA, VERSION, StreamWriter
from tests.support import traced_step

staging_module = importlib.import_module("samestep.tracing.staging")
module_level = importlib.import_module("samestep.tracing.module_level")
step_level = importlib.import_module("samestep.tracing.step_level")
hooks_module = importlib.import_module("samestep.tracing.hooks")


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x)).sum()


def _without_ends(table: pa.Table) -> pa.Table:
    """A stream's records less the step.end records that close its steps."""
    return table.filter(pc.not_equal(table.column("op"), END))


def _record(run: Path, level: str, scale: float = 1.0, copy: bool = False, steps: set[int] | None = None) -> Recorder:
    torch.manual_seed(0)
    model = Tiny()
    rec = Recorder(run, level=level, copy=copy, steps=steps)
    rec.attach(model)
    for step in (1, 2):
        with rec.step(step):
            for mb in (0, 1):
                with rec.microbatch(mb):
                    (model(torch.ones(2, 4) * scale * (mb + 1)) * 1.0).backward()
            rec.grads(model.named_parameters())
            rec.metric("loss", 1.5)
    rec.close()
    return rec


def test_parse_selection():
    """'all' selects everything; ranges and lists expand; junk is refused with the field name; format_selection
    writes a set back as ranges."""
    assert parse_selection("all", "x") is None and parse_selection("", "x") is None
    assert parse_selection("1-3,7", "x") == {1, 2, 3, 7}
    assert format_selection({7, 1, 3, 2}) == "1-3,7" and format_selection([4]) == "4" and format_selection([]) == ""
    assert parse_selection(format_selection({0, 2, 3, 4, 9, 10}), "x") == {0, 2, 3, 4, 9, 10}
    with pytest.raises(ValueError, match="trace.steps='a-b'"):
        parse_selection("a-b", "trace.steps")


def test_op_level_stream_has_scoped_unique_records(tmp_path):
    """Op records carry module scope in forward and backward; record identities are unique."""
    _record(tmp_path, "op")
    s = read_stream(stream_path(tmp_path, 0))
    assert s.torn is None and s.meta["level"] == "op"
    rows = s.table.to_pylist()
    keys = [(r["step"], r["microbatch"], r["phase"], r["scope"], r["op"], r["occurrence"]) for r in rows]
    assert len(keys) == len(set(keys))
    assert [r["seq"] for r in rows] == list(range(len(rows)))
    fwd = {(r["scope"], r["op"]) for r in rows if r["phase"] == "forward"}
    bwd = {(r["scope"], r["op"]) for r in rows if r["phase"] == "backward"}
    assert ("inner.0", "aten.addmm.default") in fwd and ("inner.1", "aten.tanh.default") in fwd
    assert ("inner.1", "aten.tanh_backward.default") in bwd and ("head", "grad_output") in bwd
    assert {r["op"] for r in rows if r["phase"] == "step"} == {"grad", "loss", "step.end"}


def test_in_place_ops_record_the_bytes_they_wrote(tmp_path):
    """Inside a dispatch mode an in-place op's version counter is bumped only after the mode returns (and
    C++ code, like DDP's reducer, may not bump it at all): its output is still digested after it ran, not
    taken for its input; a destination that is only written (copy_, out=) is no input (UNINIT); a later
    read sees the new bytes; and a ULP planted in an in-place op is found there, as the origin."""

    def run(path: Path, perturb: Perturb | None = None) -> list[dict]:
        rec = Recorder(path, level="op", perturb=perturb)
        with rec.step(1), rec.microbatch(0):
            x = torch.zeros(4)
            x.add_(1.5)
            y = torch.full((4,), 7.0)
            y.copy_(x * 3)
            torch.mul(y, 2, out=x)
            (x + 0).sum()
        rec.close()
        return read_stream(stream_path(path, 0)).table.to_pylist()

    def dig(t: torch.Tensor) -> bytes:
        return bytes.fromhex(digest(t))

    rows = {r["op"]: r for r in run(tmp_path / "a")}
    halves = lambda b: [b[i : i + 16] for i in range(0, len(b), 16)]  # noqa: E731
    assert halves(rows["aten.add_.Tensor"]["inputs"]) == [dig(torch.zeros(4))]
    assert rows["aten.add_.Tensor"]["outputs"] == dig(torch.full((4,), 1.5))
    assert halves(rows["aten.copy_.default"]["inputs"]) == [bytes(16), dig(torch.full((4,), 4.5))]
    assert rows["aten.copy_.default"]["outputs"] == dig(torch.full((4,), 4.5))
    assert halves(rows["aten.mul.out"]["inputs"]) == [dig(torch.full((4,), 4.5)), bytes(16)]
    assert rows["aten.mul.out"]["outputs"] == dig(torch.full((4,), 9.0))
    assert halves(rows["aten.add.Tensor"]["inputs"]) == [dig(torch.full((4,), 9.0))]
    run(tmp_path / "b", Perturb(rank=0, step=1, microbatch=0, phase="forward", scope="", op="aten.add_.Tensor"))
    origin = diff_runs(_described(tmp_path / "a"), _described(tmp_path / "b"))["origin"]
    assert (origin["op"], origin["inputs_matched"]) == ("aten.add_.Tensor", True)


@pytest.mark.parametrize("level", ["module", "op"])
def test_inference_mode_inside_a_traced_microbatch_records_what_no_grad_does(tmp_path, level):
    """Inference tensors have no version counter (reading it raises): they are copied, not cached or
    checked, and the module outputs and the in-place op's output are the ones the same work under no_grad
    gives, byte for byte (at op level the ops differ: inference mode does not decompose linear)."""
    tables = {}
    for ctx in (torch.inference_mode, torch.no_grad):
        torch.manual_seed(0)
        model = Tiny()
        rec = Recorder(tmp_path / ctx.__name__, level=level)
        rec.attach(model)
        with rec.step(1), rec.microbatch(0):
            with ctx():
                z = model.inner(torch.ones(2, 4)) * 2
                z.add_(1)  # in place, on a tensor no module returned
                model.head(z)
        rec.close()
        rows = read_stream(stream_path(tmp_path / ctx.__name__, 0)).table.to_pylist()
        tables[ctx.__name__] = [
            (r["scope"], r["op"], r["outputs"]) for r in rows if r["op"] in ("output", "aten.add_.Tensor")
        ]
    assert len(tables["inference_mode"]) == (5 if level == "op" else 4)
    assert tables["inference_mode"] == tables["no_grad"]


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_sparse_quantized_nested_and_meta_tensors_are_recorded_by_their_value(tmp_path, worker):
    """Tensors whose bytes cannot be copied as they are do not fail the run: a sparse tensor is
    digested as its dense form, a quantized one as its integer values, a nested one as its components
    joined, a meta one by its header alone; at step level too (an embedding's sparse gradient)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized and nested tensors are deprecated or prototype
        q = torch.quantize_per_tensor(torch.linspace(-1, 1, 8), 0.1, 3, torch.quint8)
        q2 = torch.quantize_per_tensor(torch.linspace(-1, 1, 8) + torch.eye(8)[5] * 0.1, 0.1, 3, torch.quint8)
        nested = torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)])
    sparse = torch.eye(4).to_sparse()
    emb = torch.nn.Embedding(10, 3, sparse=True)
    work = [
        lambda: sparse * 2,
        lambda: torch.ones(3, device="meta") * 2,
        lambda: nested + nested,
        lambda: q.detach(),
        lambda: emb(torch.tensor([1, 1, 4])).sum().backward(),
        lambda: q2.detach(),
    ]
    rec = Recorder(tmp_path, level="op", worker=worker)
    with rec.step(1):
        for mb, fn in enumerate(work):  # one microbatch each: the last forward record is the result
            with rec.microbatch(mb):
                fn()
        rec.grads(emb.named_parameters())
    rec.close()
    last = {}
    for r in read_stream(stream_path(tmp_path, 0)).table.to_pylist():
        if r["phase"] in ("forward", "step"):
            last[r["microbatch"] if r["phase"] == "forward" else r["op"]] = r["outputs"]
    expected = {0: torch.eye(4) * 2, 2: torch.tensor([2.0, 2.0, 0.0, 2.0, 4.0]), "grad": emb.weight.grad.to_dense()}
    for key, value in expected.items():
        assert last[key] == bytes.fromhex(digest(value)), key
    assert len(last[1]) == 16  # meta: the header of a float32 (3,) tensor over no bytes
    # quantized: its integer values under its own dtype's header; one value apart, another digest
    assert (q.int_repr() != q2.int_repr()).sum() == 1 and len(last[3]) == 16 and last[3] != last[5]
    assert emb.weight.grad.layout == torch.sparse_coo


class Unusual(torch.nn.Module):
    """Children whose outputs are no plain tensor: sparse, quantized, nested, conjugate views (one large
    enough to be hashed where it lies); ``change`` changes the last one in place after its module returned."""

    class Apply(torch.nn.Module):
        def __init__(self, fn) -> None:
            super().__init__()
            self.fn = fn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fn(x)

    def __init__(self, change: bool = False) -> None:
        super().__init__()
        self.change = change
        self.parts = torch.nn.ModuleList(
            self.Apply(fn)
            for fn in (
                lambda x: (x * 2).to_sparse(),
                lambda x: torch.quantize_per_tensor(x, 0.1, 3, torch.quint8),
                lambda x: torch.nested.nested_tensor([x[0], x[1, :2]]),
                lambda x: (x * 1j).conj(),
                lambda x: (x.repeat(256, 256) * 1j).conj(),
            )
        )  # 4 MiB complex64: past digest.BIG_BYTES

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = [part(x) for part in self.parts]
        if self.change:
            outs[-1].mul_(2)
        return outs


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_module_outputs_that_are_no_plain_tensor_are_digested_where_they_lie_as_copies_are(tmp_path, worker):
    """At module level (outputs digested where they lie, checked unchanged), a sparse, quantized, nested or
    conjugate output gets the record its copy gets (copy=True): neither worker refuses it. A change in
    place after its module returned is still refused, though the worker takes its plain form late."""
    import warnings

    x = torch.arange(16.0).reshape(4, 4) / 16
    tables = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized and nested tensors are deprecated or prototype
        for copy in (False, True):
            rec, model = Recorder(tmp_path / str(copy), level="module", copy=copy, worker=worker), Unusual()
            rec.attach(model)
            with rec.step(1), rec.microbatch(0), torch.no_grad():
                outs = model(x)
            rec.close()
            tables[copy] = read_stream(stream_path(tmp_path / str(copy), 0)).table
        rows = {r["scope"]: r["outputs"] for r in tables[False].to_pylist() if r["op"] == "output"}
        assert tables[False].equals(tables[True]) and len(rows) == 6
        assert rows["parts.0"] == bytes.fromhex(digest(x * 2))  # sparse: its dense form
        assert rows["parts.3"] == bytes.fromhex(digest((x * 1j).conj().resolve_conj()))
        assert rows["parts.4"] == bytes.fromhex(digest(outs[4].resolve_conj())) != rows["parts.3"]
        rec = Recorder(tmp_path / "changed", level="module", worker=worker)
        model = Unusual(change=True)
        rec.attach(model)
        with rec.step(1), rec.microbatch(0), torch.no_grad():
            model(x)
        with pytest.raises(RuntimeError, match=r"scope='parts.4' op='output' occurrence=0 was changed in place"):
            rec.close()


def _described(run: Path, trace: dict | None = None, config: dict | None = None, world: int = 1) -> Path:
    """``run`` with a minimal run.json: ``config``, or just a ``trace`` section."""
    config = config if config is not None else {"trace": trace} if trace else {}
    (run / "run.json").write_text(
        json.dumps(
            {
                "format": "samestep.run",
                "version": 1,
                "config": config,
                "determinism": {},
                "environment": {"torch.version": "x"},
                "layout": {"world_size": world},
            }
        )
    )
    return run


def test_runs_traced_at_other_levels_or_steps_are_compared_on_what_both_recorded(tmp_path):
    """An op-level and a module-level trace of the same work are identical at module level (not a
    "structural divergence: code paths differ"); a real difference still shows through that cut; runs
    that traced other steps are compared on the steps both traced, with a note each time."""

    def run(name: str, level: str, scale: float = 1.0, steps: set[int] | None = None) -> Path:
        _record(tmp_path / name, level, scale=scale, steps=steps)
        return _described(
            tmp_path / name, {"level": level, "steps": "all" if steps is None else ",".join(map(str, sorted(steps)))}
        )

    op, module = run("op", "op"), run("module", "module")
    report = diff_runs(op, module)
    modules = read_stream(stream_path(module, 0)).table.num_rows
    assert report["identical"] and report["per_rank"]["0"]["records_compared"] == modules
    assert report["notes"] == [
        "A was traced at op level, B at module: compared at module level (run A's finer records are left out)"
    ]
    other = diff_runs(run("other", "op", scale=2.0), module)  # the negative control: the cut hides no difference
    first = other["first_difference"]
    assert not other["identical"] and (first["kind"], first["op"], first["step"]) == ("first_seen", "output", 1)
    report = diff_runs(run("step2", "module", steps={2}), module)
    assert report["identical"] and 0 < report["per_rank"]["0"]["records_compared"] < modules
    assert "traced steps differ (A: 2, B: all): traces compared on the steps both traced (2)" in report["notes"]


@pytest.mark.parametrize("level", ["module", "op"])
def test_a_compiled_model_is_traced_as_the_model_it_compiles(tmp_path, level):
    """A torch.compile'd model (backend aot_eager: inductor on CPU needs minutes of C++ builds) gets the
    records of the uncompiled model at module and op level: the same identities (no '_orig_mod' scope, the
    root once) and, with this backend, digests; also when its code was compiled before attach() (Dynamo
    skips guards on module hooks: without the reset, that code calls none of them)."""
    torch._dynamo.reset()

    def run(name: str, compiled: bool, warm: bool = False):
        torch.manual_seed(0)
        model = Tiny()
        called = torch.compile(model, backend="aot_eager") if compiled else model
        if warm:  # compiled and run before the recorder's hooks exist
            called(torch.ones(2, 4)).backward()
            model.zero_grad()
        rec = Recorder(tmp_path / name, level=level, worker="thread")
        rec.attach(called)
        with rec.step(1):
            for mb in (0, 1):  # another batch size: Dynamo compiles anew, with symbolic shapes
                with rec.microbatch(mb):
                    called(torch.ones(2 + mb, 4) * (mb + 1)).backward()
            rec.grads(model.named_parameters())
        rec.close()
        return read_stream(stream_path(tmp_path / name, 0)).table

    warm, compiled, eager = run("warm", True, warm=True), run("compiled", True), run("eager", False)
    scopes = set(eager["scope"].to_pylist())
    assert {"", "inner", "inner.0", "head"} <= scopes and eager.num_rows > 20
    assert compiled.equals(eager) and warm.equals(eager)


def test_levels_include_the_ones_before(tmp_path):
    """step < module < op in what they record."""
    counts = {}
    for level in ("step", "module", "op"):
        _record(tmp_path / level, level)
        counts[level] = read_stream(stream_path(tmp_path / level, 0)).table.num_rows
    assert 0 < counts["step"] < counts["module"] < counts["op"]


@pytest.mark.parametrize("level", ["module", "op"])
def test_flushing_after_every_record_writes_the_same_stream(tmp_path, monkeypatch, level):
    """Batches cut anywhere (chunks reused while the worker digests, checks verified batch by batch,
    sequence numbers carried over, module records made as soon as the hooks note them) give the same
    records as one batch per step."""
    _record(tmp_path / "whole", level)
    monkeypatch.setattr(staging_module, "FLUSH_BYTES", 0)
    monkeypatch.setattr(module_level, "PENDING_BYTES", 0)  # module records made as soon as noted
    monkeypatch.setattr(staging_module, "CHUNK_BYTES", 4096)  # and many small chunks
    _record(tmp_path / "cut", level)
    _record(tmp_path / "other", level, scale=1.0 + 2**-20)  # negative control: another input, also cut
    whole, cut, other = (read_stream(stream_path(tmp_path / d, 0)) for d in ("whole", "cut", "other"))
    assert cut.table.num_rows == whole.table.num_rows > 20 and cut.table.equals(whole.table)
    assert cut.torn is None
    assert other.table.num_rows == whole.table.num_rows and not other.table.equals(whole.table)


def test_module_level_without_copies_records_the_same_digests(tmp_path):
    """Module outputs and gradients digested in place (checked) give the bytes of recording copies."""
    _record(tmp_path / "live", "module")
    _record(tmp_path / "copy", "module", copy=True)
    live, copied = (read_stream(stream_path(tmp_path / d, 0)).table for d in ("live", "copy"))
    assert live.num_rows > 20 and live.equals(copied)
    _record(tmp_path / "other", "module", scale=1.0 + 2**-20)  # negative control: another input shows
    assert not read_stream(stream_path(tmp_path / "other", 0)).table.equals(copied)


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
        tables.append(_without_ends(read_stream(stream_path(tmp_path / layout, 0)).table))
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
            tables[layout, copy] = _without_ends(read_stream(stream_path(tmp_path / f"{layout}-{copy}", 0)).table)
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


def test_module_outputs_in_dataclasses_dicts_and_tuples_are_recorded(tmp_path):
    """A module returning its own dataclass (as model output classes are, which the pytree does not
    know) has its tensors recorded, in forward and their gradients in backward, as from dicts and tuples."""
    from dataclasses import dataclass

    @dataclass
    class Out:
        logits: torch.Tensor
        extra: dict

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> Out:
            y = self.inner(x)
            return Out(y * 2, {"pair": (y, None)})

    torch.manual_seed(0)
    model = Wrapper()
    rec = Recorder(tmp_path, level="module")
    rec.attach(model)
    with rec.step(1), rec.microbatch(0):
        out = model(torch.ones(2, 4))
        out.logits.sum().backward()
    rec.close()
    rows = read_stream(stream_path(tmp_path, 0)).table.to_pylist()
    root = [r for r in rows if r["scope"] == "" and r["op"] == "output"]
    assert len(root) == 1 and root[0]["outputs"] == bytes.fromhex(digest(out.logits)) + bytes.fromhex(
        digest(out.extra["pair"][0])
    )
    assert [r["outputs"] for r in rows if r["scope"] == "" and r["op"] == "grad_output"] == [
        bytes.fromhex(digest(torch.ones(2, 4))),
        bytes.fromhex(digest(torch.full((2, 4), 2.0))),
    ]  # logits, y


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
    rows = _without_ends(read_stream(stream_path(tmp_path, 0)).table).to_pylist()
    n = len(rows) // 2 - 1  # the records of one state() call
    assert n == 4 * 4  # 4 parameters, each with its optimizer state: step, exp_avg, exp_avg_sq
    keys = [(r["scope"], r["op"], r["occurrence"]) for r in rows]
    assert len(set(keys)) == len(keys)  # no identity twice (it fails if the bulk path ignores earlier counts)
    assert keys[0] == ("inner.0.weight", "param", 0) and keys[-1] == ("inner.0.weight", "param", 3)
    once, twice = rows[1 : 1 + n], rows[1 + n : 1 + 2 * n]
    assert [r["occurrence"] for r in once] == [1] + [0] * (n - 1)
    assert [r["occurrence"] for r in twice] == [2] + [1] * (n - 1)
    assert [(r["scope"], r["op"], r["outputs"]) for r in once] == [(r["scope"], r["op"], r["outputs"]) for r in twice]


def test_module_gradient_hooks_behave_like_register_hook():
    """The module level's gradient hooks (registered without a handle) run in registration order among
    the user's hooks, survive the removal of the user's, and replace none; a leaf gets the public call.
    Negative control: a hook removed through its handle does not run."""
    w = torch.ones(3, requires_grad=True)
    for t in (w * 2.0, w):
        ran = []
        first = t.register_hook(lambda g: ran.append("user 1"))
        hooks_module.grad_hook(t, lambda g: ran.append("samestep"))
        t.register_hook(lambda g: ran.append("user 2"))
        removed = t.register_hook(lambda g: ran.append("removed"))
        removed.remove()
        first.remove()
        t.sum().backward()
        assert ran == ["samestep", "user 2"]


class ChangesAnOutput(torch.nn.Module):
    """Changes a child module's output in place after the child returned (legal: Linear keeps no output)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        h.add_(1.0)
        return self.head(h).sum()


def test_module_records_noted_by_hooks_keep_their_place_among_other_records(tmp_path):
    """Module hooks only note outputs and gradients (their records are made later, by _drain), yet the
    stream is the one made at once (copy=True records inside the hooks): a record made between forward
    and backward, and one made from a gradient hook at the end of backward, stay where they happened."""

    def run(name: str, copy: bool):
        torch.manual_seed(0)
        model = Tiny()
        rec = Recorder(tmp_path / name, level="module", copy=copy)
        rec.attach(model)
        with rec.step(1):
            with rec.microbatch(0):
                x = torch.ones(2, 4, requires_grad=True)
                x.register_hook(lambda g: rec.record("input_grad", [g]))  # the last gradient of backward
                y = model(x)
                rec.record("between", [y.detach()])
                y.backward()
            rec.grads(model.named_parameters())
        rec.close()
        return read_stream(stream_path(tmp_path / name, 0)).table

    noted, at_once = run("noted", False), run("at_once", True)
    assert noted.equals(at_once)
    ops = noted.column("op").to_pylist()
    outputs = [i for i, op in enumerate(ops) if op == "output"]
    grads = [i for i, op in enumerate(ops) if op == "grad_output"]
    assert len(outputs) == len(grads) == 5  # inner.0, inner.1, inner, head and the model itself ("")
    assert max(outputs) < ops.index("between") < min(grads) and max(grads) < ops.index("input_grad")


@pytest.mark.parametrize("bound", [None, 0])
def test_noted_module_records_keep_a_bounded_amount_alive(tmp_path, monkeypatch, bound):
    """The notes keep their tensors alive until drained: past PENDING_BYTES a hook drains at once, so
    a microbatch's activations are not all held (here: 0 bytes, nothing stays noted). Negative control:
    under the default bound the five outputs of a forward stay noted until the microbatch ends."""
    if bound is not None:
        monkeypatch.setattr(module_level, "PENDING_BYTES", bound)
    model = Tiny()
    rec = Recorder(tmp_path, level="module")
    rec.attach(model)
    with rec.step(1):
        with rec.microbatch(0):
            model(torch.ones(2, 4))
            assert len(rec._modules.pending) == (5 if bound is None else 0)
        assert not rec._modules.pending  # the microbatch's end drains
    rec.close()
    assert _without_ends(read_stream(stream_path(tmp_path, 0)).table).num_rows == 5


def test_in_place_change_of_a_recorded_output_is_refused_or_copied(tmp_path):
    """Without copies, an output changed in place after it was recorded stops the run with the record's
    identity and the fix (with a worker thread or process); with copies, the recorded digest is that of
    the value the module returned."""
    torch.manual_seed(0)
    model, x = ChangesAnOutput(), torch.ones(2, 4)
    with torch.no_grad():
        returned = digest(model.inner(x))
    for copy, worker in ((False, "thread"), (False, "process"), (True, "auto")):
        rec = Recorder(tmp_path / f"{copy}{worker}", level="module", copy=copy, worker=worker)
        rec.attach(model)
        with rec.step(1):
            with rec.microbatch(0):
                model(x).backward()
            rec.grads(model.named_parameters())
        if copy:
            rec.close()
        else:  # checked when the digests are done: at the next grads(), flush() or close()
            with pytest.raises(
                RuntimeError,
                match=r"scope='inner' op='output' occurrence=0 was changed in place.*"
                r"trace.copy=true",
            ):
                rec.close()
            assert read_stream(stream_path(tmp_path / f"False{worker}", 0)).table.num_rows == 0  # none written
        model.zero_grad(set_to_none=True)
    rec = Recorder(tmp_path / "op", level="op")  # op level copies: the in-place add_ is an op of its own
    rec.attach(model)
    with rec.step(1):
        with rec.microbatch(0):
            model(x).backward()
        rec.grads(model.named_parameters())
    rec.close()
    for run in ("Trueauto", "op"):
        rows = read_stream(stream_path(tmp_path / run, 0)).table.to_pylist()
        out = next(r for r in rows if r["scope"] == "inner" and r["op"] == "output")
        assert out["outputs"].hex() == returned  # the value the module returned, not the changed one
    with torch.no_grad():
        assert digest(model.inner(x) + 1.0) != returned  # negative control: the change is visible


def test_torn_tail_is_reported_not_fatal(tmp_path):
    """Cutting the file mid-batch keeps every complete batch and reports the torn tail."""
    _record(tmp_path, "op")
    path = stream_path(tmp_path, 0)
    full = read_stream(path).table.num_rows
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    s = read_stream(path)
    assert s.torn is not None and 0 < s.table.num_rows < full


def _run_dir(
    root: Path,
    name: str,
    rows: list[dict],
    config: dict | None = None,
    version: int = VERSION,
    ranks: dict[int, list[dict]] | None = None,
    ends: bool = False,
) -> Path:
    """A run directory with ``rows`` as rank 0's stream, or one stream per rank of ``ranks``; ``ends``: each
    step's records close with its step.end record."""
    run = root / name
    run.mkdir(parents=True)
    _described(run, config=config or {"train": {"seed": 1}, "trace": {"level": "op"}}, world=len(ranks) if ranks else 1)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss_hex": "0x1p+0", "grad_norm_hex": "0x1p+0"}) + "\n")
    writer = StreamWriter(stream_path(run, 0), {"rank": 0})
    if version != VERSION:
        writer._writer.close()
        writer._file.close()
        with open(stream_path(run, 0), "wb") as f:
            w = pa.ipc.new_stream(f, SCHEMA.with_metadata({"format": FORMAT, "version": str(version)}))
            w.close()
        return run
    for rank, rank_rows in (ranks or {0: rows}).items():
        if ends:
            rank_rows = rank_rows + [
                {
                    "seq": len(rank_rows) + i,
                    "step": step,
                    "microbatch": -1,
                    "phase": "step",
                    "scope": "",
                    "op": END,
                    "occurrence": 0,
                    "inputs": b"",
                    "outputs": b"",
                }
                for i, step in enumerate(sorted({r["step"] for r in rank_rows}))
            ]
        if rank:
            writer = StreamWriter(stream_path(run, rank), {"rank": rank})
        writer.write({c: [r[c] for r in rank_rows] for c in SCHEMA.names})
        writer.close()
    return run


def _rows(n: int = 5, **changes) -> list[dict]:
    rows = [
        {
            "seq": i,
            "step": 1,
            "microbatch": 0,
            "phase": "forward",
            "scope": "m",
            "op": f"aten.op{i}.default",
            "occurrence": 0,
            "inputs": bytes([i]) * 16,
            "outputs": bytes([i + 1]) * 16,
        }
        for i in range(n)
    ]
    for idx, fields in changes.items():
        rows[int(idx[1:])].update(fields)
    return rows


def test_diff_identical_origin_receiver_structural(tmp_path):
    """Hand-built streams: identical; an output change with matched inputs (origin); a changed input
    (receiver); a different op at the same position (structural, reported first)."""
    a = _run_dir(tmp_path, "a", _rows())
    assert diff_runs(a, _run_dir(tmp_path, "same", _rows()))["identical"]
    origin = diff_runs(a, _run_dir(tmp_path, "o", _rows(r2={"outputs": b"x" * 16})))
    assert not origin["identical"] and origin["origin"]["op"] == "aten.op2.default"
    assert origin["origin"]["inputs_matched"] and "origin" in origin["summary"]
    recv = diff_runs(a, _run_dir(tmp_path, "r", _rows(r3={"inputs": b"y" * 16, "outputs": b"y" * 16})))
    assert recv["origin"] is None and recv["first_difference"]["kind"] == "receiver"
    assert "no origin found" in recv["summary"] and "widen" in recv["summary"]
    struct = diff_runs(a, _run_dir(tmp_path, "s", _rows(r1={"op": "aten.other.default"}, r2={"outputs": b"z" * 16})))
    assert struct["first_difference"]["kind"] == "structural" and struct["origin"] is None
    assert struct["first_difference"]["other"]["op"] == "aten.other.default"
    short = diff_runs(a, _run_dir(tmp_path, "short", _rows(3)))
    assert short["first_difference"]["kind"] == "structural"


def test_human_report_names_ops_in_full_and_folds_ranks_that_match(tmp_path, capsys, monkeypatch):
    """`samestep diff` without --json, piped: the summary and a table whose consecutive ranks with no
    difference are one row each (a 1,024-rank diff stays a few rows); names are never cut short."""
    from samestep.cli import main

    ranks = 40
    a = _run_dir(tmp_path, "a", [], ranks={r: _rows() for r in range(ranks)})
    changed = {r: _rows(r2={"outputs": b"x" * 16}) if r in (5, 6, 39) else _rows() for r in range(ranks)}
    b = _run_dir(tmp_path, "b", [], ranks=changed)
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "origin on rank(s) 5-6,39 only, of 40 (0-39)" in out
    rows = [line.split("│")[1:-1] for line in out.splitlines() if line.startswith("│")]
    assert [(cells[0].strip(), cells[1].strip(), cells[2].strip()) for cells in rows] == [
        ("0-4", "25 (5 ranks)", "none"),
        ("5", "2", "origin"),
        ("6", "2", "origin"),
        ("7-38", "160 (32 ranks)", "none"),
        ("39", "2", "origin"),
    ]
    assert all("aten.op2.default #0" in cells[6] for cells in rows if cells[2].strip() == "origin")
    assert main(["diff", str(a), str(a)]) == 0
    assert [
        [c.strip() for c in line.split("│")[1:4]]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("│")
    ] == [["0-39", "200 (40 ranks)", "none"]]


def test_copy_like_op_diverging_points_outside_the_dispatcher(tmp_path):
    """A clone whose inputs matched but output differs: the note blames a write outside the dispatcher."""
    rows = _rows()
    rows[2]["op"] = "aten.clone.default"
    b_rows = [dict(r) for r in rows]
    b_rows[2]["outputs"] = b"q" * 16
    report = diff_runs(_run_dir(tmp_path, "a", rows), _run_dir(tmp_path, "b", b_rows))
    assert report["origin"]["op"] == "aten.clone.default" and "outside the dispatcher" in report["summary"]


def test_diff_refuses_other_config_environment_or_schema(tmp_path):
    """Different config or trace schema version: refused with the fields, unless --force (config)."""
    a = _run_dir(tmp_path, "a", _rows())
    b = _run_dir(tmp_path, "b", _rows(), config={"train": {"seed": 2}, "trace": {"level": "op"}})
    with pytest.raises(DiffError, match=r"train\.seed \(1 vs 2\)"):
        diff_runs(a, b)
    assert "config differs" in diff_runs(a, b, force=True)["notes"][0]
    v1 = _run_dir(tmp_path, "v1", [], version=1)
    with pytest.raises(DiffError, match="trace schema version '1'"):
        diff_runs(a, v1)
    with pytest.raises(DiffError, match="run.json: missing"):
        diff_runs(a, tmp_path / "nope")


def test_diff_leaves_out_state_records_that_streams_of_other_versions_digest_otherwise(tmp_path, monkeypatch):
    """A version-3 stream digests parameters and optimizer state by samestep's tensor digest, a version-4 one by
    their state checksum: diff compares the rest and leaves those out, a note naming both; a difference in the
    rest is still found. Control: between two version-4 streams the same state records are compared, and the
    changed one is the first difference."""
    from samestep.tracing import stream

    state = {
        "seq": 5,
        "step": 1,
        "microbatch": -1,
        "phase": "step",
        "scope": "w",
        "op": "param",
        "occurrence": 0,
        "inputs": b"",
        "outputs": b"s" * 16,
    }
    moved = [*_rows(), {**state, "outputs": b"t" * 16}]
    with monkeypatch.context() as m:
        m.setattr(stream, "VERSION", 3)
        old = _run_dir(tmp_path, "old", [*_rows(), state])
    assert read_stream(stream_path(old, 0)).meta["stream_version"] == 3
    report = diff_runs(old, _run_dir(tmp_path, "new", moved))
    assert report["identical"] and report["per_rank"]["0"]["records_compared"] == 5
    assert any(
        "state records (param, optim.*) are left out: A's trace digests them by tensor digest, B's by "
        "state checksum" in n
        for n in report["notes"]
    ), report["notes"]
    report = diff_runs(old, _run_dir(tmp_path, "other", [*_rows(r2={"outputs": b"x" * 16}), state]))
    assert not report["identical"] and report["origin"]["op"] == "aten.op2.default"
    report = diff_runs(_run_dir(tmp_path, "v4", [*_rows(), state]), tmp_path / "new")  # control
    assert not report["identical"] and report["first_difference"]["op"] == "param"
    assert not any("left out" in n for n in report["notes"])


def test_diff_refuses_a_selection_with_nothing_to_compare(tmp_path):
    """--ranks naming an untraced rank, or --steps the runs do not have, is an input error naming what the
    runs hold (not an "identical" verdict over nothing); steps the runs have but did not trace get a note."""
    a, b = _run_dir(tmp_path, "a", _rows()), _run_dir(tmp_path, "b", _rows())
    with pytest.raises(DiffError, match=r"--ranks 0-1,3: rank\(s\) 1,3 have no trace in either run \(A traced 0, B 0"):
        diff_runs(a, b, ranks={0, 1, 3})
    with pytest.raises(DiffError, match=r"--steps 2-3: neither run has these steps \(A: 1, B: 1\)"):
        diff_runs(a, b, steps={2, 3})
    assert diff_runs(a, b, ranks={0}, steps={1, 2})["per_rank"]["0"]["records_compared"] == 5
    untraced = [dict(r, step=2) for r in _rows()]  # step 1's metrics, but records of step 2 only
    c, d = _run_dir(tmp_path, "c", untraced), _run_dir(tmp_path, "d", untraced)
    report = diff_runs(c, d, steps={1})
    assert report["identical"] and report["summary"] == "identical: the metric bits of 1 step(s) match"
    assert any("no trace records fall in --steps 1" in n for n in report["notes"])


def _own_loop(run: Path, perturb: Perturb | None = None) -> None:
    """A user's own training loop, traced with the public samestep.trace() (no samestep train around it)."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    rec = samestep.trace(run, level="op", steps="1-2", perturb=perturb)
    rec.attach(model)
    for step in (1, 2, 3):
        traced_step(rec, model, opt, step, [(mb, torch.full((2, 4), 0.5 * (mb + 1))) for mb in (0, 1)], model)
    rec.close()


def test_a_traced_run_of_your_own_loop_diffs_and_certifies(tmp_path):
    """samestep.trace() in a loop of the user's own gives its run directory a run.json, so diff and
    certify work on it: two runs are identical, a planted ULP is found as the origin, certify sees the
    selected steps and deterministic mode; without enable() certify says so; a run.json already there
    (samestep train writes its own first) is kept."""
    from samestep.cli import main

    with samestep.enable(threads=1):
        for name in ("a", "b"):
            _own_loop(tmp_path / name)
        _own_loop(
            tmp_path / "ulp",
            Perturb(rank=0, step=2, microbatch=1, phase="forward", scope="head", op="aten.addmm.default"),
        )
    doc = json.loads((tmp_path / "a" / "run.json").read_text())
    assert doc["config"] == {"trace": {"level": "op", "steps": "1-2", "ranks": "all"}}
    assert doc["written_by"] == "samestep.trace" and doc["determinism"]["threads"] == 1
    same = diff_runs(tmp_path / "a", tmp_path / "b")
    assert same["identical"] and same["summary"].startswith("identical: ") and "metric bit" not in same["summary"]
    assert same["per_rank"]["0"]["records_compared"] > 100
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    o = diff_runs(tmp_path / "a", tmp_path / "ulp")["origin"]  # the negative control: the same check sees one ULP
    assert (o["step"], o["microbatch"], o["scope"], o["op"], o["inputs_matched"]) == (
        2,
        1,
        "head",
        "aten.addmm.default",
        True,
    )
    cert = certify_trace(tmp_path / "a")
    assert cert["complete"], cert["problems"]
    assert cert["selected_steps"] == "1-2" and cert["ranks"]["0"]["steps"] == "1-2"

    _own_loop(tmp_path / "off")  # deterministic mode not in force
    assert certify_trace(tmp_path / "off")["problems"] == [
        "deterministic mode is not recorded in run.json (samestep.enable() was not in force when "
        "samestep.trace() started)"
    ]
    (tmp_path / "kept").mkdir()
    kept = '{"format": "samestep.run", "version": 1, "config": {"train": {}}}'
    (tmp_path / "kept" / "run.json").write_text(kept)
    _own_loop(tmp_path / "kept")
    assert (tmp_path / "kept" / "run.json").read_text() == kept


def test_certify_complete_and_gaps(tmp_path):
    """A contiguous trace of every step certifies; a sequence gap and a missing step are named."""
    good = _run_dir(tmp_path, "good", _rows(), ends=True)
    assert certify_trace(good)["complete"]
    bad_rows = _rows()
    bad_rows[3]["seq"] = 9
    bad = _run_dir(tmp_path, "bad", bad_rows, ends=True)
    (bad / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    problems = certify_trace(bad)["problems"]
    assert any("sequence jumps from 2 to 9" in p for p in problems)
    assert any("no records for step(s) 2" in p for p in problems)


def test_a_perturbation_lands_in_an_output_of_any_layout():
    """The planted ULP goes to element 0 of an output that is no contiguous block (a transposed one, as
    SDPA's backward gives, and an expanded-then-sliced one), and of a 0-dim one; exactly one element moves,
    by one ULP. Control: another occurrence changes nothing."""
    perturb = Perturb(rank=0, step=1, microbatch=0, phase="backward", scope="attn", op="aten.op", occurrence=0)
    identity = (0, 1, 0, "backward", "attn", "aten.op", 0)
    for out in (torch.arange(12, dtype=torch.float32).view(3, 4).t(), torch.ones(4, 6)[:, ::2], torch.tensor(2.5)):
        before = out.clone()
        perturb.apply((*identity[:-1], 1), [out])
        assert torch.equal(out.view(torch.int32), before.view(torch.int32))
        perturb.apply(identity, [out])
        moved = (out.view(torch.int32) - before.view(torch.int32)).flatten()
        assert moved[0].item() == 1 and moved.count_nonzero().item() == 1


def test_a_collective_forgets_what_it_may_write_and_keeps_memory_still_uninitialised():
    """After a collective the op recorder stages anew whatever the collective may write (its arguments, any view
    of their storage) but keeps knowing that memory made elsewhere is uninitialised: digesting it would record
    whatever bytes lie there, another value in every run (a buffer made before an all-gather and filled after
    it). Negative control: a tensor the collective writes is forgotten, as is an initialised one."""
    from samestep.tracing.batch import NO_REF
    from samestep.tracing.staging import Staging

    st = Staging()
    spare, target, filled = torch.empty(8), torch.empty(8), torch.ones(8)
    assert st.stage(spare, uninit=True) == NO_REF and st.stage(target, uninit=True) == NO_REF
    st.stage(filled)
    st.forget([target[2:]])  # a view: the storage is what counts
    assert st.cached(spare, spare._version) == NO_REF
    assert st.cached(target, target._version) is None and st.cached(filled, filled._version) is None


def test_a_tensor_set_to_a_storage_object_is_recorded_uninitialised_until_written(tmp_path):
    """empty then set_ to a new storage (a DataLoader's collate does this before stack(out=) fills it): the
    set_'s output and the out= destination are uninitialised (UNINIT, not whatever bytes lay there), and the
    written result is digested. Control: set_ to another tensor (its bytes known) records them."""
    rec = Recorder(tmp_path, level="op")
    with rec.step(1), rec.microbatch(0):
        parts = [torch.full((3,), float(i)) for i in range(2)]
        out = torch.empty(0).set_(torch.UntypedStorage(6 * 4), 0, (2, 3), (3, 1))
        torch.stack(parts, out=out)
        (out + 0).sum()
        torch.empty(0).set_(parts[1])
    rec.close()
    rows = read_stream(stream_path(tmp_path, 0)).table.to_pylist()
    by_op = {}
    for r in rows:
        by_op.setdefault(r["op"], []).append(r)
    stored = [r for r in by_op["aten.set_.source_Storage_storage_offset"]]
    assert len(stored) == 1 and stored[0]["outputs"] == bytes(16)
    assert by_op["aten.stack.out"][0]["outputs"] == bytes.fromhex(digest(torch.tensor([[0.0] * 3, [1.0] * 3])))
    assert by_op["aten.add.Tensor"][0]["inputs"] == bytes.fromhex(digest(torch.tensor([[0.0] * 3, [1.0] * 3])))
    assert by_op["aten.set_.source_Tensor"][0]["outputs"] == bytes.fromhex(digest(parts[1]))


def test_a_perturbation_that_plants_nothing_is_an_error_at_the_end_of_its_step(tmp_path):
    """A perturb spec that matches no op of its step (a scope misspelt), or whose step is not traced at op
    level, raises at that step's end naming the spec, instead of leaving the run unperturbed and a diff of it
    "identical". Control: the spec of a record the step makes plants its ULP and the step ends."""

    def run(path: Path, perturb: Perturb, level: str = "op") -> None:
        rec = Recorder(path, level=level, perturb=perturb)
        try:
            with rec.step(1), rec.microbatch(0):
                (torch.ones(4) * 3).sum()
        finally:
            rec.close()

    hit = Perturb(rank=0, step=1, microbatch=0, phase="forward", scope="", op="aten.mul.Tensor")
    run(tmp_path / "hit", hit)
    assert hit.fired
    missed = Perturb(rank=0, step=1, microbatch=0, phase="forward", scope="lm_haed", op="aten.mul.Tensor")
    with pytest.raises(
        ValueError,
        match=r"trace.perturb: rank=0,step=1,microbatch=0,phase=forward,scope=lm_haed,"
        r"op=aten.mul.Tensor,occurrence=0 matched no floating-point op output",
    ):
        run(tmp_path / "missed", missed)
    with pytest.raises(ValueError, match="nothing was planted"):
        run(
            tmp_path / "untraced",
            Perturb(rank=0, step=1, microbatch=0, phase="forward", scope="", op="aten.mul.Tensor"),
            level="step",
        )

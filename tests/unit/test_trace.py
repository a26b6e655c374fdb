"""What each level of the recorder records: ops and modules, in place and in odd forms, compiled or not, in
bounded memory; and the selection of steps."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from samestep.analysis import diff_runs
from samestep.digests import digest
from samestep.tracing import Perturb, Recorder, format_selection, parse_selection, read_stream, stream_path
from tests.support.traces import Tiny, described, record, without_ends

staging_module = importlib.import_module("samestep.tracing.staging")
module_level = importlib.import_module("samestep.tracing.module_level")
step_level = importlib.import_module("samestep.tracing.step_level")
hooks_module = importlib.import_module("samestep.tracing.hooks")


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
    record(tmp_path, "op")
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
    origin = diff_runs(described(tmp_path / "a"), described(tmp_path / "b"))["origin"]
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
        record(tmp_path / level, level)
        counts[level] = read_stream(stream_path(tmp_path / level, 0)).table.num_rows
    assert 0 < counts["step"] < counts["module"] < counts["op"]


@pytest.mark.parametrize("level", ["module", "op"])
def test_flushing_after_every_record_writes_the_same_stream(tmp_path, monkeypatch, level):
    """Batches cut anywhere (chunks reused while the worker digests, checks verified batch by batch,
    sequence numbers carried over, module records made as soon as the hooks note them) give the same
    records as one batch per step."""
    record(tmp_path / "whole", level)
    monkeypatch.setattr(staging_module, "FLUSH_BYTES", 0)
    monkeypatch.setattr(module_level, "PENDING_BYTES", 0)  # module records made as soon as noted
    monkeypatch.setattr(staging_module, "CHUNK_BYTES", 4096)  # and many small chunks
    record(tmp_path / "cut", level)
    record(tmp_path / "other", level, scale=1.0 + 2**-20)  # negative control: another input, also cut
    whole, cut, other = (read_stream(stream_path(tmp_path / d, 0)) for d in ("whole", "cut", "other"))
    assert cut.table.num_rows == whole.table.num_rows > 20 and cut.table.equals(whole.table)
    assert cut.torn is None
    assert other.table.num_rows == whole.table.num_rows and not other.table.equals(whole.table)


def test_module_level_without_copies_records_the_same_digests(tmp_path):
    """Module outputs and gradients digested in place (checked) give the bytes of recording copies."""
    record(tmp_path / "live", "module")
    record(tmp_path / "copy", "module", copy=True)
    live, copied = (read_stream(stream_path(tmp_path / d, 0)).table for d in ("live", "copy"))
    assert live.num_rows > 20 and live.equals(copied)
    record(tmp_path / "other", "module", scale=1.0 + 2**-20)  # negative control: another input shows
    assert not read_stream(stream_path(tmp_path / "other", 0)).table.equals(copied)


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
    assert without_ends(read_stream(stream_path(tmp_path, 0)).table).num_rows == 5


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

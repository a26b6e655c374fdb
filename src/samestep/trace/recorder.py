"""The recorder: the capture ladder (step, module, op) written as one ordered stream per rank.

    rec = samestep.trace(run_dir, level="op", steps={1, 2, 3}, rank=rank)
    rec.attach(model)
    ddp.register_comm_hook(None, rec.ddp_comm_hook())   # under PyTorch DDP: its reductions recorded too
    fsdp_module.set_custom_reduce_scatter(rec.fsdp_reduce_scatter())   # under FSDP2, likewise
    for step in ...:
        with rec.step(step):
            for i in my_microbatches:
                with rec.microbatch(i):
                    loss = model(...); loss.backward()
            rec.grads(model.named_parameters())
            optimizer.step()
            rec.state(model, optimizer)
    rec.close()

Levels (each includes the ones before):
- ``step``: loss and grad-norm bits, each parameter's gradient after reduction, parameters, buffers
  and optimizer state after the update, each collective's input and output;
- ``module``: every module's forward output and the gradient arriving at it in backward, by path;
- ``op``: every ATen op's input and output digests (a TorchDispatchMode), scoped by module; the
  scope follows the op into backward through hooks on module outputs.

Observing never perturbs (DESIGN invariant 3): what is recorded is digested later in batches, by a
worker (``worker.py``: a child process on Linux CPU, else a thread) while training continues; nothing
the model computes is changed, unless a ``Perturb`` is given on purpose. Op outputs and gradients are
copied into reused chunks (and buffers, which a forward may change); parameters and optimizer state
are digested where they lie before the next update may change them; module outputs and their
gradients too, and each is checked unchanged (its version counter) once its digest is done: a change
in place raises, naming the record (``copy=True`` copies them instead); so are parameter gradients
with ``grads(..., copy="checked")``. Records are kept in flat
columns, digests are computed for a whole batch at once (``digest.lanes_packed``), and the stream gets
one record batch per flush.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import json
import operator
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from samestep.checkpoint._format import replace_atomic
from samestep.env import environment
from samestep.mode import active_report
from samestep.trace.digest import ROW_BYTES, Packed, pack_into, rows_of
from samestep.trace.digest import header as digest_header
from samestep.trace.stream import RUN_FORMAT, RUN_VERSION, stream_path, stream_segments
from samestep.trace.worker import ProcessWorker, ThreadWorker, describe_all, plain

__all__ = ["LEVELS", "Perturb", "Recorder", "WORKERS", "parse_selection", "trace"]

LEVELS = ("off", "step", "module", "op")
WORKERS = ("auto", "process", "thread")
_MODULE = LEVELS.index("module")
NO_REF = -1  # the reference of uninitialised memory: digest UNINIT
# Ops whose output is uninitialised memory: digesting it would report noise as divergence.
_EMPTY_OPS = {"aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
              "aten.new_empty.default", "aten.new_empty_strided.default", "aten.empty.out"}
# Flush the staging area once it holds this many bytes (bounds the recorder's memory).
FLUSH_BYTES = 256 * 1024 * 1024
# Module records noted by the hooks are made once the tensors they keep alive reach this many bytes (or
# at the next microbatch, step or other record): the notes count towards the recorder's memory too.
PENDING_BYTES = 64 * 1024 * 1024
# Staged copies are packed into reused chunks of this size (a larger tensor gets its own copy).
CHUNK_BYTES = 32 * 1024 * 1024
_scope: contextvars.ContextVar[str] = contextvars.ContextVar("samestep_scope", default="")


def parse_selection(text: str | None, what: str) -> set[int] | None:
    """``"all"``/``""`` -> None (everything); ``"1-5,8"`` -> {1, 2, 3, 4, 5, 8}.

    Raises:
        ValueError: names ``what`` and the bad text.
    """
    if text is None or text.strip() in ("", "all"):
        return None
    out: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected 'all' or numbers and ranges like '1-5,8'") from None
    return out


def format_selection(values: Iterable[int]) -> str:
    """The inverse of ``parse_selection``: {1, 2, 3, 5} -> ``"1-3,5"`` (sorted; ``""`` for none)."""
    out: list[str] = []
    start = prev = None
    for v in sorted(values):
        if prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            out.append(f"{start}-{prev}" if start != prev else str(start))
        start = prev = v
    if start is not None:
        out.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(out)


@dataclass(frozen=True, slots=True)
class Perturb:
    """Fault injection for validating the diff: adds one ULP to element 0 of one op occurrence's output."""

    rank: int
    step: int
    microbatch: int
    phase: str
    scope: str
    op: str
    occurrence: int = 0

    @classmethod
    def parse(cls, text: str) -> Perturb:
        """From ``"rank=0,step=2,microbatch=1,phase=backward,scope=lm_head,op=aten.mm.default,occurrence=1"``
        (the identity of a trace record; ``rank`` and ``occurrence`` default to 0, ``scope`` to the root)."""
        try:
            fields = dict(item.split("=", 1) for item in text.split(","))
            if fields.get("phase", "forward") not in ("forward", "backward"):
                raise ValueError
            return cls(rank=int(fields.get("rank", 0)), step=int(fields["step"]), microbatch=int(fields["microbatch"]),
                       phase=fields.get("phase", "forward"), scope=fields.get("scope", ""), op=fields["op"],
                       occurrence=int(fields.get("occurrence", 0)))
        except (KeyError, ValueError):
            raise ValueError(f"trace.perturb={text!r}: expected 'rank=R,step=S,microbatch=M,phase=forward|backward,"
                             "scope=MODULE.PATH,op=OP,occurrence=K'") from None


def _leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in a module's arguments or output (a tensor or a flat tuple without the pytree walk)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) or v is None for v in value):
        return [v for v in value if v is not None]
    out = []
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif is_dataclass(leaf) and not isinstance(leaf, type):  # a model output class pytree does not know
            out.extend(_leaves([getattr(leaf, f.name) for f in fields(leaf)]))
    return out


def _pieces(group: list[tuple[int, int, torch.Tensor]]) -> tuple[list[int], list[int], int, int] | None:
    """How contiguous tensors of one storage, given as (storage offset, elements, tensor) sorted by offset,
    lie in the span [lo, hi) of it: the sizes that split the span (gaps between them included) and which
    of the pieces are the tensors. None if two of them overlap."""
    lo = end = group[0][0]
    sizes, keep = [], []
    for offset, numel, _ in group:
        if offset < end:
            return None
        if offset > end:
            sizes.append(offset - end)  # a gap, not digested
        keep.append(len(sizes))
        sizes.append(numel)
        end = offset + numel
    return sizes, keep, lo, end


_first = operator.itemgetter(0)


def _grad_hook(t: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """``t.register_hook(hook)`` without the handle that could remove it (the hook lives as long as
    ``t``): the same steps, about 0.8 us instead of 2.8 here, for hundreds of module outputs per step. A
    tensor that the public call would handle otherwise (a leaf, a subclass or an active torch function
    mode) gets the public call."""
    fn = t.grad_fn
    if fn is None or torch._C._has_torch_function_unary(t):
        t.register_hook(hook)
        return
    hooks = t._backward_hooks
    if hooks is None:
        t._backward_hooks = hooks = collections.OrderedDict()
        fn._register_hook_dict(t)
    key = RemovableHandle.next_id  # the ids handles take: no hook registered either way is replaced
    RemovableHandle.next_id += 1
    hooks[key] = hook


_COMPILED = "_orig_mod"  # the attribute under which torch.compile's OptimizedModule holds the module it wraps


def _is_compiled_wrapper(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, _COMPILED, None), torch.nn.Module) and type(module).__name__ == "OptimizedModule"


def _eager_call(hook: Callable, *args: Any) -> Any:
    return hook(*args)


_eager: list[Callable] = []  # torch.compiler.disable(_eager_call), made when compiled code first calls a hook


def _outside_compile(hook: Callable) -> Callable:
    """``hook``, run eagerly even where ``torch.compile`` traces the module: Dynamo would otherwise trace
    the recorder's Python into its graph with fake tensors (recording nothing real, or failing on it).
    There the call breaks the graph and runs on the real tensors, so a compiled model at module or op
    level runs in pieces split at its modules. In eager code the guard costs one flag test, and Dynamo
    (a second to import) is not loaded for it."""
    is_compiling = torch.compiler.is_compiling

    def run(*args: Any) -> Any:
        if is_compiling():
            if not _eager:
                _eager.append(torch.compiler.disable(_eager_call))
            return _eager[0](hook, *args)
        return hook(*args)
    return run


def _device(entry: torch.Tensor | tuple) -> torch.device:
    """The device of a staged tensor entry (a tensor, or (copy, sizes, keep))."""
    return entry.device if isinstance(entry, torch.Tensor) else entry[0].device


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors among op arguments or results (ATen nests them at most one list deep)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


# Ops whose first argument is overwritten whole, whatever it held.
_OVERWRITE_OPS = {"aten.copy_.default", "aten.fill_.Scalar", "aten.fill_.Tensor", "aten.zero_.default",
                  "aten.normal_.default", "aten.uniform_.default", "aten.bernoulli_.float", "aten.random_.default",
                  "aten.random_.from", "aten.random_.to", "aten.exponential_.default", "aten.geometric_.default",
                  "aten.log_normal_.default", "aten.cauchy_.default"}


@dataclass(frozen=True, slots=True)
class _OpKind:
    """What the op recorder needs to know of an op's schema, found once per op."""

    name: str
    mutates: bool  # writes into an argument (in place, or out=)
    written: tuple[bool, ...]  # per positional argument: written into
    written_only: frozenset[str]  # keyword arguments only written (out=): their old bytes are no input
    first_written_only: bool  # an _OVERWRITE_OPS op: nor are its first argument's
    collective: bool  # a c10d op: it may complete after it returns

    @classmethod
    def of(cls, func: Any) -> _OpKind:
        name = str(func)
        schema = getattr(func, "_schema", None)
        if schema is None:  # not an operator overload: nothing known, recorded like a pure op
            return cls(name, False, (), frozenset(), False, False)
        writes = [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments]
        out_kwargs = {a.name for a, w in zip(schema.arguments, writes) if w and a.kwarg_only}
        positional = tuple(w for a, w in zip(schema.arguments, writes) if not a.kwarg_only)
        return cls(name, any(writes), positional, frozenset(out_kwargs), name in _OVERWRITE_OPS,
                   name.startswith("c10d."))


_kinds: dict[Any, _OpKind] = {}


class _OpMode(TorchDispatchMode):
    """Records every ATen op's inputs (before it runs) and outputs (after)."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        rec._in_dispatch = True
        try:
            return self._record(rec, func, args, kwargs)
        finally:
            rec._in_dispatch = False

    def _record(self, rec: Recorder, func, args, kwargs):
        kind = _kinds.get(func)
        if kind is None:
            kind = _kinds[func] = _OpKind.of(func)
        if kind.first_written_only or kind.written_only:  # bytes about to be overwritten (often uninitialised)
            in_tensors, inputs = [], []
            for i, a in enumerate(args):
                for t in _tensors((a,)):
                    in_tensors.append(t)
                    inputs.append(NO_REF if i == 0 and kind.first_written_only else rec._stage(t))
            for k, v in kwargs.items():
                for t in _tensors((v,)):
                    in_tensors.append(t)
                    inputs.append(NO_REF if k in kind.written_only else rec._stage(t))
        else:
            in_tensors = _tensors(args) + (_tensors(kwargs.values()) if kwargs else [])
            inputs = [rec._stage(t) for t in in_tensors]
        out = func(*args, **kwargs)
        name = kind.name
        phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
        scope = rec._bwd_scope if phase == "backward" else _scope.get()
        occurrence = rec._occurrence(phase, scope, name)
        outs = _tensors(out if isinstance(out, (list, tuple)) else (out,))
        if kind.mutates and not outs:  # returns nothing (the _foreach_*_ ops): what it wrote is its output
            outs = [t for a, w in zip(args, kind.written) if w for t in _tensors((a,))]
        p = rec.perturb
        if (p is not None and outs and (p.rank, p.step, p.microbatch, p.phase, p.scope, p.op, p.occurrence)
                == (rec.rank, rec._step, rec._mb, phase, scope, name, occurrence)
                and outs[0].is_floating_point() and outs[0].numel()):
            flat = outs[0].view(-1)
            with torch.no_grad():
                flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype, device=flat.device))
        if name in _EMPTY_OPS:
            refs = [rec._stage(t, uninit=True) for t in outs]
        elif kind.collective:
            # It completes on another thread after it returns: its output bytes are not there yet (the
            # step level records the finished reduction; see ddp_comm_hook). It writes them below the
            # version counters, through its tensors and any view of them (DDP's bucket views): whatever
            # was staged before cannot be trusted to hold their bytes any more, so every later read
            # stages anew.
            refs = [NO_REF] * len(outs)
            rec._cache.clear()
            rec._memo.clear()
        elif kind.mutates:
            # Its version counter is bumped only after this mode returns: a look-up by version would find
            # the bytes from before the op
            refs = [rec._stage(t, fresh=True) for t in outs]
        elif func.is_view and len(outs) == 1 and inputs and inputs[0] == NO_REF:
            refs = [rec._stage(outs[0], uninit=True)]  # a view of uninitialised memory (a bucket being built)
        elif func.is_view and len(outs) == 1:
            # A view's bytes are a function of its input's bytes and the arguments: the same view of the
            # same input version (t(weight) in every microbatch, say) is digested once.
            key = (func, tuple(inputs), repr([a for a in args if not isinstance(a, torch.Tensor)]),
                   repr(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))))
            ref = rec._memo.get(key)
            if ref is None:
                ref = rec._memo[key] = rec._stage(outs[0], share=_same_bytes(outs[0], in_tensors, inputs, rec, name))
            else:
                rec._remember(outs[0], ref)
            refs = [ref]
        else:
            refs = [rec._stage(t, share=_same_bytes(t, in_tensors, inputs, rec, name)) for t in outs]
        rec._append(phase, scope, name, occurrence, inputs, refs)
        return out


# Ops whose output holds its first input's elements in the same logical (row-major) order.
_SAME_ORDER = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.unsqueeze.default",
               "aten.squeeze.dim", "aten.squeeze.default", "aten.squeeze.dims", "aten.flatten.using_ints",
               "aten.alias.default", "aten.detach.default", "aten.clone.default", "aten.lift_fresh.default",
               "aten.view_as.default", "aten.reshape_as.default"}


def _same_bytes(t: torch.Tensor, inputs: list[torch.Tensor], refs: list[int], rec: Recorder,
                name: str = "") -> int | None:
    """The staged copy of an input whose bytes are ``t``'s bytes in the same order (a reshape, detach,
    clone; or any output laid out exactly like a contiguous input): ``t`` needs no copy and no digest
    of its own, only its own header. None if there is none."""
    if name in _SAME_ORDER and inputs and refs[0] >= 0 and inputs[0].dtype == t.dtype \
            and inputs[0].numel() == t.numel():
        return rec._b.ref_slot[refs[0]]
    try:
        if not t.is_contiguous():
            return None
        for x, ref in zip(inputs, refs):
            if (ref >= 0 and x.dtype == t.dtype and x.numel() == t.numel() and x.data_ptr() == t.data_ptr()
                    and x.is_contiguous() and not x.is_inference() and x._version == t._version):
                return rec._b.ref_slot[ref]
    except RuntimeError:  # sparse or nested: no strides or no data pointer (staged through plain)
        pass
    return None


class _Batch:
    """The records of one flush and what they point at, in flat lists of numbers and strings: no container
    object per record, so a long step gives Python's garbage collector nothing new to traverse.

    Record ``i`` has inputs ``ins[in_end[i-1]:in_end[i]]`` and outputs likewise: references, each a
    (slot, digest header) pair in ``ref_slot``/``ref_head`` (``NO_REF``: uninitialised memory). A slot is
    an entry of a chunk in ``packs`` (``slot_chunk`` >= 0, ``slot_entry``) or a tensor (``slot_chunk`` -1,
    ``slot_entry`` counting the tensors that ``tensors`` expands to: each entry a tensor, or (copy, sizes,
    keep): the pieces ``keep`` of ``copy.split(sizes)``).
    """

    __slots__ = ("first_seq", "step", "mb", "phase", "scope", "op", "occ", "ins", "in_end", "outs", "out_end",
                 "ref_slot", "ref_head", "slot_chunk", "slot_entry", "packs", "tensors", "expanded", "check_live",
                 "check_version", "check_record", "described")

    def __init__(self, first_seq: int) -> None:
        self.first_seq = first_seq
        self.step: list[int] = []
        self.mb: list[int] = []
        self.phase: list[str] = []
        self.scope: list[str] = []
        self.op: list[str] = []
        self.occ: list[int] = []
        self.ins: list[int] = []
        self.in_end: list[int] = []
        self.outs: list[int] = []
        self.out_end: list[int] = []
        self.ref_slot: list[int] = []
        self.ref_head: list[bytes] = []
        self.slot_chunk: list[int] = []
        self.slot_entry: list[int] = []
        self.packs: list[Packed] = []
        self.tensors: list[torch.Tensor | tuple] = []
        self.expanded = 0
        # Live tensors digested without a copy that must not change before (``copy="checked"``): each one
        # (also in ``tensors``, or the buffer a (buffer, sizes, keep) entry there cuts), its version when
        # recorded and its record's index here. Flat lists: a tuple per tensor would give the garbage
        # collector hundreds of objects more per step to track.
        self.check_live: list[torch.Tensor] = []
        self.check_version: list[int] = []
        self.check_record: list[int] = []
        # Tensors the process worker need not describe again: index in ``tensors`` of the first -> the
        # descriptions of it and those after it (``_StatePlan.descs``).
        self.described: dict[int, list[tuple]] = {}

    def changed(self) -> list[int]:
        """The checks (indices) whose live tensor was changed in place since it was recorded."""
        return [k for k, (t, v) in enumerate(zip(self.check_live, self.check_version)) if t._version != v]


_data_ptrs = torch.Tensor.data_ptr
_sizes = torch.Tensor.size
_strides = torch.Tensor.stride
_dtypes = operator.attrgetter("dtype")


class _StatePlan:
    """What ``state()`` records, made once and used again while the parameters and the optimizer state are
    the same tensors: the same objects (parameters, then each parameter that has optimizer state, and its
    tensors under the same keys), each at the same address with the same dtype, shape and strides.

    A training loop updates them in place, so every step but the first skips sorting the optimizer state,
    making the records' headers and describing each tensor for the process worker (``descs``; None if
    a tensor is not one it reads where it lies). Checking the plan costs about what it spares in ``state``
    itself; the descriptions it spares are the gain: when plans came in, the reference model's step level
    spent 1.09-1.13 ms per step in the recorder with them, 1.18-1.23 ms without (bench_trace.py ``--levels
    step --recorder-calls``, alternating, 3 x 2). Any change (a new optimizer, a loaded state, ``p.data = ...``)
    makes a new plan. It holds weak references: no replaced optimizer's state is kept alive.
    """

    __slots__ = ("names", "refs", "lens", "keys", "mb", "order", "layout", "ops", "scopes", "heads", "counts",
                 "descs")

    def __init__(self, names: list[str], objs: list[torch.Tensor], lens: list[int], keys: list[str], mb: int,
                 order: list[int], tensors: list[torch.Tensor], ops: list[str], scopes: list[str], heads: list[bytes],
                 descs: list[tuple] | None) -> None:
        self.names, self.lens, self.keys, self.mb, self.order = names, lens, keys, mb, order
        try:
            self.refs = [weakref.ref(t) for t in objs]
            self.layout: tuple[list, ...] | None = _layout(tensors)
        except (TypeError, RuntimeError):  # no weak reference, or no address (sparse): not kept (see state)
            self.refs, self.layout = [], None
        self.ops, self.scopes, self.heads, self.descs = ops, scopes, heads, descs
        self.counts = _step_counts(mb, ops, scopes)  # a dict keeps its keys' hashes: see _record_many

    def matches(self, names: list[str], objs: list[torch.Tensor], lens: list[int], keys: list[str], mb: int) -> bool:
        """Whether the state walked now (as ``Recorder.state`` lists it) is the one this plan was made for
        (the layouts aside: see ``_layout``)."""
        return (mb == self.mb and lens == self.lens and keys == self.keys and names == self.names
                and len(objs) == len(self.refs) and all(map(operator.is_, objs, [r() for r in self.refs])))


def _step_counts(mb: int, ops: list[str], scopes: list[str]) -> dict[tuple, int]:
    """Step records' identities (``Recorder._occurrence``'s keys), each counted once."""
    return dict.fromkeys([(mb, "step", scope, op) for op, scope in zip(ops, scopes)], 1)


def _layout(tensors: list[torch.Tensor]) -> tuple[list, ...]:
    """Where and how each tensor lies: address, dtype, shape, strides (what a plan's descriptions and
    headers were made from)."""
    return (list(map(_data_ptrs, tensors)), list(map(_dtypes, tensors)), list(map(_sizes, tensors)),
            list(map(_strides, tensors)))


class Recorder:
    """Writes this rank's trace stream; see the module docstring for the protocol."""

    def __init__(self, run_dir: str | Path, *, level: str = "op", steps: set[int] | None = None,
                 ranks: set[int] | None = None, rank: int = 0, perturb: Perturb | None = None,
                 meta: dict[str, Any] | None = None, copy: bool = False, worker: str = "auto") -> None:
        if level not in LEVELS:
            raise ValueError(f"trace level {level!r} is unknown; use one of {', '.join(LEVELS)}")
        if worker not in WORKERS:
            raise ValueError(f"trace worker {worker!r} is unknown; use one of {', '.join(WORKERS)}")
        self.level, self.steps, self.rank, self.perturb = level, steps, rank, perturb
        # "auto": a child process on Linux without CUDA (see worker.py: it spares the training thread the
        # interpreter lock), else a thread.
        self._requested_worker = worker
        if worker == "auto":
            worker = "process" if sys.platform == "linux" and not torch.cuda.is_available() else "thread"
        self.worker = worker  # falls back to "thread" if "auto" cannot start a process (a warning says why)
        # Module level: module outputs and gradients copied, or kept and checked unchanged until digested.
        self._module_copy: bool | str = True if copy else "checked"
        self.enabled = level != "off" and (ranks is None or rank in ranks)
        self._rank_level = LEVELS.index(level)
        self._run_dir = Path(run_dir)
        self._meta = {"rank": rank, "level": level, **(meta or {})}
        self._writing = False  # the stream is opened at the first flush: nothing is written before
        self._step, self._mb = 0, -1
        self._bwd_scope = ""
        self._counts: dict[tuple, int] = {}
        # What is staged for digesting: copies packed into chunks, and whole tensors (a copy too large for
        # a chunk, or a live tensor); see _Batch.
        self._b = _Batch(0)
        self._open: dict[torch.device, tuple[int, int]] = {}  # device -> (chunk being filled, bytes used)
        self._free: dict[torch.device, list[torch.Tensor]] = {}  # chunks digested and ready for reuse
        self._inflight: _Batch | None = None
        self._tokens: list[contextvars.Token] = []  # forward scopes entered (pre hooks), innermost last
        self._heads: dict[tuple, bytes] = {}
        self._grad_bufs: dict[tuple, tuple[torch.Tensor, _Batch]] = {}  # (dtype, device) -> (buffer, its batch)
        self._state_plan: _StatePlan | None = None
        self._staged_bytes = 0
        # id -> (tensor, version, ref, also at version + 1: see _stage's fresh)
        self._cache: dict[int, tuple[weakref.ref, int, int, bool]] = {}
        self._memo: dict[tuple, int] = {}  # (view op, input refs, arguments) -> ref
        # Module level, checked live tensors: (op, phase, scope, tensors, their versions) noted by the
        # hooks, made into records by _drain before anything else is recorded (see _module_hook).
        self._pending: list[tuple[str, str, str, list[torch.Tensor], list[int]]] = []
        self._pending_bytes = 0
        self._seq = 0
        self._hooks: list[Any] = []
        self._buckets: list[tuple[int, str, torch.Tensor, torch.Tensor]] = []  # see _reduced
        self._buckets_lock = threading.Lock()
        self._comm_calls = 0  # fsdp_reduce_scatter's calls in this step (their order)
        self._in_dispatch = False
        self._dtensor: type | None = None  # DTensor, if torch.distributed.tensor was imported at step()
        self._worker: ThreadWorker | ProcessWorker | None = None
        if self.enabled and self.worker == "process":
            # Started now: the child imports torch (about 1.5 s) while the model is built and the first
            # step runs, instead of after the first flush, which would then wait for it.
            self._worker = self._start_worker()

    # -- selection -------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether the current step is recorded."""
        return self.enabled and (self.steps is None or self._step in self.steps)

    def _at(self, level: str) -> bool:
        return self.active and self._rank_level >= LEVELS.index(level)

    @property
    def _modules_on(self) -> bool:
        """Whether module records are taken now (checked in every module hook)."""
        return self._rank_level >= _MODULE and self.active

    # -- staging and records ---------------------------------------------------------------------------
    def _stage(self, t: torch.Tensor, uninit: bool = False, share: int | None = None,
               copy: bool | str = True, fresh: bool = False) -> int:
        """Stages a tensor for digesting (once per tensor version); returns its reference.

        A reference is (staged copy, header): ``share`` names a staged copy that already holds ``t``'s
        bytes (see ``_same_bytes``), so only the header is new. ``uninit`` marks fresh uninitialised
        memory: no reference (its digest is ``UNINIT``), and so for every later read of that tensor
        version, e.g. as the destination of ``bernoulli_``. ``copy=False`` keeps the live tensor;
        ``copy="checked"`` too, and ``_wait`` checks that it did not change before it was digested.
        ``fresh`` stages ``t`` anew even if this version was staged: an op wrote into it in place, and
        its version is bumped (by one) only after the op recorder returns, or never (C++ code such as
        DDP's reducer writes below the version counter). Later look-ups at this version and the next find
        the new reference, so the next op that reads it does not copy it again.
        An inference tensor (``torch.inference_mode``) has no version counter: it is never cached nor
        remembered, and copied even where ``copy="checked"`` (it could not be checked unchanged).
        """
        if self._dtensor is not None and isinstance(t, self._dtensor):
            t = t._local_tensor  # this rank's shard (see _shards)
        try:
            version: int | None = t._version
        except RuntimeError:  # an inference tensor
            version = None
            if copy == "checked":
                copy = True
        ref = None if fresh or version is None else self._cached(t, version)
        if ref is not None:
            return ref
        if uninit:
            if version is not None:
                self._remember(t, NO_REF, version)
            return NO_REF
        if share is None:
            if copy == "checked":
                share = self._checked_slot(t, version)
            elif not copy:
                share = self._add_tensor(t.detach())
            elif self._in_dispatch or not torch._C._len_torch_dispatch_stack():
                share = self._copy(t)
            else:
                with _disable_current_modes():
                    share = self._copy(t)
        return self._reference(t, share, version, also_next=fresh)

    def _cached(self, t: torch.Tensor, version: int) -> int | None:
        """The reference ``t`` was staged under at ``version`` in this batch, if it was."""
        hit = self._cache.get(id(t))
        if hit is None or hit[0]() is not t:
            return None
        return hit[2] if hit[1] == version or (hit[3] and hit[1] + 1 == version) else None

    def _checked_slot(self, t: torch.Tensor, version: int, record: int | None = None) -> int:
        """A slot for live ``t``, which ``_wait`` checks is still at ``version`` (for record index
        ``record``; by default the record made next)."""
        live = t.detach()  # shares t's version counter
        b = self._b
        b.check_live.append(live)
        b.check_version.append(version)
        b.check_record.append(len(b.step) if record is None else record)
        self._staged_bytes += live.nbytes  # kept alive: counts to the bound
        return self._add_tensor(live)

    def _reference(self, t: torch.Tensor, share: int, version: int | None, also_next: bool = False) -> int:
        """A new reference, slot ``share`` with ``t``'s header, remembered for ``t`` at ``version`` (and
        the next one, if ``also_next``; not at all for a tensor without a version)."""
        b = self._b
        b.ref_slot.append(share)
        b.ref_head.append(self._head(t))
        ref = len(b.ref_slot) - 1
        if version is not None:
            self._remember(t, ref, version, also_next)
        return ref

    def _head(self, t: torch.Tensor) -> bytes:
        """``t``'s digest header (dtype, shape, byte count), made once per dtype and shape."""
        try:
            key = (t.dtype, t.shape)
        except RuntimeError:  # a nested tensor has no single shape: the header of what plain digests
            return digest_header(plain(t))
        head = self._heads.get(key)
        if head is None:
            head = self._heads[key] = digest_header(t)
        return head

    def _add_tensor(self, t: torch.Tensor) -> int:
        """A whole tensor to digest as it is (``_add_tensors`` of one, without the lists)."""
        b = self._b
        b.tensors.append(t)
        b.slot_chunk.append(-1)
        b.slot_entry.append(b.expanded)
        b.expanded += 1
        return len(b.slot_chunk) - 1

    def _add_tensors(self, tensors: list[torch.Tensor]) -> range:
        """Whole tensors to digest as they are; returns their slots."""
        b, n = self._b, len(tensors)
        first = len(b.slot_chunk)
        b.tensors.extend(tensors)
        b.slot_chunk.extend([-1] * n)
        b.slot_entry.extend(range(b.expanded, b.expanded + n))
        b.expanded += n
        return range(first, first + n)

    def _add_pieces(self, copy: torch.Tensor, sizes: list[int], keep: list[int]) -> list[int]:
        """Pieces ``keep`` of ``copy.split(sizes)`` to digest (split by the worker: one operation)."""
        b = self._b
        b.tensors.append((copy, sizes, keep))
        first = len(b.slot_chunk)
        b.slot_chunk.extend([-1] * len(keep))
        b.slot_entry.extend(range(b.expanded, b.expanded + len(keep)))
        b.expanded += len(keep)
        return list(range(first, first + len(keep)))

    def _copy(self, t: torch.Tensor) -> int:
        """Copies ``t`` into the open chunk of its device (a new or reused chunk when it is full)."""
        nbytes = t.numel() * t.element_size()
        size = rows_of(nbytes) * ROW_BYTES
        self._staged_bytes += size
        if size > CHUNK_BYTES or t.layout != torch.strided:
            return self._add_tensor(plain(t))
        device, b = t.device, self._b
        chunk, used = self._open.get(device, (-1, CHUNK_BYTES))
        if used + size > CHUNK_BYTES:
            if device.type == "meta":  # no bytes to pack (a chunk there would hold none either)
                return self._add_tensor(plain(t))
            free = self._free.get(device)
            buf = free.pop() if free else torch.empty(CHUNK_BYTES, dtype=torch.uint8, device=device)
            b.packs.append(Packed(buf, []))
            chunk, used = len(b.packs) - 1, 0
        pack = b.packs[chunk]
        if nbytes:
            try:
                pack_into(pack.buf, used, t.detach())
            except (RuntimeError, NotImplementedError):  # quantized or nested: bytes PyTorch will not copy
                self._open[device] = (chunk, used)
                return self._add_tensor(plain(t))
        pack.nbytes.append(nbytes)
        self._open[device] = (chunk, used + size)
        b.slot_chunk.append(chunk)
        b.slot_entry.append(len(pack.nbytes) - 1)
        return len(b.slot_chunk) - 1

    def _remember(self, t: torch.Tensor, ref: int, version: int | None = None, also_next: bool = False) -> None:
        try:
            self._cache[id(t)] = (weakref.ref(t), t._version if version is None else version, ref, also_next)
        except TypeError:  # a tensor subclass without weakref support: no caching
            pass
        except RuntimeError:  # an inference tensor: no version counter, no caching
            pass

    def _occurrence(self, phase: str, scope: str, op: str) -> int:
        key = (self._mb, phase, scope, op)
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        return n

    def _append(self, phase: str, scope: str, op: str, occurrence: int, inputs: Iterable[int],
                outputs: list[int]) -> None:
        b = self._b
        b.step.append(self._step)
        b.mb.append(self._mb)
        b.phase.append(phase)
        b.scope.append(scope)
        b.op.append(op)
        b.occ.append(occurrence)
        b.ins.extend(inputs)
        b.in_end.append(len(b.ins))
        b.outs.extend(outputs)
        b.out_end.append(len(b.outs))
        self._seq += 1
        if self._staged_bytes > FLUSH_BYTES:
            self.flush()

    def record(self, op: str, outputs: Iterable[torch.Tensor], inputs: Iterable[torch.Tensor] = (),
               scope: str = "", phase: str = "step", copy: bool | str = True) -> None:
        """Records one named event with its tensors (used by the step level and by user code).

        ``copy=False`` digests the live tensors instead of copies: only for tensors that stay unchanged
        until the next ``grads()`` call (see ``state``). ``copy="checked"`` digests the live tensors and
        raises at the next ``grads()``, ``flush()`` or ``close()`` if one was changed in place before.
        """
        if not self.active:
            return
        self._drain()
        occurrence = self._occurrence(phase, scope, op)
        self._append(phase, scope, op, occurrence, [self._stage(t, copy=copy) for t in inputs],
                     [self._stage(t, copy=copy) for t in outputs])

    def flush(self) -> None:
        """Hands everything staged to the digest worker, which digests it (batched) and appends the
        records to the stream while training goes on. At most one batch is in flight: this waits for
        the previous one first, so the staging memory stays bounded."""
        self._drain()
        if self._buckets:
            self._record_buckets()
        self._wait()
        batch, self._b = self._b, _Batch(self._seq)
        self._open.clear()
        self._cache.clear()
        self._memo.clear()
        self._staged_bytes = 0
        if not batch.step:
            self._free_chunks(batch.packs)
            return
        if self._worker is None:
            # Staged copies are never written again, and digests are exact integer arithmetic, so a worker
            # can digest them while the training thread runs the next step.
            self._worker = self._start_worker()
        if not self._writing:  # a new segment: a resumed run never overwrites the earlier stream
            path = stream_path(self._run_dir, self.rank, len(stream_segments(self._run_dir, self.rank)))
            self._worker.open(path, self._meta)
            self._writing = True
        self._inflight = batch
        # On a GPU, the worker's kernels run on its own thread's current stream: they start after
        # everything the training thread has queued so far (the copies, the values recorded) is done.
        events = []
        devices = {x.buf.device for x in batch.packs} | {_device(t) for t in batch.tensors} \
            if torch.cuda.is_initialized() else ()  # without CUDA started, no tensor is on a GPU (0.07 ms/step)
        for device in devices:
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                events.append((device, event))
        self._worker.submit(batch, events)

    def _start_worker(self) -> ThreadWorker | ProcessWorker:
        if self.worker == "process":
            try:
                return ProcessWorker()
            except OSError as e:
                if self._requested_worker == "process":
                    raise RuntimeError(f"trace.worker=process: {e}") from None
                warnings.warn(f"samestep.trace: {e}; digesting on a thread instead", RuntimeWarning, stacklevel=3)
                self.worker = "thread"
        return ThreadWorker()

    def _wait(self) -> None:
        batch, self._inflight = self._inflight, None
        if batch is not None:
            try:
                # Re-raises a failure of the worker here, in the training thread. The batch is written only
                # if no tensor digested without a copy was changed in place before its digest was done.
                self._worker.wait()
                changed = batch.changed()
                self._worker.commit(not changed)
            finally:
                self._free_chunks(batch.packs)
            self._refuse(batch, changed)

    @staticmethod
    def _refuse(batch: _Batch, changed: list[int]) -> None:
        """Raises for the first tensor digested without a copy that was changed in place before its digest
        was done.

        The check runs on the training thread after the worker has finished, so whether it raises depends
        only on what the training code did before this point, never on the worker's timing.
        """
        if changed:
            k = changed[0]
            live, version, i = batch.check_live[k], batch.check_version[k], batch.check_record[k]
            step, mb, phase, scope, op, occurrence = (batch.step[i], batch.mb[i], batch.phase[i], batch.scope[i],
                                                      batch.op[i], batch.occ[i])
            fix = ("call rec.grads() where the gradients are final (after clipping, or clip out of place), or "
                   "rec.grads(..., copy=True)"
                   if phase == "step" and op == "grad" else
                   "record copies instead (trace.copy=true, or samestep.trace(..., copy=True))")
            raise RuntimeError(
                f"trace: the tensor of record step={step} microbatch={mb} phase={phase} scope={scope!r} "
                f"op={op!r} occurrence={occurrence} was changed in place after it was recorded (version "
                f"{version} -> {live._version}), so its digest may not be of the recorded value; {fix}")

    def _free_chunks(self, packs: list[Packed]) -> None:
        """Chunks whose digests are done: reused by the next copies."""
        for pack in packs:
            self._free.setdefault(pack.buf.device, []).append(pack.buf)

    # -- the protocol ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Everything inside belongs to optimizer step ``step`` (1-based); flushed at the end."""
        self._drain()
        self._step, self._mb = step, -1
        self._counts.clear()
        self._comm_calls = 0
        # DTensor if torch.distributed.tensor was imported (else no DTensor exists): see _shards
        self._dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        try:
            yield
        finally:
            if self.active:
                self.flush()

    @contextlib.contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        """Everything inside belongs to global microbatch ``index``; at op level, ATen ops are recorded."""
        self._drain()
        self._mb, self._bwd_scope = index, ""
        token = _scope.set("")
        mode = _OpMode(self) if self._at("op") else None
        try:
            if mode is not None:
                with mode:
                    yield
            else:
                yield
        finally:
            self._drain()
            self._tokens.clear()  # a forward that raised leaves its pre hook's scope behind
            _scope.reset(token)
            self._mb = -1

    def attach(self, model: torch.nn.Module) -> None:
        """Module hooks: scopes for the op level, forward outputs and backward gradients for the module level.

        A ``torch.compile``'d module (an ``OptimizedModule``) is the module it wraps: its scopes are the
        uncompiled model's (no ``_orig_mod``), and the wrapper itself gets no hooks (it would record the
        root twice). The hooks run eagerly where compiled code calls them (see ``_outside_compile``)."""
        if not self.enabled or self._rank_level < LEVELS.index("module"):
            return
        # Code torch.compile compiled before would not call hooks added now (Dynamo skips guards on module
        # hooks by default): its caches are dropped, so the model is compiled anew, with the hooks.
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        for path, module in model.named_modules():
            if _is_compiled_wrapper(module):
                continue
            if _COMPILED in path:
                path = ".".join(part for part in path.split(".") if part != _COMPILED)
            if self._rank_level >= LEVELS.index("op"):
                self._hooks.append(module.register_forward_pre_hook(_outside_compile(self._pre_hook(path))))
                self._hooks.append(module.register_forward_hook(_outside_compile(self._post_hook(path))))
            else:  # module level: no scopes to follow (only ops use them), so fewer hooks
                self._hooks.append(module.register_forward_hook(_outside_compile(self._module_hook(path))))

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _pre_hook(self, path: str):
        tokens = self._tokens

        def hook(module, args):
            tokens.append(_scope.set(path))
        return hook

    def _post_hook(self, path: str):
        parent = path.rpartition(".")[0]

        # Op level: module records are op outputs already staged (copies), so a later in-place op can
        # change the tensor without harm: copy=True, never the checked form.
        def enter_backward(grad: torch.Tensor, innermost: bool) -> None:
            if self._modules_on:
                self.record("grad_output", [grad], scope=path, phase="backward")
            if innermost:
                self._bwd_scope = path

        def leave_backward(grad: torch.Tensor) -> None:
            self._bwd_scope = parent

        def enter_inner(grad: torch.Tensor) -> None:
            enter_backward(grad, True)

        def enter_outer(grad: torch.Tensor) -> None:
            enter_backward(grad, False)

        tokens = self._tokens

        def hook(module, args, output):
            if tokens:
                _scope.reset(tokens.pop())
            if not self._modules_on:
                return
            outs = _leaves(output)
            self.record("output", outs, scope=path, phase="forward")
            if not torch.is_grad_enabled():
                return
            for t in outs:
                if t.requires_grad:
                    # Hooks on one tensor fire in registration order, innermost module first; only the
                    # innermost producer sets the backward scope.
                    if hasattr(t, "_samestep_producer"):
                        _grad_hook(t, enter_outer)
                    else:
                        t._samestep_producer = path
                        _grad_hook(t, enter_inner)
            for t in _leaves(args):
                # An input made by another module gets that module's scope on entry; only inputs made
                # by plain ops in the parent need the scope handed back to the parent.
                if t.requires_grad and not hasattr(t, "_samestep_producer"):
                    _grad_hook(t, leave_backward)
        return hook

    def _module_record(self, op: str, phase: str, scope: str, outs: list[torch.Tensor]) -> None:
        """A module's output or incoming gradient at module level, copied now (trace.copy=true)."""
        occurrence = self._occurrence(phase, scope, op)
        self._append(phase, scope, op, occurrence, (), [self._stage(t) for t in outs])

    def _drain(self) -> None:
        """Makes the records the module hooks noted, in the order noted. Called before any other record
        is made and when the microbatch or step changes, so the stream is the one immediate records
        would give; a tensor changed in place since it was noted is caught by its noted version.

        One loop over hundreds of records per step: ``record`` with its arguments bound (the occurrence
        count inline, the staging at the noted versions), about 1 us less per record."""
        if not self._pending:
            return
        noted = list(self._pending)
        self._pending.clear()  # (a flush inside _append drains again: nothing left)
        self._pending_bytes = 0
        counts, mb = self._counts, self._mb
        for op, phase, scope, outs, versions in noted:
            key = (mb, phase, scope, op)
            occurrence = counts.get(key, 0)
            counts[key] = occurrence + 1
            refs = []
            for t, version in zip(outs, versions):
                ref = self._cached(t, version)
                refs.append(self._reference(t, self._checked_slot(t, version), version) if ref is None else ref)
            self._append(phase, scope, op, occurrence, (), refs)

    def _note(self, op: str, phase: str, scope: str, outs: list[torch.Tensor]) -> None:
        """Notes a module record for ``_drain``, with the tensors' versions now; drains once the notes
        keep ``PENDING_BYTES`` alive."""
        if self._dtensor is not None:
            outs = self._shards(outs)
        try:
            versions = [t._version for t in outs]
            nbytes = sum(t.nbytes for t in outs)
        except RuntimeError:  # an inference tensor cannot be checked unchanged later, a sparse one has no
            self._drain()  # nbytes: recorded now, copied
            self._module_record(op, phase, scope, outs)
            return
        self._pending.append((op, phase, scope, outs, versions))
        self._pending_bytes += nbytes
        if self._pending_bytes > PENDING_BYTES:
            self._drain()

    def _module_hook(self, path: str):
        """Module level only: records the output, and the gradient arriving at it in backward.

        With checked live tensors (the default) a hook only notes the tensors and their versions;
        ``_drain`` makes the records later in one loop. Made inside the hooks, between the model's own
        operations, each record cost about twice as much (measured: 7-8 us against 3-4 us).
        """
        # copies (trace.copy=true) must be taken now, before the tensor can change
        record = self._note if self._module_copy == "checked" else self._module_record

        def grad_output(grad: torch.Tensor) -> None:
            if self._modules_on:
                record("grad_output", "backward", path, [grad])

        def hook(module, args, output):
            if not self._modules_on:
                return
            outs = _leaves(output)
            record("output", "forward", path, outs)
            if torch.is_grad_enabled():
                for t in outs:
                    if t.requires_grad:
                        _grad_hook(t, grad_output)
        return hook

    # -- step level ------------------------------------------------------------------------------------
    def metric(self, name: str, value: float | torch.Tensor) -> None:
        """A scalar of the step (loss, grad norm), recorded as its exact bits."""
        t = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)
        self.record(name, [t])

    def grads(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], copy: bool | str = True) -> None:
        """Every parameter's gradient after the cross-process reduction (call it before the update).

        It first waits for the previous step's digests, which read the parameters and optimizer state
        that ``state`` recorded without copying: the update that follows may change them.
        ``copy="checked"`` digests the gradients where they lie instead of a copy, and raises at the next
        ``grads()``, ``flush()`` or ``close()`` if one was changed in place before: for a loop that changes
        them no more (it clips out of place, or is called after clipping) and gives the next step new ones
        (``zero_grad(set_to_none=True)``). The reference loop does so at step level, where it spares
        copying them (0.9 against 1.08 ms per step in the recorder), but not at module level, where its
        steps measured up to 4 points slower with them (see ``loop.py``).
        """
        if copy not in (True, "checked"):
            raise ValueError(f"grads(copy={copy!r}): use True (copies) or 'checked' (the gradients themselves)")
        self._wait()
        if not self.active:
            return
        if self._buckets:
            self._record_buckets()
        named = [(name, p.grad) for name, p in named_params if p.grad is not None]
        if self._dtensor is not None:
            named = list(zip([name for name, _ in named], self._shards([g for _, g in named])))
        checked = copy == "checked"
        if checked:
            self._drain()  # pending module records first: the grad records' indices below follow them
            position = {id(g): i for i, (_, g) in enumerate(named)}
        # Gradients that are contiguous pieces of one buffer (as a gradient reducer leaves them) are
        # staged with one copy of the buffer (or the buffer itself, checked), each digested as its piece.
        groups: dict[tuple, list[tuple[int, int, torch.Tensor]]] = {}
        for _, g in named:
            if g.layout == torch.strided and g.is_contiguous():
                groups.setdefault((g.untyped_storage().data_ptr(), g.dtype, g.device), []).append(
                    (g.storage_offset(), g.numel(), g))
        slot: dict[int, int] = {}
        for group in groups.values():
            group.sort(key=_first)
            split = _pieces(group) if len(group) > 1 else None
            if split is None:
                continue  # copied one by one
            sizes, keep, lo, hi = split
            flat = group[0][2].detach().as_strided((hi - lo,), (1,), lo)
            # The buffer itself, checked unchanged for the first of its records: _checked_slot's bookkeeping,
            # without its slot (the pieces below are the slots); not shared, since _checked_slot runs per
            # module output and a call more there costs every module-level step.
            if checked:
                b = self._b
                b.check_live.append(flat)
                b.check_version.append(flat._version)
                b.check_record.append(len(b.step) + position[id(group[0][2])])
            else:
                flat = self._grad_copy(flat)
            self._staged_bytes += flat.numel() * flat.element_size()
            for (_, _, g), k in zip(group, self._add_pieces(flat, sizes, keep)):
                slot[id(g)] = k
        self._record_many(["grad"] * len(named), [name for name, _ in named], [g for _, g in named], slot,
                          checked=checked)

    def _grad_copy(self, flat: torch.Tensor) -> torch.Tensor:
        """A copy of a gradient buffer, in a buffer reused from step to step: the batch that read the
        last one is digested (``grads`` waits for it first), unless the current batch still holds it.
        (A fresh multi-MB copy per step measured about 3% slower at module level here: paired, 3 x 12.)"""
        key = (flat.dtype, flat.device)
        buf, owner = self._grad_bufs.get(key, (None, None))
        if buf is None or buf.numel() < flat.numel() or owner is self._b:
            buf = torch.empty(flat.numel(), dtype=flat.dtype, device=flat.device)
        self._grad_bufs[key] = (buf, self._b)
        return buf[: flat.numel()].copy_(flat)

    def state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
              named_params: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
              named_buffers: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """Parameters, buffers and optimizer state after the update.

        Parameters and optimizer state are digested in place, without a copy, so they must not change
        before the next ``grads()`` call (a training loop changes them only in its next update, which
        comes after). Buffers (running statistics, say) are copied: the next forward may change them.
        Only persistent buffers are model state (those in ``state_dict``, which a checkpoint keeps); a
        non-persistent one (an attention mask) is a constant or derived from the state.
        ``named_params``, ``named_buffers``: ``model.named_parameters()`` and
        ``Recorder.persistent_buffers(model)`` as the caller already has them (lists kept from step to
        step spare walking the modules).
        """
        if not self.active:
            return
        named = list(model.named_parameters() if named_params is None else named_params)
        names = [name for name, _ in named]
        # What identifies the state (see _StatePlan): the parameters; each parameter with optimizer state,
        # its number of entries (tensors or not), and its tensors and their keys.
        objs: list[torch.Tensor] = [p for _, p in named]
        lens: list[int] = []
        keys: list[str] = []
        if optimizer is not None:
            held = optimizer.state.values()
            lens = list(map(len, held))
            keys = [k for st in held for k, v in st.items() if isinstance(v, torch.Tensor)]
            objs += optimizer.state.keys()
            objs += [v for st in held for v in st.values() if isinstance(v, torch.Tensor)]
        plan = self._state_plan
        if plan is not None and plan.matches(names, objs, lens, keys, self._mb):
            tensors = [objs[i] for i in plan.order]
            if self._dtensor is not None:
                tensors = self._shards(tensors)
            if _layout(tensors) != plan.layout:
                plan = None
        else:
            plan = None
        if plan is None:
            plan, tensors = self._plan_state(named, optimizer, names, objs, lens, keys)
        self._record_many(plan.ops, plan.scopes, tensors, None, plan=plan)
        buffers = self.persistent_buffers(model) if named_buffers is None else list(named_buffers)
        if buffers:
            self._record_many(["buffer"] * len(buffers), [name for name, _ in buffers], [b for _, b in buffers], {})

    def _plan_state(self, named: list[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer | None,
                    names: list[str], objs: list[torch.Tensor], lens: list[int],
                    keys: list[str]) -> tuple[_StatePlan, list[torch.Tensor]]:
        """What ``state`` records (parameters, then each parameter's optimizer state by sorted key), as a
        new plan (kept for the next steps, unless a tensor's layout cannot be read), and the tensors."""
        order = list(range(len(named)))
        scopes = list(names)
        ops = ["param"] * len(named)
        if optimizer is not None:
            where = {id(t): i for i, t in enumerate(objs)}
            scope_of = {id(p): name for name, p in named}
            for p, st in optimizer.state.items():
                scope = scope_of.get(id(p), "?")
                for key in sorted(st):
                    value = st[key]
                    if isinstance(value, torch.Tensor):
                        ops.append(f"optim.{key}")
                        scopes.append(scope)
                        order.append(where[id(value)])
        tensors = [objs[i] for i in order]
        if self._dtensor is not None:
            tensors = self._shards(tensors)
        heads = [self._head(t) for t in tensors]
        descs = describe_all(tensors) if isinstance(self._worker, ProcessWorker) else None
        plan = _StatePlan(names, objs, lens, keys, self._mb, order, tensors, ops, scopes, heads, descs)
        self._state_plan = plan if plan.layout is not None else None
        return plan, tensors

    @staticmethod
    def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """The model's buffers that are part of its ``state_dict``, by name, each tensor once."""
        out, seen = [], set()
        for prefix, module in model.named_modules():
            for name, b in module._buffers.items():
                if b is not None and name not in module._non_persistent_buffers_set and id(b) not in seen:
                    seen.add(id(b))
                    out.append((f"{prefix}.{name}" if prefix else name, b))
        return out

    def _shards(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """DTensors (FSDP2's sharded parameters, their gradients and optimizer state; tensor parallel) as
        this rank's local shard, which its stream records (under the shard's own shape); other tensors
        as they are. The shard is the DTensor's storage: digested where it lies, checked or copied as
        the DTensor would be. Called where ``self._dtensor`` is set (at ``step()``)."""
        dtensor = self._dtensor
        return [t._local_tensor if isinstance(t, dtensor) else t for t in tensors]

    def _record_many(self, ops: list[str], scopes: list[str], tensors: list[torch.Tensor],
                     slots: dict[int, int] | None, checked: bool = False, plan: _StatePlan | None = None) -> None:
        """Step records (op, scope, tensor), one output each, without the per-tensor cache: with ``slots``
        None every tensor is digested live (no copy); else a tensor whose id maps to a slot uses it, any
        other is copied (``checked``: digested live and checked unchanged, if it is dense). A ``plan``
        (``state``'s) gives the records' keys, headers and descriptions as they were last step.

        The columns grow by whole lists (a few list operations, not a dozen per record)."""
        self._drain()
        b, n = self._b, len(tensors)
        # a plan's are made once: updating from a dict reuses its keys' hashes, and isdisjoint walks the smaller
        counts = _step_counts(self._mb, ops, scopes) if plan is None else plan.counts
        if len(counts) == n and self._counts.keys().isdisjoint(counts.keys()):  # as usual: each once per step
            occurrences = [0] * n
            self._counts.update(counts)
        else:
            occurrences = [self._occurrence("step", scope, op) for op, scope in zip(ops, scopes)]
        if slots is None:
            if plan is not None and plan.descs is not None:
                b.described[len(b.tensors)] = plan.descs
            refs: Iterable[int] = self._add_tensors(tensors)
        elif not checked:
            refs = [slots[id(t)] if id(t) in slots else self._copy(t) for t in tensors]
        else:  # the others live too, each checked for its own record (a dense one: see _copy for the rest)
            refs = [slots[id(t)] if id(t) in slots else self._checked_slot(t, t._version, len(b.step) + i)
                    if t.layout == torch.strided else self._copy(t) for i, t in enumerate(tensors)]
        first = len(b.ref_slot)
        b.ref_slot.extend(refs)
        if plan is None:
            heads = self._heads
            b.ref_head.extend([heads.get((t.dtype, t.shape)) or self._head(t) for t in tensors])
        else:
            b.ref_head.extend(plan.heads)
        b.step.extend([self._step] * n)
        b.mb.extend([self._mb] * n)
        b.phase.extend(["step"] * n)
        b.scope.extend(scopes)
        b.op.extend(ops)
        b.occ.extend(occurrences)
        b.in_end.extend([len(b.ins)] * n)
        b.out_end.extend(range(len(b.outs) + 1, len(b.outs) + n + 1))
        b.outs.extend(range(first, first + n))
        self._seq += n
        if self._staged_bytes > FLUSH_BYTES:
            self.flush()

    def collective(self, name: str, inp: torch.Tensor, out: torch.Tensor) -> None:
        """A collective's input and output (the canonical combine calls this as its observer)."""
        self.record(name, [out], [inp], scope="collective")

    def ddp_comm_hook(self, inner: Callable | None = None) -> Callable:
        """A communication hook for ``torch.nn.parallel.DistributedDataParallel`` that records each
        gradient bucket's reduction as a step-level collective record (scope ``collective``, op
        ``ddp.allreduce``, or ``ddp.<inner's name>``)::

            ddp.register_comm_hook(None, rec.ddp_comm_hook())

        ``inner`` does the reduction (default: DDP's own ``allreduce_hook``, so the gradients are the
        ones DDP computes without a hook) and gets the state given to ``register_comm_hook``. On a traced
        step the bucket is copied before ``inner`` runs and its reduced buffer is taken when the
        reduction completes; both are recorded at the next ``grads()`` (or the step's end) in bucket
        order, so the order in which buckets finish never reaches the stream. Untraced steps only call
        ``inner``.
        """
        if inner is None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook as inner
            name = "ddp.allreduce"
        else:
            name = f"ddp.{getattr(inner, '__name__', type(inner).__name__)}"

        # No annotations on bucket and return: DDP refuses any but dist.GradBucket and Future[Tensor] as
        # objects, and this module's annotations are strings
        def hook(state, bucket):  # noqa: ANN001, ANN202
            if not self.active:
                return inner(state, bucket)
            with _disable_current_modes():  # at op level: our copy is not one of the model's ops
                index, before = bucket.index(), bucket.buffer().detach().clone()

            def done(fut: Any) -> torch.Tensor:
                out = fut.value()
                out = out[0] if isinstance(out, (list, tuple)) else out
                self._reduced(index, name, before, out)
                return out

            return inner(state, bucket).then(done)

        return hook

    def fsdp_reduce_scatter(self) -> _FsdpReduceScatter:
        """A gradient reduce-scatter for FSDP2 (``fully_shard``) that records each call as a step-level
        collective record (scope ``collective``, op ``fsdp.reduce_scatter``): its input (this rank's
        unsharded gradients, copied before) and its output (this rank's reduced shard, copied when it is
        done), recorded at the next ``grads()`` (or the step's end) in call order::

            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_custom_reduce_scatter(rec.fsdp_reduce_scatter())

        It reduces as FSDP2's default does (``torch.distributed.reduce_scatter_single`` into a new buffer),
        so the gradients are the same bits as without it; untraced steps only reduce. With it, a rank whose
        gradients differ only because another rank's did is a receiver in ``samestep diff``, not an origin.
        """
        return _FsdpReduceScatter(self)

    def _reduced(self, index: int, name: str, before: torch.Tensor, out: torch.Tensor) -> None:
        """A reduction seen by ``ddp_comm_hook`` or ``fsdp_reduce_scatter``, for ``_record_buckets``; a
        communication thread may complete it."""
        with self._buckets_lock:
            self._buckets.append((index, name, before, out))

    def _record_buckets(self) -> None:
        """The reductions ``_reduced`` saw since the last call, as records in their order (bucket, or
        call), never in the order they finished."""
        with self._buckets_lock:
            done, self._buckets = sorted(self._buckets, key=_first), []
        for _, name, before, out in done:
            self.record(name, [out], [before], scope="collective")

    def close(self) -> None:
        """Flushes and closes the stream; removes hooks. A closed recorder records nothing (a DDP hook
        of its own only reduces)."""
        self.detach()
        try:
            if self.enabled:
                self.flush()
            self._wait()
        finally:
            self.enabled = False
            self._inflight = None
            worker, self._worker = self._worker, None
            self._free.clear()
            self._writing = False
            if worker is not None:
                worker.close()


class _FsdpReduceScatter:
    """FSDP2's ``ReduceScatter`` comm interface (``allocate`` and the call), recording (see
    ``Recorder.fsdp_reduce_scatter``)."""

    def __init__(self, rec: Recorder) -> None:
        self._rec = rec

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        import torch.distributed as dist

        rec = self._rec
        if not rec.active:
            return dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op,
                                              async_op=async_op)
        index, rec._comm_calls = rec._comm_calls, rec._comm_calls + 1
        with _disable_current_modes():  # at op level: our copies are not the model's ops
            before = input_tensor.detach().clone()

        def done(_: Any = None) -> None:
            with _disable_current_modes():  # a copy: FSDP2 divides the output in place afterwards
                rec._reduced(index, "fsdp.reduce_scatter", before, output_tensor.detach().clone())

        work = dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op,
                                          async_op=async_op)
        if work is None:
            done()
        else:
            work.get_future().then(done)
        return work


def trace(run_dir: str | Path, *, level: str = "op", steps: set[int] | str | None = None,
          ranks: set[int] | str | None = None, rank: int | None = None, perturb: Perturb | None = None,
          copy: bool = False, worker: str = "auto") -> Recorder:
    """Starts recording this rank's trace stream into ``run_dir/trace``. Rank 0 also writes
    ``run_dir/run.json`` if there is none, so that ``samestep diff`` and ``samestep trace certify`` read a
    run of your own loop as they read ``samestep train``'s: call ``samestep.enable()`` first, to have
    deterministic mode recorded there.

    Args:
        run_dir: the run directory.
        level: ``"step"``, ``"module"`` or ``"op"`` (each includes the ones before), or ``"off"``.
        steps: the 1-based steps to record (a set, or text like ``"1-5"``); ``None`` records all.
        ranks: the ranks that record; ``None`` is all.
        rank: this process's rank (default: torch.distributed's, else 0).
        perturb: fault injection for validating ``samestep diff`` (see ``Perturb``).
        copy: module level: digest copies of module outputs and gradients instead of the tensors
            themselves (which are checked unchanged until digested; a change in place raises).
        worker: where digests are computed: ``"process"`` (a child process that reads this process's
            memory; CPU tensors only), ``"thread"`` (any device), or ``"auto"`` (process on Linux
            without CUDA, else thread). Both write the same stream.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if distributed else 0
    if isinstance(steps, str):
        steps = parse_selection(steps, "steps")
    if isinstance(ranks, str):
        ranks = parse_selection(ranks, "ranks")
    rec = Recorder(run_dir, level=level, steps=steps, ranks=ranks, rank=rank, perturb=perturb, copy=copy,
                   worker=worker)
    if rank == 0 and level != "off":
        _describe_run(Path(run_dir), level, steps, ranks, dist.get_world_size() if distributed else 1)
    return rec


def _describe_run(run_dir: Path, level: str, steps: set[int] | None, ranks: set[int] | None, world: int) -> None:
    """Gives a run directory that a user's own loop traces the ``run.json`` that ``samestep diff`` and
    ``samestep trace certify`` read (docs/formats.md): the trace selection as its config, the environment
    fingerprint, the world size, and the report of the ``samestep.enable()`` in force (null if none). A
    run.json already there (``samestep train`` writes its own first) is left as it is."""
    from samestep import __version__  # the package imports this module: only once it is there

    path = run_dir / "run.json"
    if path.exists():
        return
    report = active_report()
    selection = {"level": level, "steps": "all" if steps is None else format_selection(steps),
                 "ranks": "all" if ranks is None else format_selection(ranks)}
    doc = {"format": RUN_FORMAT, "version": RUN_VERSION, "samestep_version": __version__,
           "written_by": "samestep.trace", "config": {"trace": selection}, "environment": environment(),
           "layout": {"world_size": world}, "determinism": report.to_dict() if report is not None else None,
           "resumes": []}
    run_dir.mkdir(parents=True, exist_ok=True)
    replace_atomic(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())

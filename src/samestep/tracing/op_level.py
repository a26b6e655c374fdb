"""The op level: every ATen op's input and output digests (a TorchDispatchMode), scoped by module.

The scope of a forward op is the innermost module running (pre and post forward hooks); the scope
follows the op into backward through hooks on module outputs (``Scopes``). Each op's inputs are staged
before it runs and its outputs after; a view of an input version already staged, or an output that
holds an input's bytes in the same order, is digested once (``same_bytes``).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from samestep.tracing.batch import NO_REF, Batch
from samestep.tracing.hooks import grad_hook, leaves
from samestep.tracing.perturb import Perturb
from samestep.tracing.staging import RecorderView, Staging

__all__ = ["OpMode", "Scopes", "same_bytes"]

SCOPE: contextvars.ContextVar[str] = contextvars.ContextVar("samestep_scope", default="")
# Ops whose output is uninitialised memory: digesting it would report noise as divergence.
EMPTY_OPS = {
    "aten.empty.memory_format",
    "aten.empty_like.default",
    "aten.empty_strided.default",
    "aten.new_empty.default",
    "aten.new_empty_strided.default",
    "aten.empty.out",
}
# Ops that point their first argument at a storage object, not a tensor: nothing staged says what that memory
# holds (a DataLoader's collate gets a new one of uninitialised bytes this way, then fills it with out=).
STORAGE_SET_OPS = {"aten.set_.source_Storage", "aten.set_.source_Storage_storage_offset"}
# Ops whose first argument is overwritten whole, whatever it held.
OVERWRITE_OPS = {
    "aten.copy_.default",
    "aten.fill_.Scalar",
    "aten.fill_.Tensor",
    "aten.zero_.default",
    "aten.normal_.default",
    "aten.uniform_.default",
    "aten.bernoulli_.float",
    "aten.random_.default",
    "aten.random_.from",
    "aten.random_.to",
    "aten.exponential_.default",
    "aten.geometric_.default",
    "aten.log_normal_.default",
    "aten.cauchy_.default",
}
# Ops whose output holds its first input's elements in the same logical (row-major) order.
SAME_ORDER = {
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.reshape.default",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.squeeze.default",
    "aten.squeeze.dims",
    "aten.flatten.using_ints",
    "aten.alias.default",
    "aten.detach.default",
    "aten.clone.default",
    "aten.lift_fresh.default",
    "aten.view_as.default",
    "aten.reshape_as.default",
}


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors among op arguments or results (ATen nests them at most one list deep)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


@dataclass(frozen=True, slots=True)
class _OpKind:
    """What the op recorder needs to know of an op's schema, found once per op."""

    name: str
    mutates: bool  # writes into an argument (in place, or out=)
    written: tuple[bool, ...]  # per positional argument: written into
    written_only: frozenset[str]  # keyword arguments only written (out=): their old bytes are no input
    first_written_only: bool  # an OVERWRITE_OPS op: nor are its first argument's
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
        return cls(
            name, any(writes), positional, frozenset(out_kwargs), name in OVERWRITE_OPS, name.startswith("c10d.")
        )


_kinds: dict[Any, _OpKind] = {}


def same_bytes(
    t: torch.Tensor, inputs: list[torch.Tensor], refs: list[int], batch: Batch, name: str = ""
) -> int | None:
    """The staged copy of an input whose bytes are ``t``'s bytes in the same order (a reshape, detach,
    clone; or any output laid out exactly like a contiguous input): ``t`` needs no copy and no digest
    of its own, only its own header. None if there is none."""
    if name in SAME_ORDER and inputs and refs[0] >= 0 and inputs[0].dtype == t.dtype and inputs[0].numel() == t.numel():
        return batch.ref_slot[refs[0]]
    try:
        if not t.is_contiguous():
            return None
        for x, ref in zip(inputs, refs):
            if (
                ref >= 0
                and x.dtype == t.dtype
                and x.numel() == t.numel()
                and x.data_ptr() == t.data_ptr()
                and x.is_contiguous()
                and not x.is_inference()
                and x._version == t._version
            ):
                return batch.ref_slot[ref]
    except RuntimeError:  # sparse or nested: no strides or no data pointer (staged through plain)
        pass
    return None


class Scopes:
    """The module an op runs in: forward, the innermost module whose forward is running; backward, the
    innermost module whose output's gradient arrived last. At op level the hooks that follow them also
    record each module's output and the gradient arriving at it (copies: a later in-place op may change
    the tensor without harm, so never the checked form)."""

    def __init__(self, rec: RecorderView) -> None:
        self.rec = rec
        self.backward = ""
        self._tokens: list[contextvars.Token] = []  # forward scopes entered (pre hooks), innermost last

    def enter_microbatch(self) -> contextvars.Token:
        self.backward = ""
        return SCOPE.set("")

    def leave_microbatch(self, token: contextvars.Token) -> None:
        self._tokens.clear()  # a forward that raised leaves its pre hook's scope behind
        SCOPE.reset(token)

    def pre_hook(self, path: str) -> Callable:
        tokens = self._tokens

        def hook(module, args):
            tokens.append(SCOPE.set(path))

        return hook

    def post_hook(self, path: str) -> Callable:
        parent = path.rpartition(".")[0]
        rec, scopes = self.rec, self

        def enter_backward(grad: torch.Tensor, innermost: bool) -> None:
            if rec.modules_on:
                rec.record("grad_output", [grad], scope=path, phase="backward")
            if innermost:
                scopes.backward = path

        def leave_backward(grad: torch.Tensor) -> None:
            scopes.backward = parent

        def enter_inner(grad: torch.Tensor) -> None:
            enter_backward(grad, True)

        def enter_outer(grad: torch.Tensor) -> None:
            enter_backward(grad, False)

        tokens = self._tokens

        def hook(module, args, output):
            if tokens:
                SCOPE.reset(tokens.pop())
            if not rec.modules_on:
                return
            outs = leaves(output)
            rec.record("output", outs, scope=path, phase="forward")
            if not torch.is_grad_enabled():
                return
            for t in outs:
                if t.requires_grad:
                    # Hooks on one tensor fire in registration order, innermost module first; only the
                    # innermost producer sets the backward scope.
                    if hasattr(t, "_samestep_producer"):
                        grad_hook(t, enter_outer)
                    else:
                        t._samestep_producer = path
                        grad_hook(t, enter_inner)
            for t in leaves(args):
                # An input made by another module gets that module's scope on entry; only inputs made
                # by plain ops in the parent need the scope handed back to the parent.
                if t.requires_grad and not hasattr(t, "_samestep_producer"):
                    grad_hook(t, leave_backward)

        return hook


class OpMode(TorchDispatchMode):
    """Records every ATen op's inputs (before it runs) and outputs (after)."""

    def __init__(
        self,
        staging: Staging,
        scopes: Scopes,
        perturb: Perturb | None,
        rank: int,
        knobs: Callable[[int, Callable[[], str]], None] | None = None,
    ) -> None:
        super().__init__()
        self.staging, self.scopes, self.perturb, self.rank = staging, scopes, perturb, rank
        # called at each op, with how to name where it ran: a knob a forward flips and puts back is seen here
        self.knobs = knobs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        st = self.staging
        st.in_dispatch = True
        try:
            return self._record(st, func, args, kwargs)
        finally:
            st.in_dispatch = False

    def _record(self, st: Staging, func, args, kwargs):
        kind = _kinds.get(func)
        if kind is None:
            kind = _kinds[func] = _OpKind.of(func)
        stage = st.stage
        if kind.first_written_only or kind.written_only:  # bytes about to be overwritten (often uninitialised)
            in_tensors, inputs = [], []
            for i, a in enumerate(args):
                for t in _tensors((a,)):
                    in_tensors.append(t)
                    inputs.append(NO_REF if i == 0 and kind.first_written_only else stage(t))
            for k, v in kwargs.items():
                for t in _tensors((v,)):
                    in_tensors.append(t)
                    inputs.append(NO_REF if k in kind.written_only else stage(t))
        else:
            in_tensors = _tensors(args) + (_tensors(kwargs.values()) if kwargs else [])
            inputs = [stage(t) for t in in_tensors]
        out = func(*args, **kwargs)
        name = kind.name
        phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
        scope = self.scopes.backward if phase == "backward" else SCOPE.get()
        occurrence = st.occurrence(phase, scope, name)
        if self.knobs is not None:
            self.knobs(st.step, lambda: f"{name} in {scope or 'the top level'} ({phase})")
        outs = _tensors(out if isinstance(out, (list, tuple)) else (out,))
        if kind.mutates and not outs:  # returns nothing (the _foreach_*_ ops): what it wrote is its output
            outs = [t for a, w in zip(args, kind.written) if w for t in _tensors((a,))]
        if self.perturb is not None:
            self.perturb.apply((self.rank, st.step, st.mb, phase, scope, name, occurrence), outs)
        if name in EMPTY_OPS:
            refs = [stage(t, uninit=True) for t in outs]
        elif name in STORAGE_SET_OPS:  # counted uninitialised, as a view of it would be, at this version and the next
            for t in outs:
                st.remember(t, NO_REF, t._version, also_next=True)
            refs = [NO_REF] * len(outs)
        elif kind.collective:
            # It completes on another thread after it returns: its output bytes are not there yet (the
            # step level records the finished reduction; see collectives.py). It writes them below the
            # version counters, through its tensors and any view of them (DDP's bucket views): whatever
            # was staged before cannot be trusted to hold their bytes any more, so every later read
            # stages anew (but memory still uninitialised elsewhere stays so).
            refs = [NO_REF] * len(outs)
            st.forget(in_tensors + outs)  # any argument: c10d schemas do not all mark what they write
        elif kind.mutates:
            # Its version counter is bumped only after this mode returns: a look-up by version would find
            # the bytes from before the op
            refs = [stage(t, fresh=True) for t in outs]
        elif func.is_view and len(outs) == 1 and inputs and inputs[0] == NO_REF:
            refs = [stage(outs[0], uninit=True)]  # a view of uninitialised memory (a bucket being built)
        elif func.is_view and len(outs) == 1:
            # A view's bytes are a function of its input's bytes and the arguments: the same view of the
            # same input version (t(weight) in every microbatch, say) is digested once.
            key = (
                func,
                tuple(inputs),
                repr([a for a in args if not isinstance(a, torch.Tensor)]),
                repr(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))),
            )
            ref = st.memo.get(key)
            if ref is None:
                ref = st.memo[key] = stage(outs[0], share=same_bytes(outs[0], in_tensors, inputs, st.batch, name))
            else:
                st.remember(outs[0], ref)
            refs = [ref]
        else:
            refs = [stage(t, share=same_bytes(t, in_tensors, inputs, st.batch, name)) for t in outs]
        st.append(phase, scope, name, occurrence, inputs, refs)
        return out

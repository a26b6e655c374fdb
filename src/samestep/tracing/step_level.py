"""The step level: each parameter's gradient after the reduction, and the parameters, persistent buffers
and optimizer state after the update, one record each (scope: the parameter's or buffer's name).

Parameters and optimizer state are digested where they lie (a training loop changes them only in its
next update), by their state checksum: the step's pass that the receipts and the cross-rank check take
theirs from (``checksums.StepChecksums``), so none of them is hashed twice. Gradients are copied, or
with ``copy="checked"`` digested where they lie and checked unchanged. What ``state()`` records is kept
as a plan while the same tensors stay in place.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable

import torch

from samestep.hashing.state import persistent_buffers, tensor_header
from samestep.tracing.staging import RecorderView, Staging
from samestep.tracing.wire import describe_all

__all__ = ["GradPlan", "StatePlan", "StepRecords", "layout", "step_counts"]

_data_ptrs = torch.Tensor.data_ptr
_sizes = torch.Tensor.size
_strides = torch.Tensor.stride
_dtypes = operator.attrgetter("dtype")
_versions = operator.attrgetter("_version")
_contiguous = torch.Tensor.is_contiguous


class StatePlan:
    """What ``state()`` records, made once and used again while the parameters and the optimizer state are
    the same tensors: the same objects (parameters, then each parameter that has optimizer state, and its
    tensors under the same keys), each at the same address with the same dtype, shape and strides.

    A training loop updates them in place, so every step but the first skips sorting the optimizer state,
    making the records' ops and scopes and describing each tensor for the process worker (``descs``: each one's
    description and checksum header; None if a tensor is not one it reads where it lies). Checking the plan
    costs about what it spares in ``state`` itself; the descriptions it spares are the gain
    (``bench/bench_trace.py --levels step --recorder-calls`` measures the recorder's time per step). Any
    change (a new optimizer, a loaded state, ``p.data = ...``) makes a new plan. It holds weak references:
    no replaced optimizer's state is kept alive.
    """

    __slots__ = ("names", "refs", "lens", "keys", "mb", "order", "layout", "ops", "scopes", "heads", "counts", "descs")

    def __init__(
        self,
        names: list[str],
        objs: list[torch.Tensor],
        lens: list[int],
        keys: list[str],
        mb: int,
        order: list[int],
        tensors: list[torch.Tensor],
        ops: list[str],
        scopes: list[str],
        heads: list[bytes],
        descs: list[tuple] | None,
    ) -> None:
        self.names, self.lens, self.keys, self.mb, self.order = names, lens, keys, mb, order
        try:
            self.refs = [weakref.ref(t) for t in objs]
            self.layout: tuple[list, ...] | None = layout(tensors)
        except (TypeError, RuntimeError):  # no weak reference, or no address (sparse): not kept (see state)
            self.refs, self.layout = [], None
        self.ops, self.scopes, self.heads, self.descs = ops, scopes, heads, descs
        self.counts = step_counts(mb, ops, scopes)  # a dict keeps its keys' hashes: see StepRecords.record_many

    def matches(self, names: list[str], objs: list[torch.Tensor], lens: list[int], keys: list[str], mb: int) -> bool:
        """Whether the state walked now (as ``StepRecords.state`` lists it) is the one this plan was made for
        (the layouts aside: see ``layout``)."""
        return (
            mb == self.mb
            and lens == self.lens
            and keys == self.keys
            and names == self.names
            and len(objs) == len(self.refs)
            and all(map(operator.is_, objs, [r() for r in self.refs]))
        )


def step_counts(mb: int, ops: list[str], scopes: list[str]) -> dict[tuple, int]:
    """Step records' identities (``Staging.occurrence``'s keys), each counted once."""
    return dict.fromkeys([(mb, "step", scope, op) for op, scope in zip(ops, scopes)], 1)


class GradPlan:
    """What ``grads(copy="checked")`` records when every gradient is a tensor of its own (no piece of a
    shared buffer), made once and used again while the parameters' names, the gradients' dtypes and
    shapes and the microbatch stay the same: the records' ops, keys, headers and byte counts. Gradients
    are new tensors each step (``zero_grad(set_to_none=True)``), so only their addresses are read anew,
    and the process worker's descriptions are made from them in one pass instead of one call each."""

    __slots__ = ("names", "mb", "dtypes", "sizes", "ops", "heads", "counts", "nbytes", "total", "plain")

    def __init__(self, names: list[str], mb: int, grads: list[torch.Tensor], heads: list[bytes]) -> None:
        self.names, self.mb, self.heads = names, mb, heads
        self.dtypes, self.sizes = list(map(_dtypes, grads)), list(map(_sizes, grads))
        self.ops = ["grad"] * len(names)
        self.counts = step_counts(mb, self.ops, names)
        self.nbytes = [g.nbytes for g in grads]
        self.total = sum(self.nbytes)
        # described as (address, bytes) when contiguous: neither complex (a conjugate bit) nor quantized
        self.plain = all(g.is_cpu and not (g.dtype.is_complex or g.is_quantized) for g in grads)

    def matches(self, names: list[str], mb: int, grads: list[torch.Tensor]) -> bool:
        return (
            mb == self.mb
            and names == self.names
            and list(map(_dtypes, grads)) == self.dtypes
            and list(map(_sizes, grads)) == self.sizes
        )


def layout(tensors: list[torch.Tensor]) -> tuple[list, ...]:
    """Where and how each tensor lies: address, dtype, shape, strides (what a plan's descriptions and
    headers were made from)."""
    return (
        list(map(_data_ptrs, tensors)),
        list(map(_dtypes, tensors)),
        list(map(_sizes, tensors)),
        list(map(_strides, tensors)),
    )


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


class StepRecords:
    """Makes the step level's records of gradients and state (the recorder drains pending module records
    and records finished collectives before it calls these)."""

    def __init__(self, rec: RecorderView, staging: Staging) -> None:
        self.rec, self.staging = rec, staging
        self.plan: StatePlan | None = None
        self.grad_plan: GradPlan | None = None
        self._grad_bufs: dict[tuple, tuple[torch.Tensor, object]] = {}  # (dtype, device) -> (buffer, its batch)

    def grads(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], copy: bool | str) -> None:
        """Every parameter's gradient, a record each (see ``Recorder.grads``)."""
        st = self.staging
        named = [(name, p.grad) for name, p in named_params if p.grad is not None]
        if st.dtensor is not None:
            named = list(zip([name for name, _ in named], st.shards([g for _, g in named])))
        checked = copy == "checked"
        grads = [g for _, g in named]
        if (
            checked
            and grads
            and all(g._base is None and g.layout == torch.strided and not g.requires_grad for g in grads)
        ):
            self._checked_own([name for name, _ in named], grads)
            return
        if checked:  # the grad records' indices below follow the records made so far
            position = {id(g): i for i, (_, g) in enumerate(named)}
        # Gradients that are contiguous pieces of one buffer (as a gradient reducer leaves them) are
        # staged with one copy of the buffer (or the buffer itself, checked), each digested as its piece.
        groups: dict[tuple, list[tuple[int, int, torch.Tensor]]] = {}
        for _, g in named:
            if g.layout == torch.strided and g.is_contiguous():
                groups.setdefault((g.untyped_storage().data_ptr(), g.dtype, g.device), []).append(
                    (g.storage_offset(), g.numel(), g)
                )
        slot: dict[int, int] = {}
        for group in groups.values():
            group.sort(key=_first)
            split = _pieces(group) if len(group) > 1 else None
            if split is None:
                continue  # copied one by one
            sizes, keep, lo, hi = split
            flat = group[0][2].detach().as_strided((hi - lo,), (1,), lo)
            # The buffer itself, checked unchanged for the first of its records: checked_slot's bookkeeping,
            # without its slot (the pieces below are the slots); not shared, since checked_slot runs per
            # module output and a call more there costs every module-level step.
            if checked:
                b = st.batch
                b.check_live.append(flat)
                b.check_version.append(flat._version)
                b.check_record.append(len(b.step) + position[id(group[0][2])])
            else:
                flat = self._grad_copy(flat)
            st.nbytes += flat.numel() * flat.element_size()
            for (_, _, g), k in zip(group, st.add_pieces(flat, sizes, keep)):
                slot[id(g)] = k
        self.record_many(
            ["grad"] * len(named), [name for name, _ in named], [g for _, g in named], slot, checked=checked
        )

    def _checked_own(self, names: list[str], grads: list[torch.Tensor]) -> None:
        """Gradients that are tensors of their own (not views), checked where they lie: ``record_many``'s
        records, made from a ``GradPlan`` by whole lists."""
        st = self.staging
        b, n = st.batch, len(grads)
        plan = self.grad_plan
        if plan is None or not plan.matches(names, st.mb, grads):
            plan = self.grad_plan = GradPlan(names, st.mb, grads, [st.head(g) for g in grads])
        occurrences = self._occurrences(plan.counts, plan.ops, names)
        first = len(b.step)
        # each checked unchanged until digested, as checked_slot does (a gradient needs no detach: it
        # carries no graph, see the caller)
        b.check_live.extend(grads)
        b.check_version.extend(map(_versions, grads))
        b.check_record.extend(range(first, first + n))
        st.nbytes += plan.total
        if self.rec.reads_in_place and plan.plain and all(map(_contiguous, grads)):
            b.described[len(b.tensors)] = list(zip(map(_data_ptrs, grads), plan.nbytes))
        self._rows(st.add_tensors(grads), plan.heads, plan.ops, names, occurrences)

    def _grad_copy(self, flat: torch.Tensor) -> torch.Tensor:
        """A copy of a gradient buffer, in a buffer reused from step to step (a fresh multi-MB copy per step
        costs its page faults every time): the batch that read the last one is digested (``grads`` waits
        for it first), unless the current batch still holds it."""
        batch = self.staging.batch
        key = (flat.dtype, flat.device)
        buf, owner = self._grad_bufs.get(key, (None, None))
        if buf is None or buf.numel() < flat.numel() or owner is batch:
            buf = torch.empty(flat.numel(), dtype=flat.dtype, device=flat.device)
        self._grad_bufs[key] = (buf, batch)
        return buf[: flat.numel()].copy_(flat)

    def state(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        named_params: Iterable[tuple[str, torch.nn.Parameter]] | None,
        named_buffers: Iterable[tuple[str, torch.Tensor]] | None,
    ) -> None:
        """Parameters, optimizer state and persistent buffers, a record each (see ``Recorder.state``)."""
        st = self.staging
        named = list(model.named_parameters() if named_params is None else named_params)
        names = [name for name, _ in named]
        # What identifies the state (see StatePlan): the parameters; each parameter with optimizer state,
        # its number of entries (tensors or not), and its tensors and their keys.
        objs: list[torch.Tensor] = [p for _, p in named]
        lens: list[int] = []
        keys: list[str] = []
        if optimizer is not None:
            held = optimizer.state.values()
            lens = list(map(len, held))
            keys = [k for s in held for k, v in s.items() if isinstance(v, torch.Tensor)]
            objs += optimizer.state.keys()
            objs += [v for s in held for v in s.values() if isinstance(v, torch.Tensor)]
        plan = self.plan
        if plan is not None and plan.matches(names, objs, lens, keys, st.mb):
            tensors = [objs[i] for i in plan.order]
            if st.dtensor is not None:
                tensors = st.shards(tensors)
            if layout(tensors) != plan.layout:
                plan = None
        else:
            plan = None
        if plan is None:
            plan, tensors = self.plan_state(named, optimizer, names, objs, lens, keys)
        self.record_many(plan.ops, plan.scopes, tensors, None, plan=plan)
        buffers = persistent_buffers(model) if named_buffers is None else list(named_buffers)
        if buffers:
            self.record_many(["buffer"] * len(buffers), [name for name, _ in buffers], [b for _, b in buffers], {})

    def plan_state(
        self,
        named: list[tuple[str, torch.nn.Parameter]],
        optimizer: torch.optim.Optimizer | None,
        names: list[str],
        objs: list[torch.Tensor],
        lens: list[int],
        keys: list[str],
    ) -> tuple[StatePlan, list[torch.Tensor]]:
        """What ``state`` records (parameters, then each parameter's optimizer state by sorted key), as a
        new plan (kept for the next steps, unless a tensor's layout cannot be read), and the tensors."""
        st = self.staging
        order = list(range(len(named)))
        scopes = list(names)
        ops = ["param"] * len(named)
        if optimizer is not None:
            where = {id(t): i for i, t in enumerate(objs)}
            scope_of = {id(p): name for name, p in named}
            for p, s in optimizer.state.items():
                scope = scope_of.get(id(p), "?")
                for key in sorted(s):
                    value = s[key]
                    if isinstance(value, torch.Tensor):
                        ops.append(f"optim.{key}")
                        scopes.append(scope)
                        order.append(where[id(value)])
        tensors = [objs[i] for i in order]
        if st.dtensor is not None:
            tensors = st.shards(tensors)
        heads = [b""] * len(tensors)  # a state record's digest is its checksum: no digest header to make
        descs = describe_all(tensors) if self.rec.reads_in_place else None
        if descs is not None:
            descs = list(zip(descs, [tensor_header(t.dtype, tuple(t.shape)) for t in tensors]))
        plan = StatePlan(names, objs, lens, keys, st.mb, order, tensors, ops, scopes, heads, descs)
        self.plan = plan if plan.layout is not None else None
        return plan, tensors

    def record_many(
        self,
        ops: list[str],
        scopes: list[str],
        tensors: list[torch.Tensor],
        slots: dict[int, int] | None,
        checked: bool = False,
        plan: StatePlan | None = None,
    ) -> None:
        """Step records (op, scope, tensor), one output each, without the per-tensor cache: with ``slots``
        None every tensor is state, digested by its state checksum where it lies (no copy); else a tensor
        whose id maps to a slot uses it, any other is copied (``checked``: digested live and checked
        unchanged, if it is dense). A ``plan`` (``state``'s) gives the records' keys, headers and
        descriptions as they were last step.

        The columns grow by whole lists (a few list operations, not a dozen per record)."""
        st = self.staging
        b = st.batch
        occurrences = self._occurrences(step_counts(st.mb, ops, scopes) if plan is None else plan.counts, ops, scopes)
        if slots is None:
            if plan is not None and plan.descs is not None:
                b.hashed_described[len(b.hashed)] = plan.descs
            refs: Iterable[int] = st.add_hashed(tensors, self.rec.checksums)
        elif not checked:
            refs = [slots[id(t)] if id(t) in slots else st.copy(t) for t in tensors]
        else:  # the others live too, each checked for its own record (a dense one: see copy for the rest)
            refs = [
                slots[id(t)]
                if id(t) in slots
                else st.checked_slot(t, t._version, len(b.step) + i)
                if t.layout == torch.strided
                else st.copy(t)
                for i, t in enumerate(tensors)
            ]
        if plan is None:
            heads = st.heads
            self._rows(refs, [heads.get((t.dtype, t.shape)) or st.head(t) for t in tensors], ops, scopes, occurrences)
        else:
            self._rows(refs, plan.heads, ops, scopes, occurrences)

    def _occurrences(self, counts: dict[tuple, int], ops: list[str], scopes: list[str]) -> list[int]:
        """Each record's occurrence; ``counts`` (``step_counts``) counts them in one update as usual, when
        each is the first of its identity this step. A plan's counts are made once: updating from a dict
        reuses its keys' hashes, and isdisjoint walks the smaller."""
        st = self.staging
        if len(counts) == len(ops) and st.counts.keys().isdisjoint(counts.keys()):
            st.counts.update(counts)
            return [0] * len(ops)
        return [st.occurrence("step", scope, op) for op, scope in zip(ops, scopes)]

    def _rows(
        self, refs: Iterable[int], heads: list[bytes], ops: list[str], scopes: list[str], occurrences: list[int]
    ) -> None:
        """Step records of the staged references ``refs`` (one output each), the columns grown by whole lists."""
        st = self.staging
        b, n = st.batch, len(ops)
        first = len(b.ref_slot)
        b.ref_slot.extend(refs)
        b.ref_head.extend(heads)
        b.step.extend([st.step] * n)
        b.mb.extend([st.mb] * n)
        b.phase.extend(["step"] * n)
        b.scope.extend(scopes)
        b.op.extend(ops)
        b.occ.extend(occurrences)
        b.in_end.extend([len(b.ins)] * n)
        b.out_end.extend(range(len(b.outs) + 1, len(b.outs) + n + 1))
        b.outs.extend(range(first, first + n))
        st.seq += n
        st.check_full()

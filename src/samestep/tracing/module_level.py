"""The module level: every module's forward output, and the gradient arriving at it in backward, by path.

By default a module's tensors are digested where they lie and checked unchanged (their version
counters) once the digest is done; a change in place raises, naming the record. The hooks only note
the tensors and their versions; ``drain`` makes the records later, in one loop, before anything else
is recorded. With ``copy`` (``trace.copy=true``) each is copied in the hook instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from samestep.tracing.hooks import grad_hook, leaves
from samestep.tracing.staging import RecorderView, Staging

__all__ = ["PENDING_BYTES", "ModuleRecords"]

# Module records noted by the hooks are made once the tensors they keep alive reach this many bytes (or
# at the next microbatch, step or other record): the notes count towards the recorder's memory too.
PENDING_BYTES = 64 * 1024 * 1024


class ModuleRecords:
    """The module level's hooks, and the records they noted but have not made yet."""

    def __init__(self, rec: RecorderView, staging: Staging, copy: bool) -> None:
        self.rec, self.staging, self.copy = rec, staging, copy
        # (op, phase, scope, tensors, their versions) noted by the hooks, made into records by drain
        self.pending: list[tuple[str, str, str, list[torch.Tensor], list[int]]] = []
        self._pending_bytes = 0

    def record_now(self, op: str, phase: str, scope: str, outs: list[torch.Tensor]) -> None:
        """A module's output or incoming gradient, copied now (trace.copy=true)."""
        st = self.staging
        occurrence = st.occurrence(phase, scope, op)
        st.append(phase, scope, op, occurrence, (), [st.stage(t) for t in outs])

    def drain(self) -> None:
        """Makes the records the module hooks noted, in the order noted. Called before any other record
        is made and when the microbatch or step changes, so the stream is the one immediate records
        would give; a tensor changed in place since it was noted is caught by its noted version.

        One loop over hundreds of records per step: ``record`` with its arguments bound (the occurrence
        count inline, the staging at the noted versions), cheaper per record than a call each."""
        if not self.pending:
            return
        noted = list(self.pending)
        self.pending.clear()  # (a flush inside append drains again: nothing left)
        self._pending_bytes = 0
        st = self.staging
        counts, mb = st.counts, st.mb
        for op, phase, scope, outs, versions in noted:
            key = (mb, phase, scope, op)
            occurrence = counts.get(key, 0)
            counts[key] = occurrence + 1
            refs = []
            for t, version in zip(outs, versions):
                ref = st.cached(t, version)
                refs.append(st.reference(t, st.checked_slot(t, version), version) if ref is None else ref)
            st.append(phase, scope, op, occurrence, (), refs)

    def note(self, op: str, phase: str, scope: str, outs: list[torch.Tensor]) -> None:
        """Notes a module record for ``drain``, with the tensors' versions now; drains once the notes
        keep ``PENDING_BYTES`` alive."""
        if self.staging.dtensor is not None:
            outs = self.staging.shards(outs)
        try:
            versions = [t._version for t in outs]
            nbytes = sum(t.nbytes for t in outs)
        except RuntimeError:  # an inference tensor cannot be checked unchanged later, a sparse one has no
            self.drain()  # nbytes: recorded now, copied
            self.record_now(op, phase, scope, outs)
            return
        self.pending.append((op, phase, scope, outs, versions))
        self._pending_bytes += nbytes
        if self._pending_bytes > PENDING_BYTES:
            self.drain()

    def hook(self, path: str) -> Callable:
        """Module level only: records the output, and the gradient arriving at it in backward.

        With checked live tensors (the default) a hook only notes the tensors and their versions;
        ``drain`` makes the records later in one loop: made inside the hooks, between the model's own
        operations, each record costs about twice as much.
        """
        # copies (trace.copy=true) must be taken now, before the tensor can change
        record = self.record_now if self.copy else self.note
        rec = self.rec

        def grad_output(grad: torch.Tensor) -> None:
            if rec.modules_on:
                record("grad_output", "backward", path, [grad])

        def hook(module, args, output):
            if not rec.modules_on:
                return
            outs = leaves(output)
            record("output", "forward", path, outs)
            if torch.is_grad_enabled():
                for t in outs:
                    if t.requires_grad:
                        grad_hook(t, grad_output)

        return hook

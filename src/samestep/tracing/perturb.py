"""Fault injection for validating the diff: one ULP planted in one op occurrence's output. A perturbation that
never fired is an error at the end of its step (a spec that matches no op would otherwise leave two runs
identical, and the diff's verdict a statement about nothing)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Perturb"]


@dataclass(slots=True)
class Perturb:
    """Adds one ULP to element 0 of one op occurrence's output (the identity of a trace record, on one rank)."""

    rank: int
    step: int
    microbatch: int
    phase: str
    scope: str
    op: str
    occurrence: int = 0
    fired: bool = field(default=False, compare=False)
    """Whether the ULP was planted (in this process)."""

    @classmethod
    def parse(cls, text: str) -> Perturb:
        """From ``"rank=0,step=2,microbatch=1,phase=backward,scope=lm_head,op=aten.mm.default,occurrence=1"``
        (the identity of a trace record; ``rank`` and ``occurrence`` default to 0, ``scope`` to the root)."""
        try:
            fields = dict(item.split("=", 1) for item in text.split(","))
            if fields.get("phase", "forward") not in ("forward", "backward"):
                raise ValueError
            return cls(
                rank=int(fields.get("rank", 0)),
                step=int(fields["step"]),
                microbatch=int(fields["microbatch"]),
                phase=fields.get("phase", "forward"),
                scope=fields.get("scope", ""),
                op=fields["op"],
                occurrence=int(fields.get("occurrence", 0)),
            )
        except (KeyError, ValueError):
            raise ValueError(
                f"trace.perturb={text!r}: expected 'rank=R,step=S,microbatch=M,phase=forward|backward,"
                "scope=MODULE.PATH,op=OP,occurrence=K'"
            ) from None

    def check_fired(self, step: int, rank: int) -> None:
        """At the end of step ``step`` on ``rank``: raises if this is the perturbation's step and rank and it
        planted nothing.

        Raises:
            ValueError: names the spec and what to check.
        """
        if (step, rank) == (self.step, self.rank) and not self.fired:
            raise ValueError(
                f"trace.perturb: {self.spec()} matched no floating-point op output of step {step} on "
                f"rank {rank}, so nothing was planted (a diff of this run would compare nothing "
                "planted). Fix: is the step traced at op level there (trace.steps, or "
                "Run(level='op', trace_steps=...))? The scope, op, microbatch and occurrence are a "
                "trace record's (samestep diff --json of an op-level trace lists them)"
            )

    def spec(self) -> str:
        """The text ``parse`` reads this from."""
        return (
            f"rank={self.rank},step={self.step},microbatch={self.microbatch},phase={self.phase},"
            f"scope={self.scope},op={self.op},occurrence={self.occurrence}"
        )

    def apply(self, identity: tuple, outs: list[torch.Tensor]) -> None:
        """Plants the ULP in ``outs[0]`` if ``identity`` (rank, step, microbatch, phase, scope, op, occurrence)
        is this one's and that output is a non-empty floating-point tensor."""
        if (
            outs
            and identity == (self.rank, self.step, self.microbatch, self.phase, self.scope, self.op, self.occurrence)
            and outs[0].is_floating_point()
            and outs[0].numel()
        ):
            self.fired = True
            out = outs[0]
            first = (0,) * out.dim()  # by index, not through a view: an output may have any strides
            with torch.no_grad():
                out[first] = torch.nextafter(out[first], torch.tensor(float("inf"), dtype=out.dtype, device=out.device))

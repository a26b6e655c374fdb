"""Fault injection for validating the diff: one ULP planted in one op occurrence's output."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Perturb"]


@dataclass(frozen=True, slots=True)
class Perturb:
    """Adds one ULP to element 0 of one op occurrence's output (the identity of a trace record, on one rank)."""

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

    def apply(self, identity: tuple, outs: list[torch.Tensor]) -> None:
        """Plants the ULP in ``outs[0]`` if ``identity`` (rank, step, microbatch, phase, scope, op, occurrence)
        is this one's and that output is a non-empty floating-point tensor."""
        if (outs and identity == (self.rank, self.step, self.microbatch, self.phase, self.scope, self.op,
                                  self.occurrence) and outs[0].is_floating_point() and outs[0].numel()):
            out = outs[0]
            first = (0,) * out.dim()  # by index, not through a view: an output may have any strides
            with torch.no_grad():
                out[first] = torch.nextafter(out[first], torch.tensor(float("inf"), dtype=out.dtype, device=out.device))

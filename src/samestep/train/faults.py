"""A fault injector for tests of the fault checks (``train.fault``): one bit flipped, once.

    output:rank=0,step=3,microbatch=1,module=transformer.ln_f,bit=20
        flips bit 20 of element 0 of that module's forward output, the first time it runs in that step and
        microbatch on that rank (a transient fault in the op that made it: a recompute does not repeat it);
    param:rank=1,step=3,name=transformer.h.0.mlp.c_fc.weight,bit=20
        flips bit 20 of element 0 of that parameter on that rank after step 3's update (a fault in one
        rank's memory between steps);
    grad:rank=1,step=3,name=transformer.h.0.mlp.c_fc.weight,bit=20
        flips it in that parameter's reduced gradient on that rank, after the reduction, before clipping.

The output is changed in place, so the op that made it must not keep it for its backward (a layer norm's
or a linear layer's output is not kept; an activation's may be, and autograd would then refuse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from samestep.distributed.shards import local_shard

__all__ = ["Fault", "flip_bit"]

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_KEYS = {
    "output": ("rank", "step", "microbatch", "module", "bit"),
    "param": ("rank", "step", "name", "bit"),
    "grad": ("rank", "step", "name", "bit"),
}


def flip_bit(t: torch.Tensor, bit: int) -> None:
    """Flips bit ``bit`` of element 0 of ``t`` (of a DTensor, of this rank's shard), in place, as autograd does
    not see."""
    t = local_shard(t)
    if not 0 <= bit < 8 * t.element_size():
        raise ValueError(f"train.fault: bit={bit} is not a bit of a {8 * t.element_size()}-bit {t.dtype} value")
    with torch.no_grad():
        view = t.detach().view(_INT[t.element_size()]).view(-1)
        view[0] ^= (1 << bit) if bit < 8 * t.element_size() - 1 else -(1 << bit)


@dataclass(slots=True)
class Fault:
    """One planted bit flip; see the module docstring."""

    kind: str
    rank: int
    step: int
    target: str  # the module path or the parameter name
    bit: int
    microbatch: int = -1
    fired: bool = False
    _now: tuple[int, int] = (-1, -1)

    @classmethod
    def parse(cls, text: str) -> Fault:
        kind, _, rest = text.partition(":")
        try:
            fields = dict(item.split("=", 1) for item in rest.split(","))
            if kind not in _KEYS or set(fields) != set(_KEYS[kind]):
                raise ValueError
            return cls(
                kind=kind,
                rank=int(fields["rank"]),
                step=int(fields["step"]),
                target=fields["module"] if kind == "output" else fields["name"],
                bit=int(fields["bit"]),
                microbatch=int(fields.get("microbatch", -1)),
            )
        except ValueError:
            raise ValueError(
                f"train.fault={text!r}: expected 'output:rank=R,step=S,microbatch=M,module=PATH,bit=B', "
                "'param:rank=R,step=S,name=PARAM,bit=B' or 'grad:rank=R,step=S,name=PARAM,bit=B'"
            ) from None

    def install(self, model: torch.nn.Module, rank: int) -> None:
        """Hooks the module of an output fault on its rank (raises naming a module or parameter not there)."""
        names = dict(model.named_modules()) if self.kind == "output" else dict(model.named_parameters())
        if self.target not in names:
            raise ValueError(
                f"train.fault: the model has no {'module' if self.kind == 'output' else 'parameter'} {self.target!r}"
            )
        size = 64 if self.kind == "output" else 8 * names[self.target].element_size()  # an output's: when it fires
        if not 0 <= self.bit < size:
            raise ValueError(f"train.fault: bit={self.bit} is not a bit of a {size}-bit value")
        if self.kind == "output" and rank == self.rank:
            names[self.target].register_forward_hook(self._hook)

    def at(self, step: int, microbatch: int) -> None:
        """Where training is: the step (0-based) and global microbatch about to run."""
        self._now = (step + 1, microbatch)

    def _hook(self, module: torch.nn.Module, args: Any, out: Any) -> Any:
        if not self.fired and self._now == (self.step, self.microbatch):
            self.fired = True
            t = out if isinstance(out, torch.Tensor) else out[0]
            if t._base is not None:  # a view a custom autograd function made (a tensor-parallel layer's
                t = t.clone()  # output): autograd refuses it changed in place, so the flipped copy replaces it
                out = t if isinstance(out, torch.Tensor) else (t, *out[1:])
            flip_bit(t, self.bit)
            return out
        return None

    def after(self, stage: str, step: int, named_params: list[tuple[str, torch.nn.Parameter]], rank: int) -> None:
        """At ``stage`` "reduce" (the reduced gradients, before clipping) or "update" (after the optimizer
        step) of step ``step`` (0-based): flips a grad or param fault's bit, on its rank, once."""
        if (
            self.kind != {"reduce": "grad", "update": "param"}[stage]
            or self.fired
            or rank != self.rank
            or step + 1 != self.step
        ):
            return
        self.fired = True
        p = dict(named_params)[self.target]
        flip_bit(p if stage == "update" else p.grad, self.bit)

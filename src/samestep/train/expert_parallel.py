"""Expert parallelism in the reference run: parallel.ep (docs/layouts.md, "Expert parallelism").

The data ranks form groups of ``parallel.ep`` consecutive ranks; each group spreads every MoE layer's experts
over its ranks (rank j of a group holds experts [j E/ep, (j+1) E/ep)), and the same expert on the other groups
is its replica. Every rank builds the whole model (the same initial draws) and keeps its experts (the others
become parameterless placeholders, so each parameter keeps its one-process name). The MoE layer routes and
combines its own tokens as one process does and sends each expert's rows to its rank
(``samestep.distributed.expert_parallel``); an expert's gradient sums its microbatches along the canonical
tree whatever rank sent them, the other parameters' as data parallelism sums them. The gradient norm's row
sums are assembled in the model's parameter order (an expert's from its rank), the vector one process sums.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from samestep.train.config import Config
from samestep.train.config_values import not_with
from samestep.train.parts import Parts

__all__ = ["ExpertLayout", "check_ep"]


def check_ep(cfg: Config, world: int) -> None:
    """Refuses an expert-parallel config this run cannot keep on one numerical path, naming the fix.

    Raises:
        ValueError: the field, its value and what would do.
    """
    par, t, m = cfg.parallel, cfg.train, cfg.model
    if par.ep == 1:
        return
    if not m.moe_experts:
        raise ValueError(
            f"parallel.ep={par.ep} spreads the experts of MoE layers, and model.moe_experts=0. Fix: "
            "--set model.moe_experts=8 (or leave parallel.ep=1)"
        )
    why = {
        "parallel.tp_chunks": par.tp_chunks > 0,
        "parallel.pp": par.pp > 1,
        "parallel.fsdp": par.fsdp,
        "train.compile": t.compile,
        "train.sdc_check_every": t.sdc_check_every > 0,
        "train.fault": bool(t.fault),
    }
    not_with(f"parallel.ep={par.ep}", why)
    if m.moe_experts % par.ep:
        raise ValueError(
            f"parallel.ep={par.ep} does not divide model.moe_experts={m.moe_experts} into whole experts "
            f"a rank. Fix: --set parallel.ep to a divisor of {m.moe_experts}"
        )
    if world % par.ep:
        raise ValueError(
            f"parallel.ep={par.ep} does not divide the {world} process(es) into groups of {par.ep}. "
            f"Fix: --nproc a multiple of {par.ep}"
        )
    if m.arch == "gpt" and m.dropout > 0:
        raise ValueError(
            f"parallel.ep={par.ep} with model.arch=gpt and model.dropout={m.dropout}: the GPT's experts "
            "draw their dropout masks in expert order from one generator, which experts on other ranks "
            "cannot share. Fix: --set model.dropout=0, or model.arch=llama (its experts draw none)"
        )


class _Absent(nn.Module):
    """An expert another rank holds: no parameter here."""

    def forward(self, *args: Any) -> torch.Tensor:
        raise RuntimeError("an expert another rank holds was called here")


class ExpertLayout:
    """This rank's experts and what joins them to the others (``build``, a collective: every rank calls it
    with the whole model, after the process group exists)."""

    def __init__(self) -> None:
        self.size = 1
        self.params: list[nn.Parameter] = []  # every parameter this rank steps: the shared ones, its experts'
        self.shared: list[nn.Parameter] = []  # those every data rank holds (summed by the canonical reduction)
        self.grads: Any = None  # ExpertGradients of this rank's experts
        self.group: Any = None  # this rank's expert-parallel group
        self.parts: Any = None  # Parts
        self.order: list[str] = []  # every parameter's name, in the whole model's order
        self.owner: dict[str, int] = {}  # an expert parameter's name -> its rank in the group
        self._experts: set[str] = set()  # every expert parameter's name
        self._shapes: dict[str, tuple[int, ...]] = {}  # every parameter's shape (the whole model's)

    @classmethod
    def build(cls, model: nn.Module, cfg: Config, world: int, rank: int, device: torch.device) -> ExpertLayout:
        from torch.distributed.device_mesh import init_device_mesh

        from samestep.distributed.expert_parallel import ExpertExchange, ExpertGradients

        self = cls()
        ep = self.size = cfg.parallel.ep
        per = cfg.model.moe_experts // ep
        self.parts = Parts(model)
        self.order = [n for n, _ in model.named_parameters()]
        self._shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        if world == ep:
            mesh, replicas = init_device_mesh(device.type, (ep,), mesh_dim_names=("expert",)), None
        else:
            grid = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("replica", "expert"))
            mesh, replicas = grid["expert"], grid["replica"].get_group()
        self.group = mesh.get_group()
        me = rank % ep
        layers = [(name, m) for name, m in model.named_modules() if type(m).__name__ == "MoE"]
        kept: dict[Any, nn.Module] = {}
        for i, (name, moe) in enumerate(layers):
            for e in range(len(moe.experts)):
                for pname, _ in moe.experts[e].named_parameters():
                    full = f"{name}.experts.{e}.{pname}"
                    self._experts.add(full)
                    self.owner[full] = e // per
                if e // per == me:
                    kept[(i, e)] = moe.experts[e]
                else:
                    moe.experts[e] = _Absent()
        self.grads = ExpertGradients(kept, ep, replicas, canonical=cfg.determinism.enabled)
        for i, (_, moe) in enumerate(layers):
            moe.exchange = ExpertExchange(self.group, ep, me, per, self.grads, layer=i)
        self.params = [p for p in model.parameters() if p.requires_grad]
        expert_ids = {id(p) for p in self.grads.params}
        self.shared = [p for p in self.params if id(p) not in expert_ids]
        self.parts.hold(model, self.params)
        return self

    def after_microbatch(self) -> None:
        """After a microbatch's backward: its expert gradients into their trees."""
        self.grads.accumulate()

    def reduce(self) -> None:
        """After the step's last microbatch: every expert gradient of this rank into its ``.grad``."""
        self.grads.reduce()

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The canonical gradient norm (``samestep.distributed.norm``) over the whole model: each parameter's row
        sums in the model's order, an expert's from its rank (one gather over the group)."""
        from samestep.distributed.norm import gather_rows, row_squares

        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        mine = [row_squares(grads[n]) for n in self.order if n in self._experts and n in grads]
        flat = gather_rows([torch.cat(mine) if mine else torch.zeros(0)], self.group)[0]  # rank by rank
        experts = [n for r in range(self.size) for n in self.order if self.owner.get(n) == r]
        theirs = dict(zip(experts, flat.split([self._shapes[n][0] if self._shapes[n] else 1 for n in experts])))
        rows = [
            theirs[n] if n in self._experts else row_squares(grads[n])
            for n in self.order
            if n in self._experts or n in grads
        ]
        return torch.cat(rows).sum().sqrt()

    def whole_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The model's and optimizer's ``state_dict()`` as one process holds them: the experts gathered over
        the group (a collective over it), the rest this rank's own."""
        return self.parts.whole_state(model, optimizer, self.group, device, gathered=self._experts.__contains__)

    def loaders(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """What a whole checkpoint is loaded into: this rank's part of each state."""
        return self.parts.loaders(model, optimizer)

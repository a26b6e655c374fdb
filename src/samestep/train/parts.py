"""A model whose ranks hold parts of it (pipeline stages, experts spread over ranks), and the whole state
one process would hold: gathered from the parts for a checkpoint, a receipt and the final digest, and loaded
back into each part, whatever layout wrote it. Every parameter keeps its one-process name on the rank that
holds it, so the parts are named alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["Parts"]


def _split(params: list[nn.Parameter]) -> bool:
    return any(type(p).__name__ == "DTensor" for p in params)


class Parts:
    """The whole model's state-dict keys and optimizer groups (by parameter name: AdamW's decay and no-decay,
    as the trainer makes them), read from the whole model before it is cut (``Parts(model)``); then this
    rank's part (``hold``)."""

    def __init__(self, model: nn.Module) -> None:
        self.full_keys = list(model.state_dict().keys())
        named = list(model.named_parameters())  # a tied weight once, under its first name
        self.groups = [[n for n, p in named if p.dim() >= 2], [n for n, p in named if p.dim() < 2]]
        self.names: dict[int, str] = {}
        self.split = False

    def hold(self, model: nn.Module, params: list[nn.Parameter], aliases: dict[str, str] | None = None) -> None:
        """This rank's part: ``model`` cut to it, and the parameters its optimizer steps (DTensors under tensor
        parallelism); ``aliases``: a parameter's name here -> its one-process name (a tied weight's)."""
        aliases = aliases or {}
        self.names = {id(p): aliases.get(n, n) for n, p in model.named_parameters()}
        self.split = _split(params)

    def whole_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        group: Any,
        device: torch.device,
        gathered: Callable[[str], bool] = lambda name: True,
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The model's and optimizer's ``state_dict()`` as one process holds them: each rank's entries of the
        names ``gathered`` picks, gathered over ``group`` (the others every rank holds alike: its own). A
        collective over ``group``."""
        from samestep.distributed.gather import gather_named

        if self.split:  # the tensor ranks' shards, gathered first
            from samestep.distributed.fsdp import full_state

            local, sd = full_state(model, optimizer)
        else:
            local, sd = dict(model.state_dict()), optimizer.state_dict()
        local_names = [self.names[id(p)] for g in optimizer.param_groups for p in g["params"]]
        for idx, state in sd["state"].items():
            for key, value in state.items():
                local[f"optimizer\0{local_names[idx]}\0{key}"] = value
        spread = {k: v for k, v in local.items() if gathered(k.split("\0")[1] if "\0" in k else k)}
        every = {**{k: v for k, v in local.items() if k not in spread}, **gather_named(spread, group, device)}
        model_sd = {k: every[k] for k in self.full_keys}
        index = {n: i for i, n in enumerate(n for g in self.groups for n in g)}
        states: dict[int, dict[str, Any]] = {}
        for key, value in every.items():
            if key.startswith("optimizer\0"):
                _, name, field = key.split("\0")
                states.setdefault(index[name], {})[field] = value
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in names]}
            for g, names in zip(sd["param_groups"], self.groups)
        ]
        return model_sd, {"state": dict(sorted(states.items())), "param_groups": groups}

    def loaders(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        """What a whole checkpoint is loaded into: this rank's part of each state (under tensor parallelism,
        each tensor rank's shards of it)."""
        from samestep.distributed.fsdp import ShardedModel, ShardedOptimizer

        return (
            _PartModel(model, ShardedModel(model) if self.split else model),
            _PartOptimizer(
                optimizer, self.groups, self.names, ShardedOptimizer(optimizer) if self.split else optimizer
            ),
        )


class _PartModel:
    """``load_state_dict`` of the whole model's state into a part: its own entries."""

    def __init__(self, model: nn.Module, into: Any) -> None:
        self.model, self.into = model, into  # ``into``: the model, or what loads whole tensors into its shards

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        own = self.model.state_dict()
        missing = sorted(set(own) - set(state))
        if strict and missing:
            raise RuntimeError(f"model part state: missing keys {missing}")
        self.into.load_state_dict({k: state[k] for k in own if k in state}, strict=strict)


class _PartOptimizer:
    """``load_state_dict`` of the whole optimizer's state into a part's: its parameters' entries, by name."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, groups: list[list[str]], names: dict[int, str], into: Any
    ) -> None:
        self.optimizer, self.groups, self.names, self.into = optimizer, groups, names, into

    def load_state_dict(self, state: dict[str, Any]) -> None:
        whole = [n for g in self.groups for n in g]
        local = [[self.names[id(p)] for p in g["params"]] for g in self.optimizer.param_groups]
        index = {n: i for i, n in enumerate(n for g in local for n in g)}
        states = {index[whole[int(i)]]: s for i, s in state["state"].items() if whole[int(i)] in index}
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in names]}
            for g, names in zip(state["param_groups"], local)
        ]
        self.into.load_state_dict({"state": states, "param_groups": groups})

"""Expert parallelism for a model of one's own whose experts are stacked: each expert weight one parameter of
shape [E, ...], expert e at row e, as transformers' MoE models keep them (``MixtralExperts``' ``gate_up_proj``
and ``down_proj``), dispatched as their eager or grouped_mm experts implementation dispatches (docs/layouts.md,
"Expert parallelism in a loop of one's own").

What keeps the bits of the model's own call on one process:
- each stacked parameter becomes a DTensor sharded by rows (``Shard(0)``) over a 1-D mesh of the data ranks,
  rank j holding experts [j E/N, (j+1) E/N); a checkpoint, a receipt and the final digest hold it whole;
- routing and the combine stay on the rank that owns the tokens, in the model's own order: eager, experts
  ascending, an expert's rows as ``torch.where`` lists them (by top-k slot, then token), each gathered by its
  own index op, each expert's weighted output index-added into zeros in expert order; grouped_mm, the (token,
  slot) pairs sorted by expert and gathered by one index op, put back in pair order and summed over the slots;
  autograd then meets the same graph (the same index backwards, their contributions in the same order);
- each expert's rows go to its rank (``ExpertExchange``) and run there on each source rank's rows apart, the
  same rows one process runs for that microbatch, on fresh leaves of the expert's slices;
- after each microbatch a source's leaf gradients are placed in a zero gradient of this rank's slices (eager:
  added, as autograd adds the experts' one-slice contributions into one) and pushed into that source's tree; at
  the step's end the sources' trees are combined in rank order: the tree ``CanonicalGradients`` makes over
  global microbatch indices, which sums the other parameters.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from samestep.distributed.expert_parallel import ExpertExchange
from samestep.distributed.tree import BinaryCounter

__all__ = ["StackedExperts", "parallelize_experts", "transformers_expert"]

# expert(module, weights by parameter name, rows) -> the expert's output rows
Expert = Callable[[torch.nn.Module, dict[str, torch.Tensor], torch.Tensor], torch.Tensor]


class StackedExperts:
    """The experts of every module of one class in a model, spread over a 1-D ``mesh`` of the data ranks (made
    by ``parallelize_experts``). After each microbatch's backward call ``accumulate()``; after the step's last,
    ``reduce()`` sets each expert parameter's ``.grad`` (this rank's rows, a DTensor placed as the parameter).

    ``canonical=False`` is the usual way instead, a control: the experts' parameters take every source's rows
    through autograd, which adds them into ``p.grad`` as they come."""

    def __init__(
        self,
        modules: list[torch.nn.Module],
        mesh: Any,
        expert: Expert,
        microbatches_per_process: int,
        canonical: bool,
        loop: str,
    ) -> None:
        self.modules, self.mesh, self.expert, self.canonical, self.loop = modules, mesh, expert, canonical, loop
        self.size, self.rank = mesh.size(), mesh.get_local_rank()
        self.k = microbatches_per_process
        self.params = {layer: dict(m.named_parameters(recurse=False)) for layer, m in enumerate(modules)}
        self.experts = next(iter(self.params[0].values())).shape[0]
        self.per_rank = self.experts // self.size
        self._trees = {
            (layer, name, s): BinaryCounter()
            for layer, named in self.params.items()
            for name in named
            for s in range(self.size)
        }
        self._open: list[tuple[int, int, int, dict[str, torch.Tensor]]] = []  # (source, layer, expert, leaves)
        self._pushed = 0
        self._hit: dict[tuple[int, int], int] = {}  # (source, layer): experts the source's rows went to

    def parameters(self) -> list[torch.nn.Parameter]:
        """The stacked expert parameters, in the model's order: what ``CanonicalGradients`` must leave out."""
        return [p for named in self.params.values() for p in named.values()]

    def other_parameters(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """``model``'s parameters but the spread experts', in order: what ``CanonicalGradients`` sums."""
        spread = {id(p) for p in self.parameters()}
        return [p for p in model.parameters() if id(p) not in spread]

    def leaves(self, key: tuple[int, int], source: int) -> dict[str, torch.Tensor]:
        """Expert ``key`` = (layer, e)'s weights for ``source``'s rows of this microbatch (``ExpertExchange``
        asks): fresh leaves of this rank's slices, or, not canonical, the slices themselves."""
        layer, e = key
        j = e - self.rank * self.per_rank
        if not self.canonical:
            return {name: p.to_local()[j] for name, p in self.params[layer].items()}  # type: ignore[attr-defined]
        leaves = {
            name: p.to_local()[j].detach().requires_grad_()  # type: ignore[attr-defined]
            for name, p in self.params[layer].items()
        }
        self._open.append((source, layer, e, leaves))
        return leaves

    def accumulate(self) -> None:
        """After a microbatch's backward: each source's gradient of this rank's experts, into its tree."""
        if not self.canonical:
            return
        if self._pushed == self.k:
            raise RuntimeError(
                f"StackedExperts.accumulate(): {self.k} microbatches a step were declared, and "
                "reduce() was not called after the last. Fix: call reduce() at the step's end"
            )
        for (layer, name, source), tree in self._trees.items():
            local = self.params[layer][name].to_local()  # type: ignore[attr-defined]
            grad = torch.zeros_like(local)
            # the eager loop's experts each add a one-slice gradient of the whole parameter: zeros plus a -0.0
            # is +0.0 where two or more were hit; the grouped product writes each slice once
            summed = self.loop == "eager" and self._hit.get((source, layer), 0) > 1
            for s, lay, e, leaves in self._open:
                g = leaves[name].grad
                if s == source and lay == layer and g is not None:
                    j = e - self.rank * self.per_rank
                    if summed:
                        grad[j].add_(g)
                    else:
                        grad[j].copy_(g)
            tree.push(grad)
        self._open.clear()
        self._hit.clear()
        self._pushed += 1

    def reduce(self) -> None:
        """The step's gradient of each expert parameter into its ``.grad``: each source's tree over its
        microbatches, the sources in rank order."""
        if not self.canonical:
            for p in self.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return
        if self._pushed != self.k:
            raise RuntimeError(
                f"StackedExperts.reduce() after {self._pushed} of {self.k} microbatches. Fix: call "
                "accumulate() after each microbatch's backward"
            )
        from torch.distributed.tensor import DTensor

        for layer, named in self.params.items():
            for name, p in named.items():
                sources = BinaryCounter()
                for s in range(self.size):
                    sources.push(self._trees[(layer, name, s)].result())
                p.grad = DTensor.from_local(
                    sources.result(),
                    p.device_mesh,
                    p.placements,  # type: ignore
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
        self._pushed = 0

    def forward(
        self,
        module: torch.nn.Module,
        exchange: ExpertExchange,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """The module's experts loop (transformers' eager or grouped_mm one) with each expert's rows run on its
        rank (see the module docstring)."""
        run = self._eager if self.loop == "eager" else self._grouped
        out = run(module, exchange, hidden_states, top_k_index, top_k_weights)
        for source, routed in enumerate(exchange.table):
            self._hit[(source, exchange.layer)] = sum(1 for n in routed if n)
        return out

    def _call(self, module: torch.nn.Module) -> Callable[[int, dict[str, torch.Tensor], torch.Tensor], torch.Tensor]:
        return lambda e, weights, rows: self.expert(module, weights, rows)

    def _eager(
        self,
        module: torch.nn.Module,
        exchange: ExpertExchange,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """transformers' eager loop: an expert's rows gathered by its own index op, each expert's weighted
        output index-added into zeros in expert order."""
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.experts + 1).permute(2, 1, 0)
        rows, counts, where = [], [], []
        for e in range(self.experts):
            slot, token = torch.where(mask[e])
            if token.numel():
                rows.append(hidden_states[token])
            counts.append(int(token.numel()))
            where.append((slot, token))
        out = exchange.run(torch.cat(rows) if rows else hidden_states[:0], counts, self._call(module))
        start = 0
        for e, (slot, token) in enumerate(where):
            if counts[e]:
                part = out[start : start + counts[e]] * top_k_weights[token, slot, None]
                final.index_add_(0, token, part.to(final.dtype))
                start += counts[e]
        return final

    def _grouped(
        self,
        module: torch.nn.Module,
        exchange: ExpertExchange,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """transformers' grouped_mm loop: the (token, slot) pairs sorted by expert and gathered by one index op,
        each expert's rows its own product (the grouped product's per group), the weighted outputs put back in
        pair order and summed over the slots."""
        tokens, k = top_k_index.shape
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))
        rows = hidden_states[perm // k]
        weights = top_k_weights.reshape(-1)[perm]
        counts = torch.bincount(expert_ids, minlength=self.experts).tolist()
        out = exchange.run(rows, counts, self._call(module)) * weights.unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.size(0), device=perm.device)
        return out[inverse].view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def transformers_expert(module: torch.nn.Module, weights: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """One expert as transformers' eager loop computes it for a gated module without biases (Mixtral's): the
    fused gate and up projection, the gate (``_apply_gate``: the activation of the first half times the
    second), the down projection."""
    gated = module._apply_gate(torch.nn.functional.linear(rows, weights["gate_up_proj"]))  # type: ignore
    return torch.nn.functional.linear(gated, weights["down_proj"])


def _default_expert(module: torch.nn.Module) -> Expert:
    """``transformers_expert`` where the module is what it computes; refused by name otherwise."""
    names = {n for n, _ in module.named_parameters(recurse=False)}
    unlike = [flag for flag in ("has_bias", "is_transposed") if getattr(module, flag, False)]
    if names != {"gate_up_proj", "down_proj"} or unlike or not hasattr(module, "_apply_gate"):
        raise ValueError(
            f"parallelize_experts: {type(module).__name__} (parameters {sorted(names)}"
            f"{', ' + ', '.join(unlike) if unlike else ''}) is not a gated transformers experts module "
            "without biases, which the default expert computes. Fix: pass expert=, one expert's "
            "computation as the module's forward makes it"
        )
    return transformers_expert


def parallelize_experts(
    model: torch.nn.Module,
    experts: type,
    mesh: Any,
    expert: Expert | None = None,
    *,
    microbatches_per_process: int,
    canonical: bool = True,
) -> StackedExperts:
    """Spreads the experts of every ``experts`` module of ``model`` (transformers' ``MixtralExperts``: stacked
        parameters, ``forward(hidden_states, top_k_index, top_k_weights)``) over ``mesh``, a 1-D DeviceMesh of the
        data ranks, each rank still training its own microbatches. ``expert(module, weights, rows)`` is one expert's
        computation as the model's own forward makes it (weights by parameter name, each expert's slice; by default
    ``transformers_expert``). Call it
        before building the optimizer (the parameters become DTensors); pass ``parameters()`` of the result to
        nothing else that sums gradients. Refused by name: a model without such a module, a mesh of more than one
        dimension, an expert count the mesh size does not divide, parameters of unlike expert counts."""
    from torch.distributed.tensor import Shard, distribute_tensor

    modules = [m for m in model.modules() if isinstance(m, experts)]
    if not modules:
        raise ValueError(
            f"parallelize_experts: the model has no module of class {experts.__name__}. Fix: pass the "
            "class of the model's stacked-experts modules (transformers' MixtralExperts, say)"
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"parallelize_experts: a mesh of {mesh.ndim} dimensions {tuple(mesh.mesh_dim_names or ())};"
            " the experts are spread over all data ranks. Fix: pass a 1-D mesh of the data ranks"
        )
    counts = {tuple(p.shape[:1]) for m in modules for p in m.parameters(recurse=False)}
    if len(counts) != 1 or not next(iter(counts)):
        raise ValueError(
            f"parallelize_experts: {experts.__name__}'s parameters stack unlike expert counts "
            f"(first dimensions {sorted(counts)}). Fix: every parameter of the module one row per "
            "expert"
        )
    (count,), size = next(iter(counts)), mesh.size()
    if count % size:
        raise ValueError(
            f"parallelize_experts: {count} experts over {size} ranks. Fix: a number of ranks that divides {count}"
        )
    # transformers' experts forward by config._experts_implementation; a module of one's own is the eager loop
    loop = getattr(getattr(modules[0], "config", None), "_experts_implementation", None) or "eager"
    if loop not in ("eager", "grouped_mm"):
        raise ValueError(
            f"parallelize_experts: {experts.__name__} runs the {loop!r} experts implementation, whose "
            "order the spread experts do not follow. Fix: experts_implementation='eager' or "
            "'grouped_mm' in the model's config"
        )
    expert = expert or _default_expert(modules[0])
    for m in modules:
        for name, p in list(m.named_parameters(recurse=False)):
            m.register_parameter(
                name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]), requires_grad=p.requires_grad)
            )
    spread = StackedExperts(modules, mesh, expert, microbatches_per_process, canonical, loop)
    for layer, m in enumerate(modules):
        exchange = ExpertExchange(mesh.get_group(), size, spread.rank, spread.per_rank, spread, layer)  # type: ignore
        m.forward = types.MethodType(_forward_of(spread, exchange), m)
    return spread


def _forward_of(spread: StackedExperts, exchange: ExpertExchange) -> Callable[..., torch.Tensor]:
    def forward(
        module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return spread.forward(module, exchange, hidden_states, top_k_index, top_k_weights)

    return forward

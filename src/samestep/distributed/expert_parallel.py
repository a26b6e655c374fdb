"""Expert parallelism on the canonical tree: a mixture-of-experts layer's experts spread over the ranks of an
expert-parallel group, tokens sent to their expert's rank and back by all-to-all (docs/layouts.md, "Expert
parallelism").

What keeps one process's bits:
- routing, the rows' order (grouped by expert, token order inside) and the combine stay on the rank that owns
  the tokens, as one process computes them;
- an expert's owner runs it on each source rank's rows apart (``ExpertExchange.run``): the same operation on
  the same rows as one process runs for that microbatch;
- each of those runs computes on fresh leaves of the expert's parameters (``ExpertGradients.leaves``), so a
  microbatch's gradient of an expert stays apart from another rank's microbatch's in the same backward; after
  each microbatch they are pushed into one canonical tree per source rank, and at the step's end the sources'
  trees are combined in rank order, then across the replicas of the expert (other expert-parallel groups) as
  the canonical reduction combines data ranks: the tree over global microbatch indices.
"""

from __future__ import annotations

from typing import Any

import torch

from samestep.distributed.reduce import tree_across_ranks
from samestep.distributed.tree import BinaryCounter

__all__ = ["ExpertExchange", "ExpertGradients", "all_to_all"]


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with split sizes, whose backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        import torch.distributed as dist

        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """Rows ``send[r]`` of ``x`` (in order) to rank r of ``group``; rows ``recv[r]`` from each, in rank order.
    Differentiable."""
    return _AllToAll.apply(x, send, recv, group)


class ExpertGradients:
    """The canonical tree of each expert parameter of this rank, over the microbatches of every source rank.

    ``leaves(expert, source)`` gives fresh leaves of an expert's parameters for one source rank's rows (the
    forward computes on them); ``accumulate()`` after each microbatch's backward pushes their gradients
    (zeros where one got none) into the source's tree; ``reduce()`` combines the sources' trees in rank order,
    then over ``replicas`` (the expert-data group: this expert on the other expert-parallel groups, in their
    order), and sets each parameter's ``.grad``.

    ``canonical=False`` is the usual way instead (deterministic mode off): the experts' own parameters take every
    source's rows, autograd adds them into ``p.grad`` as they come, and the replicas all-reduce it."""

    def __init__(
        self, experts: dict[Any, torch.nn.Module], sources: int, replicas: Any = None, canonical: bool = True
    ) -> None:
        self.experts, self.sources, self.replicas = experts, sources, replicas  # experts by a key: (layer, index)
        self.canonical = canonical
        self.params = [p for e in sorted(experts) for p in experts[e].parameters()]
        self._counters = {(id(p), s): BinaryCounter() for p in self.params for s in range(sources)}
        self._open: list[tuple[int, Any, dict[str, torch.Tensor]]] = []  # this microbatch's (source, key, leaves)

    def leaves(self, expert: Any, source: int) -> dict[str, torch.Tensor]:
        """Fresh leaves of the parameters (by name) of the expert keyed ``expert``, for ``source``'s rows of
        this microbatch."""
        if not self.canonical:
            return dict(self.experts[expert].named_parameters())
        leaves = {n: p.detach().requires_grad_() for n, p in self.experts[expert].named_parameters()}
        self._open.append((source, expert, leaves))
        return leaves

    def accumulate(self) -> None:
        """After a microbatch's backward: each source's gradient of each expert parameter, one leaf each."""
        if not self.canonical:
            return
        got: dict[tuple[int, Any, str], torch.Tensor] = {}
        for source, expert, leaves in self._open:
            for name, t in leaves.items():
                if t.grad is not None:
                    got[(source, expert, name)] = t.grad
        self._open.clear()
        for e in sorted(self.experts):
            for n, p in self.experts[e].named_parameters():
                for s in range(self.sources):
                    g = got.get((s, e, n))
                    self._counters[(id(p), s)].push(g if g is not None else torch.zeros_like(p))

    def reduce(self) -> None:
        """The step's gradient of each expert parameter into its ``.grad``: the sources' trees in rank order,
        then the replicas'."""
        if not self.canonical:
            import torch.distributed as dist

            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if self.replicas is not None:
                    dist.all_reduce(p.grad, group=self.replicas)
            return
        for p in self.params:
            sources = BinaryCounter()
            for s in range(self.sources):
                sources.push(self._counters[(id(p), s)].result())
                self._counters[(id(p), s)].clear()
            p.grad = tree_across_ranks([sources.result()], self.replicas)


class ExpertExchange:
    """One MoE layer's tokens to their experts' ranks and back, over an expert-parallel ``group`` of ``size``
    ranks (this one ``rank``), each holding ``per_rank`` consecutive experts; ``grads`` makes the leaves of
    the experts keyed (``layer``, index)."""

    def __init__(self, group: Any, size: int, rank: int, per_rank: int, grads: ExpertGradients, layer: int) -> None:
        self.group, self.size, self.rank, self.per_rank, self.grads = group, size, rank, per_rank, grads
        self.layer = layer
        self.table: list[list[int]] = []

    def run(self, rows: torch.Tensor, counts: list[int], call: Any) -> torch.Tensor:
        """The experts' outputs for ``rows`` (grouped by expert, ``counts[e]`` rows of expert e): each sent to its
        expert's rank, run there on each source's rows apart (``call(expert, params, rows)``), and returned in
        ``rows``' order."""
        import torch.distributed as dist

        m = self.per_rank
        mine = torch.tensor(counts, dtype=torch.int64, device=rows.device)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        table = [t.tolist() for t in every]  # table[s][e]: rows source s sends expert e
        self.table = table  # the last call's, for a caller that needs what each source routed
        send = [sum(counts[r * m : (r + 1) * m]) for r in range(self.size)]
        recv = [sum(table[s][self.rank * m : (self.rank + 1) * m]) for s in range(self.size)]
        received = all_to_all(rows, send, recv, self.group)
        outs, start = [], 0
        for s in range(self.size):
            for j in range(m):
                e = self.rank * m + j
                n = table[s][e]
                outs.append(call(e, self.grads.leaves((self.layer, e), s), received[start : start + n]))
                start += n
        out = torch.cat(outs) if outs else received
        return all_to_all(out, recv, send, self.group)

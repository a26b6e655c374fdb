"""``KeyedSampler``: a shuffled order that a resume can re-enter part-way through an epoch.

Epoch ``e`` visits ``range(n)`` in the permutation drawn from ``samestep.rng.key(seed, e, 0,
"data-order")``, a pure function of the seed and the epoch (no global RNG is drawn), so the order of an
epoch is known again at any time, and ``resume_at(k)`` makes the next pass start at its ``k``-th sample.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from samestep.determinism import rng

__all__ = ["KeyedSampler"]


class KeyedSampler(torch.utils.data.Sampler[int]):
    """Indices of a ``n``-sample dataset in a counter-keyed shuffled order; ``set_epoch`` picks the epoch
    (frameworks call it), ``resume_at`` the sample the next pass starts at."""

    def __init__(self, n: int, seed: int = 0) -> None:
        if n < 1:
            raise ValueError(f"KeyedSampler(n={n!r}): a dataset of at least one sample")
        self.n, self.seed = n, seed
        self.epoch = 0
        self._start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, sample: int) -> None:
        """The next pass starts at the ``sample``-th index of the epoch's order (once)."""
        if not 0 <= sample <= self.n:
            raise ValueError(f"KeyedSampler.resume_at({sample!r}): an epoch has {self.n} samples")
        self._start = sample

    def order(self, epoch: int) -> list[int]:
        g = rng.generator(self.seed, epoch, 0, "data-order")
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0
        yield from self.order(self.epoch)[start:]

    def __len__(self) -> int:
        return self.n

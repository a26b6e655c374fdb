"""A DTensor's shard on this rank, and a shard placed back as a DTensor: the two moves every canonical reduction
makes around PyTorch's DTensor parameters and gradients, written once."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["local_shard", "placed", "spec_of"]


def _is_dtensor(t: object) -> bool:
    return type(t).__name__ == "DTensor"


def local_shard(t: Any) -> Any:
    """A DTensor's shard on this rank (the storage its in-place updates change); any other tensor, or None,
    itself. Where autograd has nothing to record (grad mode off, as in an autograd function's forward and
    backward and an optimizer's step, or a tensor that needs no gradient: a gradient, an optimizer state),
    the DTensor's own local tensor, as its operators take it; else ``to_local()``, whose autograd node carries a
    gradient back (its node and wrapper cost about 4 us a call, which the TP path's step makes hundreds of)."""
    if not _is_dtensor(t):
        return t
    return t.to_local() if t.requires_grad and torch.is_grad_enabled() else t._local_tensor


def spec_of(t: Any) -> Any:
    """A DTensor's spec (mesh, placements, global shape, stride and dtype: DTensor's own record of its layout,
    which its operators hand on as is), or None for another tensor: what a tensor laid out as ``t``'s shard is
    placed by (``placed``)."""
    return t._spec if _is_dtensor(t) else None


def placed(local: torch.Tensor | None, spec: Any) -> torch.Tensor | None:
    """``local`` (laid out as this rank's shard of a DTensor of ``spec``) as a DTensor lying as ``spec`` says;
    ``local`` itself where ``spec`` is None. Wrapped as DTensor's operators wrap their outputs, without
    ``from_local``'s autograd node and spec checks (a sixth of a canonical layer's own time in a small model's
    backward); a gradient or a scaled copy of one needs neither."""
    if local is None or spec is None:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)

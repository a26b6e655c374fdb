"""Routes PyTorch's own scatter-type ops to samestep's deterministic kernels, with no model change.

Pushed by ``samestep.enable(kernels=True)`` as a TorchDispatchMode (below autograd, so gradients are
unchanged in meaning). Covered ATen ops:

| ATen op | routed when | to |
|---|---|---|
| ``index_put``, ``index_put_``, ``_index_put_impl_`` | ``accumulate=True``, tensors on leading dims | ``index_put`` |
| ``index_add``, ``index_add_`` | always | ``index_add`` |
| ``scatter_add``, ``scatter_add_`` | always | ``scatter_add`` |
| ``embedding_dense_backward`` | ``scale_grad_by_freq=False`` | ``embedding_backward`` |

Anything else runs as PyTorch runs it.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from samestep.ops import _impl

__all__ = ["KernelMode", "ROUTED"]

aten = torch.ops.aten
ROUTED = ("aten.index_put", "aten.index_put_", "aten._index_put_impl_", "aten.index_add", "aten.index_add_",
          "aten.scatter_add", "aten.scatter_add_", "aten.embedding_dense_backward")


def _inplace(self: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    self.copy_(result)
    return self


class KernelMode(TorchDispatchMode):
    """Replaces the ops in ``ROUTED`` by samestep's deterministic implementations."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in (aten.index_put, aten.index_put_, aten._index_put_impl_):
            accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
            indices = args[1]
            if accumulate and indices and all(i is not None for i in indices):
                out = _impl.index_put(args[0], tuple(indices), args[2], True)
                return out if packet is aten.index_put else _inplace(args[0], out)
        elif packet in (aten.index_add, aten.index_add_) and func._overloadname == "default":
            alpha = args[4] if len(args) > 4 else kwargs.get("alpha", 1)
            out = _impl.index_add(args[0], args[1], args[2], args[3], alpha)
            return out if packet is aten.index_add else _inplace(args[0], out)
        elif packet in (aten.scatter_add, aten.scatter_add_) and func._overloadname == "default":
            out = _impl.scatter_add(*args[:4])
            return out if packet is aten.scatter_add else _inplace(args[0], out)
        elif packet is aten.embedding_dense_backward:
            grad, indices, num_weights, padding_idx, scale = args[:5]
            if not scale:
                return _impl.embedding_backward(grad, indices, num_weights, padding_idx)
        return func(*args, **kwargs)

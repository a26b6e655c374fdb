"""What samestep's kernels accept, and PyTorch's own error for what they do not.

Each kernel checks that its inputs lie in the domain it computes (dtypes, shapes, index bounds). Outside
it, PyTorch's own op is run on the same inputs, so the user gets PyTorch's error, its exception type and
a message in the user's coordinates, not one about a flattened view. Should PyTorch accept inputs that a
kernel cannot compute, the kernel refuses by name rather than return another answer (docs/kernels.md,
"Domain and errors").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

__all__ = ["INDEX_DTYPES", "check_bounds", "counted_from_end", "overlaps", "raise_as_torch"]

INDEX_DTYPES = (torch.int64, torch.int32)


def raise_as_torch(call: Callable[[], Any], op: str, why: str) -> NoReturn:
    """Raises the error PyTorch's own ``call()`` raises on these inputs; if it raises none, refuses.

    The call runs with deterministic algorithms off, so that PyTorch reports the input error rather
    than the absence of a deterministic kernel; its result, if any, is discarded.
    """
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        call()
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    raise NotImplementedError(
        f"samestep.ops.{op}: {why}; PyTorch accepts these inputs but samestep's deterministic "
        f"kernel does not compute them. Fix: call torch's own {op} here, outside "
        "samestep.enable(kernels=True)"
    )


def check_bounds(index: torch.Tensor, size: int, *, negative: bool) -> bool:
    """Whether every index lies in ``[0, size)``, or in ``[-size, size)`` where ``negative`` indices count
    from the end. One pass, and one host sync per call on a device."""
    if not index.numel():
        return True
    low, high = torch.aminmax(index)
    return bool(low >= (-size if negative else 0)) and bool(high < size)


def counted_from_end(index: torch.Tensor, size: int) -> torch.Tensor | None:
    """``index`` with its negative entries counted from the end, or None where an entry lies outside
    ``[-size, size)``: the bounds and the sign in one pass (and one host sync on a device)."""
    if not index.numel():
        return index
    low, high = (int(v) for v in torch.aminmax(index))
    if low < -size or high >= size:
        return None
    return index.remainder(size) if low < 0 else index


def _extent(t: torch.Tensor) -> tuple[int, int]:
    if not t.numel():
        return 0, 0
    start = t.data_ptr()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if st > 0)
    return start, start + (last + 1) * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory ranges intersect (an in-place op writing ``a`` while reading ``b``)."""
    if a.device != b.device or not a.numel() or not b.numel():
        return False
    a0, a1 = _extent(a)
    b0, b1 = _extent(b)
    return a0 < b1 and b0 < a1

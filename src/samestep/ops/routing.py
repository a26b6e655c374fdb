"""Routes PyTorch's own scatter-type ops to samestep's deterministic kernels, with no model change.

Pushed by ``samestep.enable(kernels=True)`` as a TorchDispatchMode (below autograd, so gradients are
unchanged in meaning, and PyTorch's backward formulas reach the kernels too). Every overload of a routed op
is routed, its ``out=`` forms writing the answer into ``out``; an in-place destination whose elements share
memory (expanded) is PyTorch's kernel's, named in a warning. Tensors without values (on the meta device, or
fake ones a compiler traces) go to PyTorch's own op: only shapes are computed there. ``torch.compile``
compiles under the mode, which routes the compiled code's ATen fallbacks (``KernelMode.ignore_compile_internals``).
``ROUTED`` lists what is routed and when; every other accumulating op is listed in ``UNROUTED`` with the reason
PyTorch's own kernel is kept, and on a device where that kernel may race (not the CPU) with deterministic
algorithms off, the mode warns once by name rather than stay silent. docs/kernels.md has both tables.
"""

from __future__ import annotations

import warnings

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from samestep.ops import _impl, _indexing
from samestep.ops._domain import overlaps

__all__ = ["KernelMode", "ROUTED", "UNROUTED"]

aten = torch.ops.aten

# ATen op -> when it is routed. Every form of each: functional, in place, and out= (into ``out``, resized as
# PyTorch resizes it).
ROUTED: dict[str, str] = {
    "aten.index_put": "accumulate=True, any index form (tensors, masks, None between them)",
    "aten.index_put_": "accumulate=True, any index form",
    "aten._index_put_impl_": "accumulate=True, any index form",
    "aten._unsafe_index_put": "accumulate=True, any index form",
    "aten._unsafe_masked_index_put_accumulate": "always",
    "aten.put": "accumulate=True",
    "aten.put_": "accumulate=True",
    "aten.index_add": "always",
    "aten.index_add_": "always",
    "aten.scatter_add": "always",
    "aten.scatter_add_": "always",
    "aten.scatter_reduce": "reduce='sum' or 'mean'",
    "aten.scatter_reduce_": "reduce='sum' or 'mean'",
    "aten.scatter": "reduce='add' with a tensor src",
    "aten.scatter_": "reduce='add' with a tensor src",
    "aten.embedding_dense_backward": "scale_grad_by_freq=False",
    "aten.bincount": "with weights",
}

# Accumulating ATen ops left to PyTorch, and why that is safe on the CPU (each is tested to repeat there).
UNROUTED: dict[str, str] = {
    "aten.scatter_reduce": "'prod', 'amax', 'amin': PyTorch's CPU kernel reduces each output serially",
    "aten.scatter": "reduce='multiply', or a scalar value: PyTorch's CPU kernel reduces each output serially",
    "aten.index_reduce": "PyTorch's CPU kernel reduces each output serially",
    "aten.embedding_dense_backward": "scale_grad_by_freq=True: PyTorch's CPU kernel splits work by weight row",
    "aten._embedding_bag_backward": "PyTorch's CPU kernel adds each bag's rows serially",
    "aten._embedding_bag_dense_backward": "PyTorch's CPU kernel adds each bag's rows serially",
    "aten._embedding_bag_per_sample_weights_backward": "one output per index: nothing to order",
    "aten._segment_reduce_backward": "one output per input element: nothing to order",
    "aten.bincount": "without weights: integer counts are exact in any order",
    "aten.histc": "integer counts (exact in float32 up to 2^24) in any order",
}
_UNROUTED_PACKETS = {getattr(aten, name.split(".", 1)[1]) for name in UNROUTED}
_ROUTED_PACKETS = {getattr(aten, name.split(".", 1)[1]) for name in ROUTED}


def _tensors(args, kwargs):
    """The tensors among an ATen call's arguments: top-level, or in a list (``index_put``'s indices)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _shapes_only(args, kwargs) -> bool:
    """Whether the op computes no values: a tensor on the meta device (a model built there), or a fake one (a
    compiler tracing shapes, ``FakeTensorMode``). The kernels read index values (bounds, tiles), which such
    tensors do not have."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(t.device.type == "meta" or isinstance(t, FakeTensor) for t in _tensors(args, kwargs))


def _in_place(func, args, kwargs, compute):
    """``compute(args)`` writing into ``args[0]``. Where self overlaps memory it reads, PyTorch's own call
    runs first, on self, and raises as PyTorch does; where it raises nothing, the read operands are copied
    first, so samestep's answer is the one written."""
    self = args[0]
    if any(overlaps(self, t) for t in _tensors(args[1:], {})):
        copies = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, args[1:])
        func(*args, **kwargs)
        args = (self, *copies)
    return compute(args)


def _arg(args, kwargs, position: int, name: str, default=None):
    return args[position] if len(args) > position else kwargs.get(name, default)


# an out= overload -> the overload whose arguments it takes, less ``out``
_FUNCTIONAL_OF = {
    "out": "default",
    "two_out": "two",
    "reduce_out": "reduce",
    "src_out": "src",
    "value_out": "value",
    "value_reduce_out": "value_reduce",
}


def _writes_out(func) -> bool:
    return any(a.is_out for a in func._schema.arguments)


def _into(func, args, kwargs, result):
    """An out= overload's ``result`` (computed fresh) written into its ``out``, as PyTorch writes one: resized to
    the result's shape (PyTorch's ``resize_output``, which warns where it resizes a non-empty tensor). Where
    ``out`` overlaps an argument PyTorch's own call runs first, and raises as PyTorch does."""
    out = kwargs["out"]
    if any(overlaps(out, t) for t in _tensors(args, {})):
        func(*args, **kwargs)
    if out.shape != result.shape:
        if out.numel():
            warnings.warn(
                f"An output with one or more elements was resized since it had shape "
                f"{list(out.shape)}, which does not match the required output shape "
                f"{list(result.shape)} (PyTorch's resize_output warning: resize out to zero elements, "
                "out.resize_(0), to reuse it)",
                UserWarning,
                stacklevel=4,
            )
        out.resize_(result.shape)
    return out.copy_(result)


class KernelMode(TorchDispatchMode):
    """Replaces the ops in ``ROUTED`` by samestep's deterministic implementations."""

    def __init__(self) -> None:
        super().__init__()
        self._warned: set[str | tuple[str, str]] = set()

    _eager_warned = False  # the one warning of compiled code run eagerly (deterministic algorithms turned off)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile compiles under the mode (a mode that does not say so makes Dynamo skip every frame) and
        runs the compiled code under it: Inductor, under deterministic algorithms, calls the routed ops as
        ATen fallbacks, which the mode routes. With them turned off Inductor would write its own racing
        kernels for these ops, so Dynamo is told no and the code runs eagerly, routed, with one warning."""
        if torch.are_deterministic_algorithms_enabled():
            return True
        if not cls._eager_warned:
            cls._eager_warned = True
            warnings.warn(
                "samestep kernels: torch.compile runs eagerly here: deterministic algorithms were turned off "
                "after samestep.enable(kernels=True), and Inductor would then write its own racing kernels for "
                "the accumulating ops. Fix: leave torch.use_deterministic_algorithms on",
                RuntimeWarning,
                stacklevel=2,
            )
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet not in _ROUTED_PACKETS:  # every other op, at once: the mode's cost on a model's other ops
            if packet in _UNROUTED_PACKETS:
                self._warn_if_racy(func, args)
            return func(*args, **kwargs)
        # no values to compute (meta, fake): PyTorch's shapes, dtypes and errors are the answer
        routed = NotImplemented if _shapes_only(args, kwargs) else self._route(func, args, kwargs)
        if routed is not NotImplemented:
            return routed
        if packet in _UNROUTED_PACKETS:  # a form left to PyTorch (scatter_reduce's 'prod', say)
            self._warn_if_racy(func, args)
        return func(*args, **kwargs)

    def _fall_back(self, packet, why: str) -> None:
        """Warns once for ``packet`` that a call ``why`` goes to PyTorch's own kernel (its bits, serial under
        deterministic algorithms), not samestep's."""
        name = str(packet)
        if (name, why) in self._warned:
            return
        self._warned.add((name, why))
        warnings.warn(
            f"samestep kernels: {name} {why} is left to PyTorch's own kernel: its bits, not samestep's "
            "(deterministic algorithms keep it in one order)",
            RuntimeWarning,
            stacklevel=4,
        )

    def _warn_if_racy(self, func, args) -> None:
        name = str(func.overloadpacket)
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if (
            device is None
            or device.type == "cpu"
            or torch.are_deterministic_algorithms_enabled()
            or name in self._warned
        ):
            return
        self._warned.add(name)
        warnings.warn(
            f"samestep kernels: {name} is not routed to a deterministic kernel, and with "
            f"torch.use_deterministic_algorithms off it may race on {device.type}. Fix: "
            "samestep.enable(kernels=True), which turns deterministic algorithms on",
            RuntimeWarning,
            stacklevel=3,
        )

    def _route(self, func, args, kwargs):
        if not _writes_out(func):
            return self._values(func, func._overloadname, args, kwargs)
        out = kwargs.get("out")
        rest = {k: v for k, v in kwargs.items() if k != "out"}
        result = self._values(func, _FUNCTIONAL_OF.get(func._overloadname, ""), args, rest)
        if (
            result is NotImplemented
            or not isinstance(out, torch.Tensor)
            or out.dtype != result.dtype
            or out.device != result.device
        ):
            return NotImplemented  # another dtype or device for out: PyTorch's own rules (casts, errors)
        return _into(func, args, kwargs, result)

    def _values(self, func, overload: str, args, kwargs):
        """The op's result as a new tensor (in place: written into ``args[0]``), or NotImplemented where it is not
        routed; ``overload``: the functional form's name (an out= overload's twin)."""
        packet = func.overloadpacket
        inplace = str(packet).endswith("_")
        if inplace and isinstance(args[0], torch.Tensor) and torch._debug_has_internal_overlap(args[0]) == 1:
            self._fall_back(packet, "into a tensor whose elements share memory (expanded)")
            return NotImplemented  # PyTorch adds every contribution into the shared memory; a fold cannot write it

        def run(compute):  # in place: into args[0]; else a new tensor
            return _in_place(func, args, kwargs, lambda a: compute(a, a[0])) if inplace else compute(args, None)

        if packet in (aten.index_put, aten.index_put_, aten._index_put_impl_, aten._unsafe_index_put):
            if not _arg(args, kwargs, 3, "accumulate", False) or _indexing.index_put_by_torch(args[0], args[1]):
                return NotImplemented  # PyTorch's own kernel computes the definition
            return run(lambda a, out: _indexing.index_put(a[0], a[1], a[2], True, out=out))
        if packet is aten._unsafe_masked_index_put_accumulate:
            x, mask, indices, values = args[:4]
            if not x.numel():
                return x.clone()
            indices = [i if i is None else i.clamp(-x.size(d), x.size(d) - 1) for d, i in enumerate(indices)]
            return _indexing.index_put(x, indices, values.masked_fill(~mask, 0), True)
        if packet in (aten.put, aten.put_):
            if not _arg(args, kwargs, 3, "accumulate", False) or _indexing.put_by_torch(args[0], args[1]):
                return NotImplemented  # PyTorch's own kernel computes the definition
            return run(lambda a, out: _indexing.put(a[0], a[1], a[2], True, out=out))
        if packet in (aten.index_add, aten.index_add_) and overload == "default":
            alpha = _arg(args, kwargs, 4, "alpha", 1)
            return run(lambda a, out: _impl.index_add(*a[:4], alpha, out=out))
        if (packet in (aten.scatter_add, aten.scatter_add_) and overload == "default") or (
            packet in (aten.scatter, aten.scatter_)
            and overload == "reduce"
            and _arg(args, kwargs, 4, "reduce") == "add"
        ):
            return run(lambda a, out: _impl.scatter_add(*a[:4], out=out))
        if packet in (aten.scatter_reduce, aten.scatter_reduce_) and overload == "two":
            reduce = args[4]
            if reduce not in ("sum", "mean"):
                return NotImplemented
            include_self = _arg(args, kwargs, 5, "include_self", True)
            result = run(lambda a, out: _impl.scatter_reduce(*a[:4], reduce, include_self, out=out))
            return result
        if packet is aten.embedding_dense_backward:
            grad, indices, num_weights, padding_idx, scale = args[:5]
            return NotImplemented if scale else _impl.embedding_backward(grad, indices, num_weights, padding_idx)
        if packet is aten.bincount:
            weights = _arg(args, kwargs, 1, "weights")
            if weights is None:
                return NotImplemented
            return _impl.bincount(args[0], weights, _arg(args, kwargs, 2, "minlength", 0))
        return NotImplemented

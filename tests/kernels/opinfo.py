"""PyTorch's own OpInfo samples run through samestep's kernels: routed (``KernelMode``) and direct
(``samestep.ops``), each compared with PyTorch's own op on the same sample.

For one sample, ``check_sample`` returns the ways samestep's answer departs from PyTorch's (empty when it
does not): the same outputs and gradients (the dtype's tolerance; exact for integers; for float16 and
bfloat16 an answer within tolerance of the float64 one also passes, since samestep accumulates those in
float32 where some PyTorch kernels round at every addition), the same dtypes, shapes and strides, the
same error where PyTorch raises, and the same bytes over a rerun and at 1 and 2 threads.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import pytest
import torch

# PyTorch's test scaffolding freezes torch.backends flags for the whole process on import; the rest of the
# suite sets them as a user's code does, so the import runs without that (tests/kernels/test_edges.py shows
# samestep.enable() working while they are frozen).
with pytest.MonkeyPatch.context() as patch:
    patch.setattr(torch.backends, "disable_global_flags", lambda: None)
    from torch.testing._internal.common_methods_invocations import op_db

import samestep.ops as ops
from samestep.ops.routing import KernelMode

# Every OpInfo whose forward or backward reaches an accumulating op samestep routes or lists (routing.py).
SWEPT = (
    "index_add",
    "scatter_add",
    "scatter_reduce.sum",
    "scatter_reduce.mean",
    "scatter_reduce.prod",
    "scatter_reduce.amax",
    "scatter_reduce.amin",
    "scatter",
    "index_put",
    "index_reduce.prod",
    "index_reduce.mean",
    "index_reduce.amax",
    "index_reduce.amin",
    "nn.functional.embedding",
    "nn.functional.embedding_bag",
    "gather",
    "index_select",
    "take",
    "take_along_dim",
    "put",
    "bincount",
    "_segment_reduce.lengths",
    "_segment_reduce.offsets",
    "_unsafe_masked_index",
    "_unsafe_masked_index_put_accumulate",
    "__getitem__",
)
DB = {(o.name + "." + o.variant_test_name).rstrip("."): o for o in op_db}
DTYPES = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)
HALF = (torch.float16, torch.bfloat16)

# samestep.ops called on the same sample as the OpInfo (its signature is torch's).
DIRECT: dict[str, Callable[..., Any]] = {
    "index_add": ops.index_add,
    "scatter_add": ops.scatter_add,
    "scatter_reduce.sum": ops.scatter_reduce,
    "scatter_reduce.mean": ops.scatter_reduce,
    "index_put": ops.index_put,
    "bincount": ops.bincount,
}


def cases() -> list[tuple[str, torch.dtype]]:
    """Every (OpInfo, dtype) of the sweep that PyTorch supports on the CPU."""
    return [(name, dt) for name in SWEPT for dt in DTYPES if dt in DB[name].supported_dtypes("cpu")]


def samples(name: str, dtype: torch.dtype) -> Iterator[tuple[str, Any, bool]]:
    """``(label, sample, requires_grad)``: sample and reference inputs, with gradients where the op has
    them, and once more without (in-place variants and the no-grad path)."""
    op = DB[name]
    grad = bool(op.supports_autograd and dtype.is_floating_point)
    for requires_grad in (True, False) if grad else (False,):
        sources = [
            ("sample", op.sample_inputs("cpu", dtype, requires_grad=requires_grad)),
            ("reference", op.reference_inputs("cpu", dtype, requires_grad=requires_grad)),
        ]
        for kind, it in sources:
            for i, s in enumerate(it):
                yield f"{name} {str(dtype)[6:]} {kind}#{i}{' grad' if requires_grad else ''}", s, requires_grad


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    if isinstance(x, dict):
        return [t for k in x for t in _tensors(x[k])]
    return []


def _bytes(ts: list[torch.Tensor]) -> list[tuple]:
    out = []
    for t in ts:
        t = t.detach()
        t = t.to(torch.uint8) if t.dtype == torch.bool else t
        out.append((t.dtype, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()))
    return out


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides (an expanded tensor, which nothing may write, is shared)."""
    if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    out.copy_(t.detach())
    return out.requires_grad_(t.requires_grad)


def _run(fn: Callable[[Any], Any], s: Any, grad: bool, cotangent_dtype: torch.dtype | None = None):
    """Outputs, and the gradients of every input that requires one against a seeded cotangent, on a copy
    of the sample (some ops write into an input: embedding_bag's max_norm renormalises its weight)."""
    s = s.transform(_copy)
    out = fn(s)
    if not grad:
        return _tensors(out), []
    outs = [t for t in _tensors(s.output_process_fn_grad(out)) if t.requires_grad]
    ins = [t for t in _tensors((s.input, s.args, s.kwargs)) if t.requires_grad]
    if not outs or not ins:
        return _tensors(out), []
    gen = torch.Generator().manual_seed(7)
    cts = [torch.randn(o.shape, generator=gen).to(cotangent_dtype or o.dtype).to(o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, ins, cts, allow_unused=True)
    return _tensors(out), [torch.zeros(()) if g is None else g for g in grads]


def _differ(ref: list[torch.Tensor], got: list[torch.Tensor]) -> str | None:
    if len(ref) != len(got):
        return f"{len(got)} tensors, PyTorch {len(ref)}"
    for k, (r, g) in enumerate(zip(ref, got)):
        if (r.dtype, r.shape) != (g.dtype, g.shape):
            return f"tensor {k}: {g.dtype}{list(g.shape)}, PyTorch {r.dtype}{list(r.shape)}"
        if r.numel() > 1 and r.stride() != g.stride() and not (r.is_contiguous() and g.is_contiguous()):
            return f"tensor {k}: strides {g.stride()}, PyTorch {r.stride()}"
        try:
            torch.testing.assert_close(g.detach(), r.detach(), equal_nan=True, check_stride=False)
        except AssertionError as e:
            return f"tensor {k}: " + " ".join(str(e).split("\n")[:4])
    return None


def _upcast(s: Any) -> Any:
    return s.transform(lambda t: t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t)


def _call(op: Any, fn: Callable[..., Any] | None = None) -> Callable[[Any], Any]:
    f = fn or op
    return lambda s: f(s.input, *s.args, **s.kwargs)


def _reference(op: Any, s: Any, grad: bool):
    """PyTorch's answer with deterministic algorithms on, or off where it has no deterministic kernel."""
    for deterministic in (True, False):
        torch.use_deterministic_algorithms(deterministic)
        try:
            return _run(_call(op), s, grad)
        except RuntimeError as e:
            if deterministic and "does not have a deterministic implementation" in str(e):
                continue
            return e
        except Exception as e:  # noqa: BLE001 - PyTorch's own error is the expected answer
            return e
        finally:
            torch.use_deterministic_algorithms(False)


def _in_threads(n: int, fn: Callable[[], Any]) -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def check_sample(name: str, s: Any, grad: bool, dtype: torch.dtype) -> list[str]:
    """The ways samestep's answers to one sample depart from PyTorch's (empty: none)."""
    op = DB[name]
    ref = _reference(op, s, grad)
    found = []
    ways = [("routed", _call(op), True)] + ([("direct", _call(op, DIRECT[name]), False)] if name in DIRECT else [])
    for way, fn, routed in ways:

        def attempt(threads: int = 2):
            with KernelMode() if routed else nullcontext():
                return _in_threads(threads, lambda: _run(fn, s, grad))

        try:
            got = attempt()
        except Exception as e:  # noqa: BLE001 - compared with PyTorch's own error below
            if not isinstance(ref, Exception):
                found.append(f"{way}: raised {type(e).__name__}: {e}; PyTorch gives a result")
            elif type(e) is not type(ref) or str(e) != str(ref):
                found.append(f"{way}: raised {type(e).__name__}: {e}; PyTorch raises {type(ref).__name__}: {ref}")
            continue
        if isinstance(ref, Exception):
            found.append(f"{way}: gave a result; PyTorch raises {type(ref).__name__}: {ref}")
            continue
        for part, r, g in (("output", ref[0], got[0]), ("gradient", ref[1], got[1])):
            why = _differ(r, g)
            if why and dtype in HALF:
                exact = _run(_call(op), _upcast(s), grad, cotangent_dtype=dtype)
                exact = [t.to(dtype) if t.dtype == torch.float64 else t for t in exact[0 if part == "output" else 1]]
                why = why if _differ(exact, g) else None  # within tolerance of the float64 answer
            if why:
                found.append(f"{way} {part}: {why}")
        for threads in (2, 1):
            again = attempt(threads)
            if _bytes(again[0] + again[1]) != _bytes(got[0] + got[1]):
                found.append(f"{way}: other bytes on a rerun at {threads} thread(s)")
    if (
        not grad
        and op.inplace_variant is not None
        and isinstance(s.input, torch.Tensor)
        and not isinstance(ref, Exception)
    ):
        found += _check_inplace(op, s)
    return found


def _check_inplace(op: Any, s: Any) -> list[str]:
    """The in-place variant, routed, writes what PyTorch's writes (or raises what it raises)."""

    def inplace(routed: bool):
        x = _copy(s.input.detach())
        torch.use_deterministic_algorithms(not routed)
        try:
            with KernelMode() if routed else nullcontext():
                op.inplace_variant(x, *s.args, **s.kwargs)
            return x
        except Exception as e:  # noqa: BLE001
            return e
        finally:
            torch.use_deterministic_algorithms(False)

    ref, got = inplace(False), inplace(True)
    if isinstance(ref, RuntimeError) and "does not have a deterministic implementation" in str(ref):
        return []  # compared out of place already
    if isinstance(ref, Exception) or isinstance(got, Exception):
        same = type(ref) is type(got) and str(ref) == str(got)
        return [] if same else [f"in place: {got!r}; PyTorch {ref!r}"]
    why = _differ([ref], [got])
    return [f"in place: {why}"] if why else []


def check_error_inputs(name: str) -> list[str]:
    """Each OpInfo error input raises PyTorch's error type and message, routed and direct (and PyTorch's
    own op raises it too: the control that the expectation is right)."""
    op = DB[name]
    if op.error_inputs_func is None:
        return []
    found = []
    for i, ei in enumerate(op.error_inputs("cpu")):
        s = ei.sample_input
        ways = [("pytorch", _call(op), False), ("routed", _call(op), True)]
        if name in DIRECT:
            ways.append(("direct", _call(op, DIRECT[name]), False))
        for way, fn, routed in ways:
            try:
                with KernelMode() if routed else nullcontext():
                    fn(s)
                found.append(f"error input {i}, {way}: no error; expected {ei.error_type.__name__} {ei.error_regex!r}")
            except Exception as e:  # noqa: BLE001
                if not (isinstance(e, ei.error_type) and re.search(ei.error_regex, str(e))):
                    found.append(
                        f"error input {i}, {way}: {type(e).__name__}: {e}; expected "
                        f"{ei.error_type.__name__} {ei.error_regex!r}"
                    )
    return found

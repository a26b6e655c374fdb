"""Deterministic mode: one switch that sets, validates and records every knob.

``samestep.enable()`` is the only place in samestep that changes process-global numerics settings
(torchtitan's ``set_determinism``). It validates before it sets, so a setting that would break the
determinism contract fails closed with a message that names the knob, its value and the fix.
``samestep.disable()`` (or leaving the ``with`` block) restores what was there before.

    report = samestep.enable(threads=2)
    print(report)            # what was set, and why
    ...
    samestep.disable()
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from samestep.determinism import numerics
from samestep.distributed.group import group_up

__all__ = [
    "DeterminismReport",
    "Knob",
    "active_report",
    "available_threads",
    "current_knobs",
    "disable",
    "drifted",
    "enable",
    "is_enabled",
    "knob_probe",
]

# cuBLAS picks a reduction split per call unless its workspace is fixed to one of these sizes;
# both are documented by NVIDIA as making cuBLAS deterministic.
CUBLAS_WORKSPACE_VALUES = (":4096:8", ":16:8")
# NCCL's Ring algorithm reduces in a fixed order for a fixed world size; Tree, CollNet and NVLS
# pick topology-dependent orders (and NVLS reduces in switch hardware).
NCCL_ALGO_VALUE = "Ring"


@dataclass(slots=True)
class Knob:
    """One setting that deterministic mode owns."""

    name: str
    before: Any
    after: Any
    why: str


@dataclass(slots=True)
class DeterminismReport:
    """What ``enable()`` set; printable, JSON-able, and a context manager that undoes it."""

    knobs: list[Knob] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    threads: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able view, stored in ``run.json``."""
        return {
            "threads": self.threads,
            "knobs": {k.name: {"before": k.before, "after": k.after, "why": k.why} for k in self.knobs},
            "warnings": list(self.warnings),
        }

    def __str__(self) -> str:
        width = max((len(k.name) for k in self.knobs), default=0)
        lines = ["samestep deterministic mode:"]
        for k in self.knobs:
            change = f"{k.after!r}" if k.before == k.after else f"{k.before!r} -> {k.after!r}"
            lines.append(f"  {k.name:<{width}}  {change}  ({k.why})")
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def __enter__(self) -> DeterminismReport:
        return self

    def __exit__(self, *exc: object) -> None:
        disable()


# The settings that were in force before enable() (disable() puts them back) and the last report.
_saved: dict[str, Any] | None = None


def available_threads() -> int:
    """The number of CPUs this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def is_enabled() -> bool:
    """Whether ``enable()`` is in force in this process."""
    return _saved is not None


def active_report() -> DeterminismReport | None:
    """The report of the ``enable()`` in force, or None when deterministic mode is off."""
    return _saved["report"] if _saved is not None else None


def _kernels_on() -> bool:
    return bool(_saved is not None and _saved.get("kernel_mode"))


# How to read each knob that enable() sets, by the name its report gives it: a fixed table, since drifted()
# runs at every traced step.
_READERS: dict[str, Callable[[], Any]] = {
    "torch.use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled,
    "torch.backends.cudnn.deterministic": lambda: torch.backends.cudnn.deterministic,
    "torch.backends.cudnn.benchmark": lambda: torch.backends.cudnn.benchmark,
    "torch.utils.deterministic.fill_uninitialized_memory": lambda: torch.utils.deterministic.fill_uninitialized_memory,
    "torch.num_threads": torch.get_num_threads,
    "samestep.kernels": _kernels_on,
    **{k.name: k.get for k in numerics.KNOBS},
}


def _c_reader(name: str) -> Callable[[], Any]:
    return getattr(torch._C, name, lambda: None)  # a torch without it has no such knob to change


# A cheap change detector over every knob that enable() sets: PyTorch's own C getters where there are
# (a Python property per knob costs tens of microseconds once a training step has evicted the caches).
_PROBE: tuple[Callable[[], Any], ...] = (
    torch.are_deterministic_algorithms_enabled,
    _c_reader("_get_cudnn_deterministic"),
    _c_reader("_get_cudnn_benchmark"),
    _c_reader("_get_deterministic_fill_uninitialized_memory"),
    torch.get_num_threads,
    _kernels_on,
    _c_reader("_get_float32_matmul_precision"),
    _c_reader("_get_cublas_allow_tf32"),
    _c_reader("_get_cudnn_allow_tf32"),
    _c_reader("_get_cublas_allow_fp16_reduced_precision_reduction"),
    _c_reader("_get_cublas_allow_bf16_reduced_precision_reduction"),
    _c_reader("_get_cudnn_sdp_enabled"),
    _c_reader("_get_math_sdp_allow_fp16_bf16_reduction"),
    *[k.get for k in numerics.KNOBS if k.name == "torch._inductor.config.deterministic"],
)


def knob_probe() -> tuple:
    """Values that change whenever a knob ``enable()`` sets does (``drifted`` then says which): what a
    loop checks at every step, at a fraction of ``drifted``'s cost."""
    return tuple([read() for read in _PROBE])


def current_knobs() -> dict[str, Any]:
    """The values now of the knobs that ``enable()`` sets, by the names its report gives them."""
    return {name: read() for name, read in _READERS.items()}


def drifted(report: DeterminismReport) -> dict[str, tuple[Any, Any]]:
    """The knobs that no longer hold what ``report``'s ``enable()`` set (a loop changed them behind its
    back, e.g. ``torch.use_deterministic_algorithms(False)``): {name: (set, now)}."""
    out = {}
    for k in report.knobs:
        read = _READERS.get(k.name)
        if read is not None and (now := read()) != k.after:
            out[k.name] = (k.after, now)
    return out


def _cuda_initialized() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _nccl_initialized() -> bool:
    import torch.distributed as dist

    if not group_up():
        return False
    return "nccl" in str(dist.get_backend()).lower()


def _check_env(problems: list[str], report: DeterminismReport, fixed: dict[str, str]) -> None:
    """Validates the environment variables that must be right before CUDA or NCCL start."""
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if cublas is None:
        if _cuda_initialized():
            problems.append(
                "CUBLAS_WORKSPACE_CONFIG is not set and CUDA is already initialised, so setting it now "
                "may not reach cuBLAS. Fix: call samestep.enable() before any CUDA work, or export "
                f"CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE_VALUES[0]} before starting Python."
            )
        fixed["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_VALUES[0]
    elif cublas not in CUBLAS_WORKSPACE_VALUES:
        problems.append(
            f"CUBLAS_WORKSPACE_CONFIG={cublas!r} does not make cuBLAS deterministic. Fix: set it to "
            f"{CUBLAS_WORKSPACE_VALUES[0]!r} or {CUBLAS_WORKSPACE_VALUES[1]!r}, or unset it and let "
            "samestep.enable() set it."
        )
    report.knobs.append(
        Knob(
            "env.CUBLAS_WORKSPACE_CONFIG",
            cublas,
            fixed.get("CUBLAS_WORKSPACE_CONFIG", cublas),
            "fixed cuBLAS workspace: no run-to-run split-K choice",
        )
    )

    algo = os.environ.get("NCCL_ALGO")
    if algo is None:
        if _nccl_initialized():
            problems.append(
                "NCCL_ALGO is not set and an NCCL process group already exists, so NCCL may use Tree "
                "or NVLS. Fix: call samestep.enable() before init_process_group, or export "
                f"NCCL_ALGO={NCCL_ALGO_VALUE}."
            )
        fixed["NCCL_ALGO"] = NCCL_ALGO_VALUE
    elif algo.strip().lower() != NCCL_ALGO_VALUE.lower():
        problems.append(
            f"NCCL_ALGO={algo!r} lets NCCL choose reduction orders by topology (Tree, CollNet and NVLS "
            f"are not bitwise reproducible). Fix: set NCCL_ALGO={NCCL_ALGO_VALUE}, or unset it."
        )
    report.knobs.append(
        Knob("env.NCCL_ALGO", algo, fixed.get("NCCL_ALGO", algo), "ring all-reduce: fixed order per world size")
    )


def _settable() -> contextlib.AbstractContextManager:
    """Lets the backend flags be set where PyTorch's test scaffolding froze them
    (``torch.backends.disable_global_flags()``): ``disable()`` puts back what ``enable()`` sets."""
    return getattr(torch.backends, "__allow_nonbracketed_mutation", contextlib.nullcontext)()


def enable(*, threads: int | None = None, warn_only: bool = False, kernels: bool = False) -> DeterminismReport:
    """Turns on deterministic mode for this process.

    Args:
        threads: the intra-op thread count to pin (sums and layer-norm weight gradients change with
            it). ``None`` takes the CPUs this process may use.
        warn_only: report settings that break determinism as warnings instead of raising.
        kernels: route PyTorch's accumulating ops (index_put and put with accumulate, index_add,
            scatter_add, scatter_reduce sum and mean, embedding backward, weighted bincount) to
            ``samestep.ops`` in this thread, forward and backward (docs/kernels.md lists each op). Off by
            default: with deterministic algorithms on, PyTorch already runs these deterministically on
            CPU; the routing is for speed (index_put), and for a definition that does not depend on the
            device.

    Returns:
        A report of every knob, its value before and after, and why it is set. It is also a context
        manager: leaving the ``with`` block calls ``disable()``.

    Raises:
        ValueError: a user setting breaks determinism (names the variable, its value and the fix).
    """
    global _saved
    if threads is None:
        threads = available_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"enable(threads={threads!r}): the thread count must be an integer >= 1")

    report = DeterminismReport(threads=threads)
    problems: list[str] = []
    fixed_env: dict[str, str] = {}
    _check_env(problems, report, fixed_env)
    problems += numerics.compiler_problems()
    if problems:
        if not warn_only:
            raise ValueError("samestep.enable() refused: " + " | ".join(problems))
        for p in problems:
            warnings.warn(p, RuntimeWarning, stacklevel=2)
        report.warnings.extend(problems)

    saved = (
        _saved
        if _saved is not None
        else {
            "env": {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO")},
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
            "threads": torch.get_num_threads(),
            "numerics": numerics.values(),
        }
    )

    os.environ.update(fixed_env)
    with _settable():
        _set_knobs(saved, report, threads)
    if kernels and saved.get("kernel_mode") is None:
        from samestep.ops.routing import KernelMode  # loaded only when asked for (kernels=True)

        saved["kernel_mode"] = KernelMode()
        saved["kernel_mode"].__enter__()
    report.knobs.append(
        Knob("samestep.kernels", False, bool(saved.get("kernel_mode")), "scatter-type ops routed to samestep.ops")
    )
    saved["report"] = report  # the last enable()'s (samestep.trace records it in run.json)
    _saved = saved
    return report


def _set_knobs(saved: dict[str, Any], report: DeterminismReport, threads: int) -> None:
    # Ops without a deterministic implementation raise instead of silently racing.
    torch.use_deterministic_algorithms(True)
    report.knobs.append(
        Knob("torch.use_deterministic_algorithms", saved["deterministic"], True, "nondeterministic kernels raise")
    )
    torch.backends.cudnn.deterministic = True
    report.knobs.append(
        Knob(
            "torch.backends.cudnn.deterministic",
            saved["cudnn_deterministic"],
            True,
            "deterministic cuDNN algorithms only",
        )
    )
    # Autotuning picks algorithms by timing, which differs between runs.
    torch.backends.cudnn.benchmark = False
    report.knobs.append(
        Knob("torch.backends.cudnn.benchmark", saved["cudnn_benchmark"], False, "no timing-based algorithm choice")
    )
    # With deterministic algorithms on, PyTorch fills every torch.empty() with NaN so that reads of
    # uninitialised memory are reproducible; that costs a memory pass per allocation (Megatron's
    # largest determinism overhead). Correct kernels never read that memory, so skipping the fill
    # changes no result; a kernel that does read it shows up as a trace divergence whose inputs all
    # matched (an origin), which is how samestep finds it instead of paying for the fill everywhere.
    torch.utils.deterministic.fill_uninitialized_memory = False
    report.knobs.append(
        Knob(
            "torch.utils.deterministic.fill_uninitialized_memory",
            saved["fill_uninitialized_memory"],
            False,
            "skip NaN-filling empty tensors; correct kernels never read them",
        )
    )
    # CPU reductions split work by thread, so their bits depend on the thread count.
    torch.set_num_threads(threads)
    report.knobs.append(
        Knob("torch.num_threads", saved["threads"], threads, "sums and layer-norm grads depend on the thread count")
    )
    _pin_numerics(saved["numerics"], report)


def _pin_numerics(before: dict[str, Any], report: DeterminismReport) -> None:
    """Matmul precision, reduced-precision reductions, attention backends, the compiler (determinism/numerics.py)."""
    for knob in numerics.KNOBS:
        knob.set(knob.value)
        report.knobs.append(Knob(knob.name, before[knob.name], knob.value, knob.why))


def disable() -> None:
    """Restores every knob ``enable()`` changed to its value before the first ``enable()``."""
    global _saved
    if _saved is None:
        return
    saved, _saved = _saved, None
    if saved.get("kernel_mode") is not None:
        saved["kernel_mode"].__exit__(None, None, None)
    for name, value in saved["env"].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    torch.use_deterministic_algorithms(saved["deterministic"], warn_only=saved["deterministic_warn_only"])
    with _settable():
        torch.backends.cudnn.deterministic = saved["cudnn_deterministic"]
        torch.backends.cudnn.benchmark = saved["cudnn_benchmark"]
        torch.utils.deterministic.fill_uninitialized_memory = saved["fill_uninitialized_memory"]
        torch.set_num_threads(saved["threads"])
        for knob in reversed(numerics.KNOBS):  # matmul precision last: setting it sets allow_tf32 too
            knob.set(saved["numerics"][knob.name])

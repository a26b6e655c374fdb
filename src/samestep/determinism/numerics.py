"""The numerics knobs beyond deterministic algorithms that ``samestep.enable()`` pins: matmul precision
(TF32, bf16 inputs), reduced-precision reductions, the attention backends, and the compiler.

Each knob reads and sets one process-global setting. None of them needs a GPU to be read or set: on a
CPU-only build the CUDA ones hold their values for when CUDA is used. The compiler's knob is
``torch._inductor.config.deterministic`` (Inductor picks kernels without timing them), which
``torch.use_deterministic_algorithms`` sets too; reading it imports Inductor's config, as that call does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["KNOBS", "PinnedKnob", "compiler_problems", "values"]

# Inductor settings that choose kernels by timing them on the device: refused in deterministic mode.
TIMED = {
    "max_autotune": "TORCHINDUCTOR_MAX_AUTOTUNE",
    "max_autotune_gemm": "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM",
    "max_autotune_pointwise": "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE",
    "coordinate_descent_tuning": "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING",
}


@dataclass(frozen=True, slots=True)
class PinnedKnob:
    """One setting, how to read and set it, the value deterministic mode pins, and why."""

    name: str
    get: Callable[[], Any]
    set: Callable[[Any], None]
    value: Any
    why: str


def _inductor_config() -> Any:
    import torch._inductor.config as config  # what torch.use_deterministic_algorithms imports too

    return config


def _attr(owner: Any, name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    return (lambda: getattr(owner, name)), (lambda v: setattr(owner, name, v))


_cuda = torch.backends.cuda
KNOBS: tuple[PinnedKnob, ...] = (
    PinnedKnob(
        "torch.float32_matmul_precision",
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
        "highest",
        "fp32 matmuls take fp32 inputs: no TF32 (CUDA), no bf16 (CPU)",
    ),
    PinnedKnob(
        "torch.backends.cuda.matmul.allow_tf32",
        *_attr(_cuda.matmul, "allow_tf32"),
        False,
        "no TF32 rounding of fp32 matmul inputs",
    ),
    PinnedKnob(
        "torch.backends.cudnn.allow_tf32",
        *_attr(torch.backends.cudnn, "allow_tf32"),
        False,
        "no TF32 in cuDNN convolutions",
    ),
    PinnedKnob(
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
        *_attr(_cuda.matmul, "allow_fp16_reduced_precision_reduction"),
        False,
        "fp16 matmuls accumulate in fp32 whatever cuBLAS's split-K heuristics pick",
    ),
    PinnedKnob(
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
        *_attr(_cuda.matmul, "allow_bf16_reduced_precision_reduction"),
        False,
        "bf16 matmuls accumulate in fp32 whatever cuBLAS's split-K heuristics pick",
    ),
    PinnedKnob(
        "torch.backends.cuda.cudnn_sdp",
        _cuda.cudnn_sdp_enabled,
        _cuda.enable_cudnn_sdp,
        False,
        "cuDNN attention has no deterministic backward: SDPA picks flash, memory-efficient or "
        "math, whose backwards are deterministic under torch.use_deterministic_algorithms",
    ),
    PinnedKnob(
        "torch.backends.cuda.fp16_bf16_reduction_math_sdp",
        _cuda.fp16_bf16_reduction_math_sdp_allowed,
        _cuda.allow_fp16_bf16_reduction_math_sdp,
        False,
        "math attention in fp16/bf16 reduces in fp32",
    ),
    PinnedKnob(
        "torch._inductor.config.deterministic",
        lambda: _inductor_config().deterministic,
        lambda v: setattr(_inductor_config(), "deterministic", v),
        True,
        "torch.compile picks kernels without timing them (no autotuning by benchmark)",
    ),
)


def values() -> dict[str, Any]:
    """Every knob's value now, by name."""
    return {k.name: k.get() for k in KNOBS}


def compiler_problems() -> list[str]:
    """Inductor settings in force that choose kernels by timing (max-autotune, coordinate descent), each
    with the fix; deterministic mode refuses them."""
    config = _inductor_config()
    out = []
    for name, env in TIMED.items():
        if getattr(config, name, False):
            out.append(
                f"torch._inductor.config.{name} is on ({env}): it picks compiled kernels by timing them, "
                f"which differs run to run. Fix: turn it off (unset {env}; torch.compile without "
                "mode='max-autotune')"
            )
    return out

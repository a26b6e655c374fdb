"""Environment fingerprint: everything the determinism contract depends on, as a flat dict.

Bitwise determinism holds within one environment (docs/design.md, "The contract"). Every run and every
checkpoint records ``environment()``; ``compare_environments(a, b)`` names the fields that differ,
``numerics_differences(a, b)`` those of them that can change a bit (what diff and replay compare), and
``rank_differences`` compares every process of a job with rank 0 (a job on several machines is as many
environments as machines: a node with another torch build, driver or CPU feature set computes other bits).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import sys
from typing import Any

import torch

from samestep.determinism import numerics
from samestep.distributed.gather import gather_if_different

__all__ = [
    "ENV_VARS",
    "RANK_LOCAL",
    "compare_environments",
    "describe_rank_differences",
    "environment",
    "numerics_differences",
    "rank_differences",
]

# Environment variables that change numerics or the collective algorithm.
ENV_VARS = (
    "CUBLAS_WORKSPACE_CONFIG",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_NVLS_ENABLE",
    "NCCL_COLLNET_ENABLE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "OPENBLAS_CORETYPE",
    "MKL_CBWR",
    "ATEN_CPU_CAPABILITY",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONHASHSEED",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "NVIDIA_TF32_OVERRIDE",
)


@functools.cache  # fixed for the process's life: read once, not at every checkpoint
def _cpu() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu.machine": platform.machine(), "cpu.count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return info
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.M)
    info["cpu.model"] = model.group(1).strip() if model else None
    # Only the instruction-set flags that select different kernels matter; the full list also holds
    # flags (e.g. hypervisor bugs) that vary between identical hosts.
    if flags:
        wanted = re.compile(r"^(sse\d.*|ssse3|avx.*|fma|f16c|amx.*|sve.*|asimd.*|neon|bf16|fp16)$")
        info["cpu.flags"] = " ".join(sorted(f for f in flags.group(1).split() if wanted.match(f)))
    return info


@functools.cache  # fixed for the process's life: read once, not at every checkpoint
def _build() -> dict[str, Any]:
    config = torch.__config__.show()

    def field(name: str) -> str | None:
        m = re.search(rf"{name}=([^,\s]+)", config)
        return m.group(1) if m else None

    parallel = torch.__config__.parallel_info()
    backend = re.search(r"ATen parallel backend: (.*)", parallel)
    mkl = re.search(r"(Intel\(R\) oneAPI Math Kernel Library Version [^\n]*?)(?: for|\n)", config)
    return {
        "torch.blas": field("BLAS_INFO"),
        "torch.lapack": field("LAPACK_INFO"),
        "torch.mkl": mkl.group(1) if mkl else None,
        "torch.mkldnn": torch.backends.mkldnn.is_available(),
        "torch.openmp": torch.backends.openmp.is_available(),
        "torch.parallel_backend": backend.group(1).strip() if backend else None,
        "torch.cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch.git": torch.version.git_version,
    }


def _cuda() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cuda.version": torch.version.cuda,
        "cuda.hip": getattr(torch.version, "hip", None),
        "cuda.cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cuda.available": torch.cuda.is_available(),
    }
    if not torch.cuda.is_available():
        return info
    try:
        info["cuda.nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # builds without NCCL
        info["cuda.nccl"] = None
    info["cuda.device_count"] = torch.cuda.device_count()
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        info[f"cuda.gpu{i}"] = f"{props.name} sm_{props.major}{props.minor} {props.total_memory}B"
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            line = f.readline()
        m = re.search(r"Kernel Module\s+(\S+)", line)
        info["cuda.driver"] = m.group(1) if m else line.strip()
    except OSError:
        info["cuda.driver"] = None
    info["cuda.matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    info["cuda.cudnn_allow_tf32"] = torch.backends.cudnn.allow_tf32
    return info


@functools.cache  # fixed for the process's life: read once, not at every checkpoint
def _versions() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {}
    for pkg in ("numpy", "safetensors", "triton", "samestep"):
        try:
            out[f"package.{pkg}"] = version(pkg)
        except PackageNotFoundError:
            out[f"package.{pkg}"] = None
    return out


def environment() -> dict[str, Any]:
    """The environment fingerprint of this process: a flat, JSON-able dict with dotted keys.

    Returns:
        Python, platform, CPU, torch build (BLAS, OpenMP, CPU capability), CUDA/cuDNN/NCCL and GPUs,
        package versions, thread counts, determinism settings and the relevant environment variables.
    """
    env: dict[str, Any] = {
        "python.version": platform.python_version(),
        "python.implementation": platform.python_implementation(),
        "platform.system": platform.system(),
        "platform.release": platform.release(),
        "platform.libc": " ".join(platform.libc_ver()).strip() or None,
        "torch.version": torch.__version__,
    }
    env.update(_cpu())
    env.update(_build())
    env.update(_cuda())
    env.update(_versions())
    env.update(
        {
            "threads.intra_op": torch.get_num_threads(),
            "threads.inter_op": torch.get_num_interop_threads(),
            "determinism.algorithms": torch.are_deterministic_algorithms_enabled(),
            "determinism.cudnn_deterministic": torch.backends.cudnn.deterministic,
            "determinism.cudnn_benchmark": torch.backends.cudnn.benchmark,
            "determinism.fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
            "python.byteorder": sys.byteorder,
        }
    )
    env.update({f"numerics.{name}": value for name, value in numerics.values().items()})
    for name in ENV_VARS:
        env[f"env.{name}"] = os.environ.get(name)
    return env


def compare_environments(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The fields on which two fingerprints differ.

    Args:
        a: one fingerprint, as returned by ``environment()`` (or read back from JSON).
        b: the other.

    Returns:
        ``{field: (value_in_a, value_in_b)}`` for every field that differs or is present on one side
        only (``None`` stands for absent), sorted by field name.
    """
    missing = object()
    out: dict[str, tuple[Any, Any]] = {}
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:
            out[key] = (None if va is missing else va, None if vb is missing else vb)
    return out


# Fields that differ between the processes of one healthy job and change no bit: which GPU a process is
# bound to, and how many cores its machine has (deterministic mode pins the thread count).
RANK_LOCAL = frozenset({"env.CUDA_VISIBLE_DEVICES", "cpu.count"})
# Thread-count variables that change no bit where both sides ran with the same intra-op thread count:
# torch.set_num_threads (which samestep.enable calls) sizes the OpenMP and MKL pools whatever they said.
THREAD_VARS = frozenset({"env.OMP_NUM_THREADS", "env.MKL_NUM_THREADS"})


def numerics_differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The fields of two fingerprints that can change a bit: ``compare_environments`` less the ``RANK_LOCAL``
    fields, and less ``THREAD_VARS`` where both record the same intra-op thread count (a 1-process run
    against a torchrun one, whose launcher sets OMP_NUM_THREADS, under one pinned count)."""
    same_threads = a.get("threads.intra_op") is not None and a.get("threads.intra_op") == b.get("threads.intra_op")
    return {
        k: v
        for k, v in compare_environments(a, b).items()
        if k not in RANK_LOCAL and not (same_threads and k in THREAD_VARS)
    }


def rank_differences(env: dict[str, Any], device: torch.device | None = None) -> dict[int, dict[str, Any]]:
    """How each rank's fingerprint ``env`` differs from rank 0's, the same on every rank: ``{rank: {"host":
    its host name, "fields": {field: (rank 0's value, its value)}}}`` for each rank that differs; empty
    when all agree (one all-gather of a digest a rank), or without a process group. ``RANK_LOCAL`` fields
    are not compared. A collective: every rank of the default group calls it."""
    compared = {k: v for k, v in env.items() if k not in RANK_LOCAL}
    key = json.dumps(compared, sort_keys=True, default=str).encode()
    docs = gather_if_different(
        key, json.dumps({"host": platform.node(), "env": compared}, sort_keys=True, default=str).encode(), device
    )
    if docs is None:
        return {}
    first, *others = (json.loads(d) for d in docs)
    out: dict[int, dict[str, Any]] = {}
    for r, doc in enumerate(others, start=1):
        fields = compare_environments(first["env"], doc["env"])
        if fields:
            out[r] = {"host": doc["host"], "fields": fields}
    return out


def describe_rank_differences(diffs: dict[int, dict[str, Any]], limit: int = 4) -> str:
    """One line naming each rank that differs from rank 0, its host, and its first ``limit`` fields as
    ``field: rank 0's value -> its value``."""
    parts = []
    for r, d in sorted(diffs.items()):
        fields = d["fields"]
        shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(fields.items())[:limit])
        more = f" and {len(fields) - limit} more" if len(fields) > limit else ""
        parts.append(f"rank {r} (host {d['host']}): {shown}{more}")
    return "; ".join(parts)

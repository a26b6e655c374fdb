"""The run directory (format "samestep.run", version 1; docs/formats.md): the one module that names its
files, and writes and reads run.json (metrics.jsonl: ``metrics``; final.json: ``final``; its lock: ``lock``).

    RUN/run.json        config, environment, layout, determinism report, resumes
    RUN/metrics.jsonl   one line per step: loss and grad norm as exact bits (float.hex), lr, tokens
    RUN/final.json      the last step and the digest of the final state
    RUN/trace/          the trace streams (tracing/stream.py)
    RUN/receipts/       a receipt of every step (records/receipts.py)
    RUN/checkpoints/    the checkpoints (checkpoint/)

``samestep train`` writes all of it; ``samestep.trace`` gives a run of the user's own loop its
run.json; ``samestep diff``, ``samestep trace certify`` and ``samestep demo`` read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from samestep.determinism.env import environment
from samestep.exit_codes import Refusal
from samestep.hashing.state import dotted
from samestep.records.durable import read_file, replace_atomic
from samestep.version import __version__

__all__ = [
    "PathLike",
    "NUMERICS_NEUTRAL",
    "RUN_FORMAT",
    "RUN_VERSION",
    "RunDirError",
    "check_version",
    "checked_run_dir",
    "checkpoints_dir",
    "declared_changes",
    "determinism_diff",
    "final_path",
    "holds_run",
    "layout_at",
    "metrics_path",
    "new_run",
    "read_run",
    "receipts_dir",
    "record_close",
    "record_declared",
    "record_resume",
    "run_json",
    "run_writer",
    "trace_dir",
    "write_run",
]

RUN_FORMAT, RUN_VERSION = "samestep.run", 1
# Config fields that change no bit of a run's steps (bookkeeping, what is traced or checked and how, whether the state
# is sharded, when the combine starts): a resume may change them, and `samestep diff` does not compare them.
# (trace.perturb changes bits on purpose.)
NUMERICS_NEUTRAL = frozenset(
    {
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.log_every",
        "train.exit_signals",
        "train.receipts",
        "train.receipt_hash",
        "train.cross_rank_check",
        "train.sdc_check_every",
        "train.sdc_action",
        "train.nonfinite",
        "determinism.env_mismatch",
        "parallel.fsdp",
        "parallel.overlap",
        "parallel.tp",
        "parallel.pp",
        "parallel.pp_schedule",
        "parallel.ep",
        "trace.level",
        "trace.steps",
        "trace.ranks",
        "trace.copy",
        "trace.worker",
    }
)

PathLike = str | os.PathLike[str]


# -- the layout: every path of a run directory, named here only ------------------------------------------------
def run_json(run_dir: PathLike) -> Path:
    return Path(run_dir) / "run.json"


def metrics_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / "metrics.jsonl"


def final_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / "final.json"


def checkpoints_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def receipts_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / "receipts"


def trace_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / "trace"


def holds_run(run_dir: PathLike) -> bool:
    """Whether the directory holds a run (its run.json)."""
    return run_json(run_dir).exists()


def run_writer(doc: dict[str, Any]) -> str:
    """What wrote a run (its run.json ``doc``), in words: the reference trainer's config has a ``train``
    section, and nothing else writes one."""
    if "train" in (doc.get("config") or {}):
        return "samestep train's reference run"
    return "a loop of one's own (samestep.Run, a framework callback or samestep.trace)"


class RunDirError(Refusal):
    """A run directory is missing or one of its files is malformed."""


def _dump(doc: Any) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


# -- where a run may live -----------------------------------------------------------------------------------
_VIRTUAL = ("/proc", "/sys", "/dev")  # file systems of the kernel's, not storage


def checked_run_dir(run_dir: PathLike) -> Path:
    """``run_dir`` if a run can live there: a directory (or nothing yet) on a real file system, named by a path
    that resolves.

    Raises:
        RunDirError: the path is empty, a file, a FIFO, a symlink loop, too long, or under /proc, /sys or /dev;
            names it and the fix.
    """
    text = os.fspath(run_dir)
    if not str(text).strip():
        raise RunDirError("the run directory is '' (empty); name a directory, e.g. --run-dir runs/a")
    path = Path(run_dir)
    try:
        resolved = path.resolve(strict=False)
        exists = path.exists()
    except (OSError, RuntimeError) as e:  # a symlink loop (RuntimeError on some Pythons), a name too long
        raise RunDirError(
            f"{path}: cannot be used as a run directory ({getattr(e, 'strerror', None) or e}); choose another path"
        ) from None
    virtual = next((v for v in _VIRTUAL if resolved == Path(v) or Path(v) in resolved.parents), None)
    if virtual is not None:
        raise RunDirError(
            f"{path}: lies under {virtual}, a kernel file system, not storage; choose a directory on a disk"
        )
    if exists and not path.is_dir():
        raise RunDirError(f"{path}: is a file, not a directory; choose a directory for the run (or remove the file)")
    return path


LOCK = ".samestep.lock"  # the one writer's flock (records/lock.py)


# -- run.json -----------------------------------------------------------------------------------------------
def new_run(
    config: dict[str, Any], layout: dict[str, Any], determinism: dict[str, Any] | None, **fields: Any
) -> dict[str, Any]:
    """A new run.json document: the config, this environment, the layout, the report of the
    ``samestep.enable()`` in force (None if none), no resumes yet, and any further ``fields``."""
    return {
        "format": RUN_FORMAT,
        "version": RUN_VERSION,
        "samestep_version": __version__,
        "config": config,
        "environment": environment(),
        "layout": layout,
        "determinism": determinism,
        "resumes": [],
        **fields,
    }


def write_run(run_dir: PathLike, doc: dict[str, Any]) -> None:
    """Writes run.json (atomically, fsynced), creating the run directory if needed."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    replace_atomic(run_json(run_dir), _dump(doc))


def read_run(run_dir: PathLike) -> dict[str, Any]:
    """run.json, checked to be a samestep run.

    Raises:
        RunDirError: it is missing, not JSON, or of another format.
    """
    path = run_json(run_dir)
    try:
        doc = json.loads(read_file(path).decode("utf-8"))
    except FileNotFoundError:
        raise RunDirError(f"{path}: missing; {run_dir} is not a samestep run directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunDirError(f"{path}: not valid JSON ({e})") from None
    except IsADirectoryError:
        raise RunDirError(f"{path}: is a directory, not samestep's run.json") from None
    if not isinstance(doc, dict):
        raise RunDirError(f"{path}: is {type(doc).__name__}, expected a table (format {RUN_FORMAT!r})")
    if doc.get("format") != RUN_FORMAT:
        raise RunDirError(f"{path}: format {doc.get('format')!r} is not {RUN_FORMAT!r}")
    check_version(path, doc, RUN_VERSION)
    for field, kind in (("config", dict), ("environment", dict), ("layout", dict), ("resumes", list)):
        if field in doc and not isinstance(doc[field], kind):
            raise RunDirError(f"{path}: {field!r} is {doc[field]!r}, expected a {kind.__name__}")
    for layout in [doc.get("layout", {}), *doc.get("resumes", [])]:
        world = layout.get("world_size", 1) if isinstance(layout, dict) else None
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise RunDirError(f"{path}: a world_size is {world!r}, expected a positive integer")
    return doc


def record_resume(run_dir: PathLike, resume: dict[str, Any]) -> None:
    """Appends a resume record (the step resumed from, the layout it resumed on, ...) to run.json."""
    doc = read_run(run_dir)
    doc.setdefault("resumes", []).append(resume)
    write_run(run_dir, doc)


def layout_at(doc: dict[str, Any], step: int) -> dict[str, Any]:
    """The layout (``world_size``, ``sharded``: "fsdp2" or None, ``tensor_parallel``, ``pipeline_parallel`` and
    ``expert_parallel``: the degrees; of a loop of one's own, ``ddp``, ``meshes`` and ``placements``:
    ``distributed.placement.model_layout``'s) that wrote
    step ``step`` of the run whose run.json is ``doc``: the first segment's, or that of the last resume from
    a step before it (a later segment rewrites every step after the one it resumed from)."""
    layout = doc.get("layout", {})
    for resume in doc.get("resumes", []):
        if isinstance(resume, dict) and isinstance(resume.get("step"), int) and resume["step"] < step:
            layout = resume
    return {
        "world_size": layout.get("world_size", 1),
        "sharded": layout.get("sharded"),
        "tensor_parallel": layout.get("tensor_parallel", 1),
        "pipeline_parallel": layout.get("pipeline_parallel", 1),
        "expert_parallel": layout.get("expert_parallel", 1),
        "ddp": layout.get("ddp", False),
        "meshes": layout.get("meshes", []),
        "placements": layout.get("placements"),
    }


def record_declared(run_dir: PathLike, declared: dict[str, Any]) -> None:
    """Records (or extends) run.json's ``declared``: what a loop of one's own declares fixed for its whole run
    (``samestep.Run``): a resume under other values is refused."""
    doc = read_run(run_dir)
    doc["declared"] = {**doc.get("declared", {}), **declared}
    write_run(run_dir, doc)


def declared_changes(run_dir: PathLike, declared: dict[str, Any]) -> list[str]:
    """Where ``declared`` differs from what run.json's ``declared`` holds, as ``"name: then -> now"`` (none where
    run.json holds nothing, or no such name)."""
    path = run_json(run_dir)
    if not path.exists():
        return []
    then = dotted(read_run(run_dir).get("declared", {}))
    now = dotted(declared)
    return [f"{k}: {then[k]!r} -> {now[k]!r}" for k in sorted(set(then) & set(now)) if then[k] != now[k]]


def determinism_diff(det_a: dict[str, Any] | None, det_b: dict[str, Any] | None) -> dict[str, tuple[Any, Any]]:
    """What two run.json ``determinism`` records set differently: each knob's value after ``enable()``
    ({name: (a, b)}), or {"on": (a, b)} if one of them is null (deterministic mode off, or not recorded)."""
    if (det_a is None) != (det_b is None):
        return {"on": (det_a is not None, det_b is not None)}
    if det_a is None:
        return {}
    knobs_a, knobs_b = det_a.get("knobs", {}), det_b.get("knobs", {})
    out = {}
    for name in sorted(set(knobs_a) | set(knobs_b)):
        after = (knobs_a.get(name, {}).get("after"), knobs_b.get(name, {}).get("after"))
        if after[0] != after[1]:
            out[name] = after
    return out


def record_close(run_dir: PathLike, close: dict[str, Any], numerics_changed: dict[str, Any] | None = None) -> None:
    """Appends to run.json's ``closes`` that a trace segment was closed (by samestep.trace's recorder):
    ``{"segment", "failed_step", "records"}``: the last step whose context raised, or null, and the records
    the segment holds. A segment with no close
    was killed, or is still being written. ``numerics_changed``: deterministic mode stopped holding during
    the run (the first step it was seen, each knob as set and as found); the first such record stays, as
    ``determinism_changed``. One read and one write of run.json."""
    doc = read_run(run_dir)
    doc.setdefault("closes", []).append(close)
    if numerics_changed is not None:
        doc.setdefault("determinism_changed", numerics_changed)
    write_run(run_dir, doc)


def check_version(path: Path, doc: dict[str, Any], known: int) -> None:
    """Refuses a file of a format version this samestep does not know (1 to ``known``)."""
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= known:
        raise RunDirError(
            f"{path}: version {version!r} of format {doc.get('format')!r}; this samestep reads "
            f"versions 1 to {known} (a newer samestep wrote it: read it with that one)"
        )

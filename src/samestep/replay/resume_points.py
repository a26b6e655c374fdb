"""Where a replay enters a framework's run again: the checkpoints the Hugging Face Trainer and Lightning save
under samestep's callbacks, found from a run's run.json, and copied into a replay's scratch directory
(docs/formats.md, run.json's ``programs`` and ``checkpoints``).

- ``transformers.Trainer``: its ``checkpoint-N`` directories in the output directory its program records
  (``programs[].resumes.checkpoints``, relative to the run directory where it lies in it, so a copy of the
  run replays from its own copies), those that hold the callback's ``samestep.json`` (written after the
  Trainer's own files: the checkpoint is whole);
- ``lightning.Trainer``: the ``.ckpt`` files the callback saw Lightning write, each with its step, in
  run.json's ``checkpoints`` (``index``), the one a resume started from among them;
- ``torchtitan`` (``integrations.torchtitan``): the ``step-N`` directories of torchtitan's checkpoint folder
  (``programs[].resumes.checkpoints``) that hold DCP's ``.metadata`` (written last), ``step-0`` a seed
  checkpoint; a replay's copy goes where the job in the scratch directory looks for it (``resumes.folder``).

A ``samestep.Run``'s checkpoints are samestep's own (``checkpoint.committed_steps``); a program that records
no ``resumes`` is one. A replay reads only what lies inside the run directory: every recorded path is relative
to it and stays in it (``inside``), so that a copy or a move of a run is replayed from its own files, and a
run.json cannot point a replay at files elsewhere.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from samestep.records.rundir import RunDirError, read_run, write_run

__all__ = [
    "HF",
    "HF_FINGERPRINT",
    "LIGHTNING",
    "RUN",
    "TORCHTITAN",
    "index",
    "inside",
    "points",
    "resumed_by",
    "resumes",
    "stage",
]

RUN, HF, LIGHTNING, TORCHTITAN = "samestep.Run", "transformers.Trainer", "lightning.Trainer", "torchtitan"
HF_FINGERPRINT = "samestep.json"  # the callback's, in each of the Trainer's checkpoint-N directories


def resumes(by: str, run_dir: Path, checkpoints: Path | None = None) -> dict[str, Any]:
    """What a program records of how it resumes: the loop ``by``, and the directory it saves ``checkpoints``
    into (relative to ``run_dir`` where it lies in it)."""
    out: dict[str, Any] = {"by": by}
    if checkpoints is not None:
        where, base = Path(checkpoints).resolve(), Path(run_dir).resolve()
        out["checkpoints"] = str(where.relative_to(base)) if where.is_relative_to(base) else str(where)
    if by == TORCHTITAN and checkpoints is not None:
        out["folder"] = Path(checkpoints).name  # torchtitan's checkpoint.folder, in the job's dump folder
    return out


def inside(run_dir: Path, value: object, field: str) -> Path:
    """``value``, a path run.json's ``field`` records, resolved in ``run_dir``.

    Raises:
        RunDirError: it is not a relative path, or it leads out of the run directory (``..``, a link): names the
            field, the value and the fix.
    """
    if not isinstance(value, str) or not value or Path(value).is_absolute():
        raise RunDirError(
            f"{Path(run_dir) / 'run.json'}: {field}={value!r}: a replay reads only paths relative to the "
            "run directory, inside it; keep the framework's checkpoints in the run directory (a run "
            "recorded by an older version: move them in and record them relative to it)"
        )
    path = (Path(run_dir) / value).resolve()
    if not path.is_relative_to(Path(run_dir).resolve()):
        raise RunDirError(
            f"{Path(run_dir) / 'run.json'}: {field}={value!r} leads out of the run directory (to "
            f"{path}): a replay reads only files inside it"
        )
    return path


def _resumes(program: Any) -> dict[str, Any]:
    """A program record's ``resumes`` (empty where it has none, or something else than a table)."""
    resumes = program.get("resumes") if isinstance(program, dict) else None
    return resumes if isinstance(resumes, dict) else {}


def resumed_by(doc: dict[str, Any]) -> str:
    """The loop that saves a run's checkpoints (``RUN``, ``HF`` or ``LIGHTNING``), from its programs."""
    programs = [p for p in doc.get("programs", []) if isinstance(p, dict)]
    return _resumes(programs[-1]).get("by", RUN) if programs else RUN


def points(run_dir: Path, doc: dict[str, Any]) -> dict[int, Path]:
    """A framework run's checkpoints on disk, by the step each holds (empty for a ``samestep.Run``'s)."""
    by, found = resumed_by(doc), {}
    prefix, finished = {HF: ("checkpoint-", HF_FINGERPRINT), TORCHTITAN: ("step-", ".metadata")}.get(by, ("", ""))
    if prefix:
        for i, program in enumerate(doc.get("programs", [])):
            where = _resumes(program).get("checkpoints")
            if where is None:
                continue
            for path in inside(run_dir, where, f"programs[{i}].resumes.checkpoints").glob(prefix + "*"):
                step = path.name.removeprefix(prefix)
                if step.isdigit() and (path / finished).is_file():
                    found[int(step)] = inside(
                        run_dir, str(path.relative_to(Path(run_dir).resolve())), f"programs[{i}].resumes.checkpoints"
                    )
    elif by == LIGHTNING:
        for i, entry in enumerate(doc.get("checkpoints", [])):
            if isinstance(entry, dict) and isinstance(entry.get("step"), int):
                path = inside(run_dir, entry.get("path"), f"checkpoints[{i}].path")
                if path.is_file():
                    found[entry["step"]] = path
    return dict(sorted(found.items()))


def stage(path: Path, scratch: Path, doc: dict[str, Any]) -> Path:
    """A copy of the checkpoint ``path`` (a directory or a file) of the run whose run.json is ``doc`` in
    ``scratch``, by its name, where the replayed job looks for it (the Trainer's ``checkpoint-N`` in its output
    directory; torchtitan's ``step-N`` in its checkpoint folder), to resume the replay from."""
    programs = [p for p in doc.get("programs", []) if isinstance(p, dict)]
    folder = _resumes(programs[-1]).get("folder", "") if programs else ""
    if not isinstance(folder, str) or Path(folder).name != folder or folder == "..":
        raise RunDirError(
            f"run.json: programs[{len(programs) - 1}].resumes.folder={folder!r}: not a folder's name "
            "(a replay copies the checkpoint into that folder of its scratch directory)"
        )
    copy = Path(scratch) / folder / path.name
    copy.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        shutil.copytree(path, copy)
    else:
        shutil.copy2(path, copy)
    return copy


def index(run_dir: Path, step: int, path: Path) -> None:
    """Records in run.json that ``path`` is a checkpoint of ``step`` (Lightning's: its file names need not say),
    relative to the run directory where it lies in it (a replay reads no other: ``inside``)."""
    doc = read_run(run_dir)
    where, base = Path(path).resolve(), Path(run_dir).resolve()
    where = str(where.relative_to(base) if where.is_relative_to(base) else where)
    kept = [e for e in doc.get("checkpoints", []) if isinstance(e, dict) and e.get("path") != where]
    doc["checkpoints"] = [*kept, {"step": step, "path": where}]
    write_run(run_dir, doc)

"""The program a run of one's own loop ran, recorded so that `samestep verify` and `samestep bisect` can run it
again (docs/formats.md, run.json's ``programs``).

``describe()`` is what a ``samestep.Run`` records at its start (a new run, and each resume): the interpreter
and its arguments as it was started (``sys.orig_argv``), the working directory, the launcher (torchrun, and
its process count per node and node count), the environment variables that change bits (``env.ENV_VARS``),
and a SHA-256 of the entry script and of every module the program imported from the working directory.
``relaunch()`` is the command, directory and environment that run it again; ``check()`` says why it cannot
(a notebook, ``-c``, stdin, a script deleted since, several nodes) and which sources changed since.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

from samestep.env import ENV_VARS
from samestep.rundir import read_run, write_run

__all__ = ["ProgramError", "check", "describe", "program_at", "record", "relaunch", "run_dir_of"]

# what torchrun's workers find in their environment (torch.distributed.run sets each)
_TORCHRUN = ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "WORLD_SIZE")


class ProgramError(ValueError):
    """The recorded program cannot be run again here: one line naming why."""


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _own_sources(cwd: Path) -> dict[str, str]:
    """SHA-256 of every imported module's file under ``cwd`` (the working tree), by path relative to it; the
    interpreter's and the installed packages' are the environment's (``env.environment``)."""
    installed = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out: dict[str, str] = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not file or not file.endswith(".py"):
            continue
        path = Path(file).resolve()
        if not path.is_relative_to(cwd) or any(path.is_relative_to(p) for p in installed) \
                or "site-packages" in path.parts:
            continue
        digest = _digest(path)
        if digest is not None:
            out[str(path.relative_to(cwd))] = digest
    return dict(sorted(out.items()))


def _entry(argv: list[str]) -> tuple[str, str | None]:
    """How the interpreter was started: ("script", path), ("module", name), or (why it cannot run again,
    None)."""
    args = argv[1:]
    while args and args[0].startswith("-") and args[0] not in ("-c", "-m", "-"):
        args = args[1:] if args[0] not in ("-W", "-X") else args[2:]  # interpreter flags (-u, -O, -W x)
    if not args or args[0] == "-":
        return "the interactive interpreter or stdin (its code is not on disk)", None
    if args[0] == "-c":
        return "a `python -c` command (its code is not on disk)", None
    module = args[1] if args[0] == "-m" and len(args) > 1 else None
    if Path(args[0]).name == "ipykernel_launcher.py" or (module or "").startswith("ipykernel") \
            or "ipykernel" in sys.modules:
        return "a notebook (its cells are not a program on disk)", None
    if args[0] == "-m":
        return ("module", module) if module else ("a `python -m` with no module", None)
    return "script", args[0]


def describe(run_dir: Path, resumes: dict[str, Any] | None = None) -> dict[str, Any]:
    """This process's program, whose ``samestep.Run`` (or framework callback) writes ``run_dir``, as run.json's
    ``programs`` records it (``run_dir`` relative to the working directory where it lies in it: a copy of the
    run, or the working tree moved, replays the same). ``resumes``: how a framework's run resumes
    (``resume_points.resumes``); none for a Run."""
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    cwd = Path.cwd()
    kind, target = _entry(argv)
    where = Path(run_dir).resolve()
    program: dict[str, Any] = {"argv": argv, "cwd": str(cwd), "executable": sys.executable, "entry": kind,
                               "run_dir": str(where.relative_to(cwd) if where.is_relative_to(cwd) else where),
                               "env": {name: os.environ.get(name) for name in ENV_VARS}}
    if target is None:
        program["entry"], program["not_replayable"] = "none", kind
    else:
        program["target"] = target
    if all(name in os.environ for name in _TORCHRUN):
        local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
        program["launcher"] = {"name": "torchrun", "nproc_per_node": local, "nnodes": max(1, world // max(local, 1))}
    else:
        program["launcher"] = {"name": "python", "nproc_per_node": 1, "nnodes": 1}
    sources = _own_sources(cwd)
    if kind == "script":
        script = (cwd / target).resolve()
        digest = _digest(script)
        if digest is not None and script.is_relative_to(cwd):
            sources[str(script.relative_to(cwd))] = digest
        elif digest is not None:
            sources[str(script)] = digest
    program["sources"] = dict(sorted(sources.items()))
    if resumes is not None:
        program["resumes"] = resumes
    return program


def record(run_dir: Path, start: int, program: dict[str, Any]) -> None:
    """Adds ``program`` to run.json's ``programs`` as the one that runs the steps after ``start`` (a later
    segment's replaces it from there; an entry equal to the one before is not repeated)."""
    doc = read_run(run_dir)
    programs = [p for p in doc.get("programs", []) if isinstance(p, dict) and p.get("from_step", 0) < start]
    entry = {"from_step": start, **program}
    if not programs or {k: v for k, v in programs[-1].items() if k != "from_step"} != program:
        programs.append(entry)
    doc["programs"] = programs
    write_run(run_dir, doc)


def program_at(doc: dict[str, Any], step: int) -> dict[str, Any] | None:
    """The program that ran step ``step`` of the run whose run.json is ``doc`` (None if it records none)."""
    found = None
    for program in doc.get("programs", []):
        if isinstance(program, dict) and isinstance(program.get("from_step"), int) and program["from_step"] < step:
            found = program
    return found


def check(program: dict[str, Any], where: Path) -> list[str]:
    """The sources of ``program`` that differ on disk now (edited, or deleted), as ``"path: why"``.

    Raises:
        ProgramError: it cannot run again at all (how it was started, its launcher, a missing interpreter or
            directory); names why, for the run in ``where``.
    """
    if program.get("not_replayable"):
        raise ProgramError(f"{where} was run from {program['not_replayable']}: it cannot be replayed; run the loop "
                           "as a script (python train.py, or torchrun train.py) to replay it")
    launcher = program.get("launcher", {})
    if launcher.get("nnodes", 1) > 1:
        raise ProgramError(f"{where} ran on {launcher['nnodes']} nodes (torchrun --nnodes {launcher['nnodes']}): a "
                           "replay runs on this machine only; replay a run of one node")
    cwd = Path(program["cwd"])
    if not cwd.is_dir():
        raise ProgramError(f"{where} ran in {cwd}, which is gone: restore it to replay the run")
    if not Path(program["executable"]).exists():
        raise ProgramError(f"{where} ran under {program['executable']}, which is gone: replay it where that "
                           "interpreter is")
    if program.get("entry") == "script" and not (cwd / program["target"]).exists():
        raise ProgramError(f"{where} ran the script {cwd / program['target']}, which is gone (deleted or moved "
                           "since): restore it to replay the run")
    changed = []
    for name, digest in program.get("sources", {}).items():
        now = _digest(cwd / name)
        if now != digest:
            changed.append(f"{name}: {'deleted' if now is None else 'edited'} since the run")
    return changed


def run_dir_of(program: dict[str, Any]) -> Path:
    """The run directory ``program``'s ``samestep.Run`` writes, resolved against its working directory."""
    return (Path(program["cwd"]) / program["run_dir"]).resolve()


def relaunch(program: dict[str, Any]) -> tuple[list[str], Path, dict[str, str]]:
    """The command, working directory and environment (this one's, with the program's bit-changing variables
    as they were) that run ``program`` again, under its launcher."""
    argv = list(program["argv"])
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update({k: v for k, v in program.get("env", {}).items() if v is not None})
    interpreter_args = argv[1:]
    launcher = program.get("launcher", {})
    if launcher.get("name") == "torchrun":
        # torchrun's worker command is `python -u script ...`: the launcher runs the script part again
        rest = interpreter_args[1:] if interpreter_args[:1] == ["-u"] else interpreter_args
        if rest[:1] == ["-m"]:
            rest = ["--module", *rest[1:]]
        cmd = [program["executable"], "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc_per_node", str(launcher["nproc_per_node"]), *rest]
    else:
        cmd = [program["executable"], *interpreter_args]
    return cmd, Path(program["cwd"]), env

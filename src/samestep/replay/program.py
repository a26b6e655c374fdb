"""The program a run of one's own loop ran, recorded so that `samestep verify` and `samestep bisect` can run it
again (docs/formats.md, run.json's ``programs``).

``describe()`` is what a ``samestep.Run`` records at its start (a new run, and each resume): the interpreter
and its arguments as it was started (``sys.orig_argv``), the working directory, the launcher (torchrun, and
its process count per node and node count), the environment variables that change bits (``env.ENV_VARS``),
and a SHA-256 of the entry script and of every module the program imported from the working directory.
``relaunch()`` is the command, directory and environment that run it again; ``check()`` says why it cannot
(a notebook, ``-c``, stdin, a script deleted since, several nodes, a record whose parts disagree) and which
sources changed since; ``identity()`` is what a replay of it runs, named for the verifier and the verdict.

A record is data from whoever made the run: a replay takes from it only what it can check. The entry is read
from the arguments (never from ``entry``/``target`` alone) and must be among the hashed sources; the
interpreter is the verifier's own; of the environment only ``env.ENV_VARS`` apply; the process count is
capped by this machine (docs/debugging.md, "Verifying someone else's run").
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from samestep.determinism.env import ENV_VARS
from samestep.records.rundir import read_run, write_run

__all__ = [
    "ProgramError",
    "check",
    "describe",
    "given",
    "identity",
    "ignored_env",
    "machine_cap",
    "process_cap",
    "program_at",
    "record",
    "relaunch",
    "run_dir_of",
]

# what torchrun's workers find in their environment (torch.distributed.run sets each)
_TORCHRUN = ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "WORLD_SIZE")
_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")  # never a worker's own arguments


class ProgramError(ValueError):
    """The recorded program cannot be run again here: one line naming why."""


def _digest(path: Path) -> str | None:
    """The SHA-256 of a regular file (None: none there; a FIFO or device a record names is never read)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    except OSError:
        return None


def _own_sources(cwd: Path) -> dict[str, str]:
    """SHA-256 of every imported module's file under ``cwd`` (the working tree), by path relative to it; the
    interpreter's and the installed packages' are the environment's (``env.environment``)."""
    prefixes = (sys.prefix, sys.base_prefix, sys.exec_prefix)
    installed = {Path(p).resolve() for p in prefixes}
    # a file named under the interpreter's or the environment's prefix is installed, whatever it resolves to:
    # no resolve (a system call a path component) for the thousands of modules a framework imports
    named_installed = tuple(os.path.join(p, "") for p in prefixes)
    out: dict[str, str] = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not file or not file.endswith(".py") or file.startswith(named_installed):
            continue
        path = Path(file).resolve()
        if (
            not path.is_relative_to(cwd)
            or any(path.is_relative_to(p) for p in installed)
            or "site-packages" in path.parts
        ):
            continue
        digest = _digest(path)
        if digest is not None:
            out[str(path.relative_to(cwd))] = digest
    return dict(sorted(out.items()))


def _entry(argv: list[str], kernel: bool = False) -> tuple[str, str | None]:
    """How the interpreter was started: ("script", path), ("module", name), or (why it cannot run again,
    None). ``kernel``: this process runs a notebook kernel, whatever its arguments say."""
    args = argv[1:]
    while args and args[0].startswith("-") and args[0] not in ("-c", "-m", "-"):
        args = args[1:] if args[0] not in ("-W", "-X") else args[2:]  # interpreter flags (-u, -O, -W x)
    if not args or args[0] == "-":
        return "the interactive interpreter or stdin (its code is not on disk)", None
    if args[0] == "-c":
        return "a `python -c` command (its code is not on disk)", None
    module = args[1] if args[0] == "-m" and len(args) > 1 else None
    if Path(args[0]).name == "ipykernel_launcher.py" or (module or "").startswith("ipykernel") or kernel:
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
    kind, target = _entry(argv, kernel="ipykernel" in sys.modules)
    where = Path(run_dir).resolve()
    program: dict[str, Any] = {
        "argv": argv,
        "cwd": str(cwd),
        "executable": sys.executable,
        "entry": kind,
        "run_dir": str(where.relative_to(cwd) if where.is_relative_to(cwd) else where),
        "env": {name: os.environ.get(name) for name in ENV_VARS},
    }
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


def _entry_file(cwd: Path, kind: str, target: str) -> str | None:
    """The sources' name of the file the entry runs (a script; a module found in the working tree, where
    ``python -m`` looks first), or None for a module from elsewhere (an installed package: the environment)."""
    if kind == "script":
        path = (cwd / target).resolve()
        return str(path.relative_to(cwd.resolve())) if path.is_relative_to(cwd.resolve()) else str(path)
    base = cwd / Path(*target.split("."))
    for path in (base.with_suffix(".py"), base / "__main__.py"):
        if path.is_file():
            return str(path.resolve().relative_to(cwd.resolve()))
    return None


def check(program: dict[str, Any], where: Path) -> list[str]:
    """The sources of ``program`` that differ on disk now (edited, or deleted), as ``"path: why"``.

    Raises:
        ProgramError: it cannot run again at all (how it was started, its launcher, a missing directory or
            script, an entry its arguments do not run, an entry file it does not hash); names why, for the run
            in ``where``.
    """
    if program.get("not_replayable"):
        raise ProgramError(
            f"{where} was run from {program['not_replayable']}: it cannot be replayed; run the loop "
            "as a script (python train.py, or torchrun train.py) to replay it"
        )
    _check_shape(program, where)
    launcher = program.get("launcher", {})
    if launcher.get("nnodes", 1) > 1:
        raise ProgramError(
            f"{where} ran on {launcher['nnodes']} nodes (torchrun --nnodes {launcher['nnodes']}): a "
            "replay runs on this machine only; replay a run of one node"
        )
    argv = program.get("argv")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv) or len(argv) < 2:
        raise ProgramError(
            f"{where / 'run.json'}: programs[].argv={argv!r} is not an interpreter's command line "
            "(a list of strings): the record cannot be replayed"
        )
    kind, target = _entry(argv)
    if target is None:
        raise ProgramError(
            f"{where / 'run.json'}: programs[].argv runs {kind}, not a program on disk: it cannot be replayed"
        )
    if kind == "module" and not all(part.isidentifier() for part in target.split(".")):
        raise ProgramError(
            f"{where / 'run.json'}: programs[].argv runs the module {target!r}, which is no module "
            "name: the record cannot be replayed"
        )
    if kind == "module" and target in _LAUNCHERS:
        raise ProgramError(
            f"{where / 'run.json'}: programs[].argv runs the launcher {target}: a launcher is recorded "
            "in programs[].launcher, never in the arguments (a replay caps its processes there)"
        )
    if (program.get("entry"), program.get("target")) != (kind, target):
        raise ProgramError(
            f"{where / 'run.json'}: programs[] says it ran the {program.get('entry')} "
            f"{program.get('target')!r}, but its argv runs the {kind} {target!r}: the record "
            "disagrees with itself and cannot be replayed"
        )
    cwd = Path(program["cwd"])
    if not cwd.is_dir():
        raise ProgramError(f"{where} ran in {cwd}, which is gone: restore it to replay the run")
    if kind == "script" and not (cwd / target).exists():
        raise ProgramError(
            f"{where} ran the script {cwd / target}, which is gone (deleted or moved "
            "since): restore it to replay the run"
        )
    sources = program.get("sources", {})
    entry = _entry_file(cwd, kind, target)
    if entry is not None and entry not in sources:
        raise ProgramError(
            f"{where / 'run.json'}: programs[].sources does not hash {entry}, the file its argv "
            "runs: the record does not say what ran, so a replay would verify nothing of it"
        )
    changed = []
    for name, digest in sources.items():
        now = _digest(cwd / name)
        if now != digest:
            changed.append(f"{name}: {'deleted' if now is None else 'edited'} since the run")
    return changed


def _check_shape(program: dict[str, Any], where: Path) -> None:
    """Refuses a record whose fields are not of the types ``describe`` writes (a record made by hand).

    Raises:
        ProgramError: names the field and its value.
    """
    launcher, nnodes = program.get("launcher", {}), None
    if isinstance(launcher, dict):
        nnodes = launcher.get("nnodes", 1)
    fields = {
        "cwd": isinstance(program.get("cwd"), str),
        "launcher": isinstance(launcher, dict) and isinstance(nnodes, int) and not isinstance(nnodes, bool),
        "sources": isinstance(program.get("sources", {}), dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in program.get("sources", {}).items()),
        "env": isinstance(program.get("env", {}), dict),
        "run_dir": isinstance(program.get("run_dir", ""), str),
    }
    for name, ok in fields.items():
        if not ok:
            raise ProgramError(
                f"{where / 'run.json'}: programs[].{name}={program.get(name)!r} is not what a "
                "samestep.Run records there: the record cannot be replayed"
            )


def identity(program: dict[str, Any]) -> dict[str, Any]:
    """What a replay of ``program`` runs, as the verifier is shown it and the verdict names it: the entry file
    and its SHA-256 now, every hashed file of the working tree with its SHA-256 now (None: gone), the git
    commit of the working tree where it is a checkout (read from ``.git``, no git run there), and ``program``:
    one SHA-256 over the arguments, directory, entry and those files' hashes."""
    cwd = Path(program["cwd"])
    kind, target = _entry(program["argv"])
    entry = _entry_file(cwd, kind, target) if target is not None else None
    files = {name: _digest(cwd / name) for name in program.get("sources", {})}
    bound = {"argv": program["argv"][1:], "cwd": str(cwd), "entry": [kind, target], "files": files}
    return {
        "entry": entry or target,
        "entry_sha256": files.get(entry) if entry else None,
        "files": files,
        "commit": _git_commit(cwd),
        "program": hashlib.sha256(json.dumps(bound, sort_keys=True).encode()).hexdigest(),
    }


def _git_commit(cwd: Path) -> str | None:
    """The commit checked out in the git working tree holding ``cwd``, read from its files (running git in a
    received directory would run that directory's hooks and config)."""
    for d in (cwd, *cwd.parents):
        git = d / ".git"
        if git.is_file():  # a worktree or submodule: "gitdir: PATH"
            text = git.read_text(encoding="utf-8", errors="replace").strip()
            git = (d / text.removeprefix("gitdir:").strip()) if text.startswith("gitdir:") else git
        if not git.is_dir():
            continue
        try:
            head = (git / "HEAD").read_text(encoding="utf-8").strip()
            if not head.startswith("ref:"):
                return head or None
            ref = head.removeprefix("ref:").strip()
            if (git / ref).is_file():
                return (git / ref).read_text(encoding="utf-8").strip() or None
            for line in (git / "packed-refs").read_text(encoding="utf-8").splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
        except OSError:
            return None
        return None
    return None


def machine_cap(gpus: int | None) -> tuple[int, str]:
    """How many processes of a replay this machine runs at once, one a core (``gpus`` None: a run on CPUs) or
    one a GPU, and what they are ("CPU cores", "GPUs")."""
    if gpus is not None:
        return gpus, "GPUs"
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1), "CPU cores"


def process_cap(program: dict[str, Any], where: Path, gpus: int | None) -> int:
    """The processes a node ``program`` ran, which a replay starts here.

    Args:
        gpus: this machine's GPUs, for a run on GPUs; None for a run on CPUs (capped by the cores).

    Raises:
        ProgramError: not a count, or more than this machine's cores or GPUs: names the field and the cap.
    """
    count = program.get("launcher", {}).get("nproc_per_node", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ProgramError(
            f"{where / 'run.json'}: programs[].launcher.nproc_per_node={count!r} is not a process "
            "count (an integer >= 1): the record cannot be replayed"
        )
    cap, what = machine_cap(gpus)
    if count > cap:
        raise ProgramError(
            f"{where / 'run.json'}: programs[].launcher.nproc_per_node={count}: this machine has "
            f"{cap} {what}, and a replay starts at most one process for each; replay it on a "
            "machine with as many"
        )
    return count


def run_dir_of(program: dict[str, Any]) -> Path:
    """The run directory ``program``'s ``samestep.Run`` writes, resolved against its working directory."""
    return (Path(program["cwd"]) / program["run_dir"]).resolve()


def given(recorded: dict[str, Any], argv: list[str], cwd: Path) -> tuple[dict[str, Any], str]:
    """``recorded`` with the verifier's own command line ``argv`` (``python SCRIPT ARGS`` or ``python -m MODULE
    ARGS``, run in ``cwd`` under the run's launcher) in place of its arguments and directory, and the
    interpreter it names (found on PATH).

    Raises:
        ProgramError: ``argv`` is not a Python command line of a program on disk; names it.
    """
    interpreter = shutil.which(argv[0]) if argv else None
    kind, target = _entry(argv) if len(argv) > 1 else ("nothing to run", None)
    if interpreter is None or not Path(argv[0]).name.startswith("python") or target is None:
        raise ProgramError(
            f"the program after --: {' '.join(argv)!r}: give it as `python SCRIPT ARGS` or `python -m "
            "MODULE ARGS` (its launcher is the run's), with an interpreter on PATH"
        )
    return {**recorded, "argv": [interpreter, *argv[1:]], "cwd": str(cwd), "entry": kind, "target": target}, interpreter


def ignored_env(program: dict[str, Any]) -> list[str]:
    """The variables ``program`` records that a replay does not apply: all but ``env.ENV_VARS`` (those that change
    bits). Any other (``PYTHONPATH``, ``LD_PRELOAD``) would run code the record chooses."""
    recorded = program.get("env", {})
    return sorted(k for k in (recorded if isinstance(recorded, dict) else {}) if k not in ENV_VARS)


def relaunch(program: dict[str, Any], interpreter: str | None = None) -> tuple[list[str], Path, dict[str, str]]:
    """The command, working directory and environment (this one's, with the program's bit-changing variables
    as they were, and no other of its variables) that run ``program`` again, under its launcher, with
    ``interpreter`` (default: this one, the verifier's; the record's ``executable`` is never run)."""
    argv = list(program["argv"])
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update({k: v for k, v in program.get("env", {}).items() if k in ENV_VARS and isinstance(v, str)})
    interpreter = interpreter or sys.executable
    interpreter_args = argv[1:]
    launcher = program.get("launcher", {})
    if launcher.get("name") == "torchrun":
        # torchrun's worker command is `python -u script ...`: the launcher runs the script part again
        rest = interpreter_args[1:] if interpreter_args[:1] == ["-u"] else interpreter_args
        if rest[:1] == ["-m"]:
            rest = ["--module", *rest[1:]]
        cmd = [
            interpreter,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes",
            "1",
            "--nproc_per_node",
            str(launcher["nproc_per_node"]),
            *rest,
        ]
    else:
        cmd = [interpreter, *interpreter_args]
    return cmd, Path(program["cwd"]), env

"""Runs the tests make and read: ``samestep train`` in this process, in one of its own or as the ranks of a job
(``TINY``, the CPU-sized config), a command or script run here, and what a run wrote (its files, metrics bytes,
the origin a diff named)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.support.processes import Forked, spawn

__all__ = [
    "TINY",
    "cli_here",
    "killed_in_step_4",
    "metrics_bytes",
    "origin_of",
    "run_files",
    "run_train",
    "script_here",
    "script_ranks",
    "side_by_side",
    "traced_step",
    "train_cmd",
    "train_here",
    "train_ranks",
]

# A CPU-sized run that still exercises every part of the loop: 4 microbatches, dropout, checkpoints.
# On CPU on every machine: the suite checks the CPU reference that CI runs (its world-size and race
# claims are CPU ones); bench/gpu_check.py checks runs on CUDA.
TINY = (
    "train.device=cpu",
    "train.steps=8",
    "train.global_batch=8",
    "train.micro_batch=2",
    "train.checkpoint_every=2",
    "train.warmup_steps=2",
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
)


def train_cmd(
    run_dir: Path, *settings: str, resume: bool = False, nproc: int = 1, stop_after: int | None = None
) -> list[str]:
    cmd = [sys.executable, "-m", "samestep", "train", "--run-dir", str(run_dir)]
    for s in settings:
        cmd += ["--set", s]
    if resume:
        cmd.append("--resume")
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    if stop_after:
        cmd += ["--stop-after", str(stop_after)]
    return cmd


def run_train(
    run_dir: Path, *settings: str, resume: bool = False, nproc: int = 1, stop_after: int | None = None
) -> dict | None:
    """Runs ``samestep train`` in a process of its own (``Forked``); returns final.json (None if it stopped
    early)."""
    proc = Forked(train_cmd(run_dir, *settings, resume=resume, nproc=nproc, stop_after=stop_after)[3:])
    assert proc.wait() == 0, proc.stderr[-4000:]
    final = run_dir / "final.json"
    return json.loads(final.read_text()) if final.exists() else None


def run_files(root: Path) -> dict[str, bytes]:
    """Every file of a run directory and its bytes, but the lock's (each holder writes its pid there)."""
    from samestep.records.rundir import LOCK

    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != LOCK}


def train_here(run_dir: Path, *settings: str, resume: bool = False, stop_after: int | None = None) -> dict | None:
    """Runs ``samestep train``'s loop in this process (no process start to pay); returns final.json's
    contents (None if it stopped early). For claims that need no fresh process, kill or several ranks."""
    from samestep.train import load_config, train

    return train(
        load_config(None, list(settings)), run_dir, resume=resume, stop_after=stop_after, out=lambda _line: None
    )


def _here(args: list[str], run) -> subprocess.CompletedProcess:
    """``run()`` in this process as a command: its exit code (its return value, or its ``SystemExit``'s) and
    what it printed, as ``subprocess.run(args, capture_output=True, text=True)`` gives them."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run() or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def cli_here(*argv: str) -> subprocess.CompletedProcess:
    """Runs ``samestep *argv`` in this process (no interpreter start to pay). For commands whose claim needs
    no fresh process, kill or several ranks."""
    from samestep.cli import main

    return _here(["samestep", *argv], lambda: main(list(argv)))


def script_here(path: Path, *argv: str) -> subprocess.CompletedProcess:
    """Runs a script as ``python path *argv`` would (``__main__``, its ``sys.argv``), in this process. For
    runs that need no fresh process, kill or signal."""
    import runpy

    def run() -> None:
        runpy.run_path(str(path), run_name="__main__")

    saved = sys.argv
    sys.argv = [str(path), *argv]
    try:
        return _here([str(path), *argv], run)
    finally:
        sys.argv = saved


def _as_launched(rank: int, nproc: int, port: int, threads: int) -> None:
    """What torchrun sets in each of its processes (its variables, and the thread count its OMP_NUM_THREADS
    gives a fresh interpreter)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
    )
    torch.set_num_threads(threads)


def _train_rank(rank: int, nproc: int, port: int, threads: int, argv: list[str], patch, stderr: str | None) -> None:
    """One process of ``samestep train --nproc nproc``: what the launcher sets (its variables, and the thread
    count its OMP_NUM_THREADS gives a fresh interpreter), ``patch()`` (a module-level function, or None)
    first, then the command; a nonzero code is the process's exit code. ``stderr``: a file the rank's
    stderr is added to."""
    _as_launched(rank, nproc, port, threads)
    sys.stdout = open(os.devnull, "w")  # the progress lines of every rank
    if stderr is not None:
        os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
    if patch is not None:
        patch()
    from samestep.cli import main

    code = main(argv)
    if code:
        raise SystemExit(code)


def train_ranks(
    run_dir: Path,
    *settings: str,
    nproc: int,
    resume: bool = False,
    stop_after: int | None = None,
    patch=None,
    exit_code: int | None = None,
    stderr: Path | None = None,
) -> dict | None:
    """The ``nproc`` processes of ``samestep train --nproc nproc``, forked from the spawn server (no interpreter
    start or imports to pay); returns final.json (None if none was written). For claims about several ranks,
    not about the launcher (its signals and exit codes: ``run_train``). ``patch``: a module-level function
    each process calls first; ``exit_code``: a process must end with it (see ``spawn``); ``stderr``: a file
    every rank's stderr goes to."""
    from samestep.cli.launch import free_port
    from samestep.train import load_config

    argv = train_cmd(run_dir, *settings, resume=resume, stop_after=stop_after)[3:]
    threads = load_config(None, list(settings)).determinism.threads
    spawn(
        _train_rank,
        (nproc, free_port(), threads, argv, patch, None if stderr is None else str(stderr)),
        nproc,
        exit_code,
    )
    final = run_dir / "final.json"
    return json.loads(final.read_text()) if final.exists() else None


def _script_rank(rank: int, nproc: int, port: int, script: str, argv: list[str], out: str) -> None:
    """One process of ``torchrun --nproc_per_node nproc script *argv`` (what the launcher sets, and one thread, as
    its OMP_NUM_THREADS gives), or of ``python script *argv`` where ``nproc`` is 1; rank 0's stdout to ``out``."""
    import runpy

    if nproc > 1:
        _as_launched(rank, nproc, port, 1)
    sys.stdout = open(out if rank == 0 else os.devnull, "w")
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.stdout.close()


def script_ranks(script: Path, *argv: str, nproc: int, exit_code: int | None = None) -> str:
    """A script as torchrun runs it on ``nproc`` processes (as python runs it where ``nproc`` is 1), its processes
    forked from the spawn server (no interpreter start, nor torch's and samestep's imports, to pay); rank 0's
    stdout. ``exit_code``: a process must end with it (see ``spawn``); a process that raises fails the call
    (``torch.multiprocessing.ProcessRaisedException``, its traceback in the message)."""
    import tempfile

    from samestep.cli.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stdout"
        spawn(_script_rank, (nproc, free_port(), str(script), list(argv), str(out)), nproc, exit_code)
        return out.read_text() if out.exists() else ""


def _rank_1_dies_in_step_4() -> None:
    """A ``train_ranks`` patch: rank 1 SIGKILLs itself as it starts step 4 (the steps count from 0 here)."""
    import signal

    from samestep.train import loop

    step = loop.Trainer.step

    def dying(self, s):
        if s == 3 and os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return step(self, s)

    loop.Trainer.step = dying


def killed_in_step_4(run_dir: Path, *settings: str, nproc: int, copies: tuple[str, ...] = ()) -> None:
    """``train_ranks`` of ``settings`` on ``nproc`` processes whose rank 1 SIGKILLs itself as it starts step 4,
    leaving the checkpoint of step 2 its newest (a checkpoint every 2 steps); then copies of ``run_dir`` named
    ``copies`` beside it, for resumes under other layouts."""
    import shutil
    import signal

    train_ranks(run_dir, *settings, nproc=nproc, patch=_rank_1_dies_in_step_4, exit_code=-signal.SIGKILL)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    for name in copies:
        shutil.copytree(run_dir, run_dir.parent / name)


def origin_of(proc: subprocess.CompletedProcess) -> tuple[dict, tuple]:
    """The --json report of a ``samestep diff`` or ``bisect`` that named an origin (it must have, and exited
    nonzero), and the origin's (step, rank, microbatch, scope, op)."""
    doc = json.loads(proc.stdout)
    origin = doc["origin"]
    assert proc.returncode != 0 and origin is not None, proc.stdout + proc.stderr
    return doc, (origin["step"], origin["rank"], origin["microbatch"], origin["scope"], origin["op"])


def side_by_side(*calls):
    """Runs independent ``samestep train`` runs (callables, each starting its own processes) at once: on a
    2-core machine two single-threaded runs take the time of one. Their results, in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def metrics_bytes(run_dir: Path) -> bytes:
    return (run_dir / "metrics.jsonl").read_bytes()


def traced_step(rec, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, microbatches, forward) -> None:
    """One step of a user's own loop traced as tracing/recorder.py says: ``microbatches`` is
    ``[(index, input)]``, ``forward(input)`` returns the loss (``model`` may sit inside it, e.g. in DDP)."""
    with rec.step(step):
        for index, x in microbatches:
            with rec.microbatch(index):
                loss = forward(x)
                loss.backward()
                rec.metric("loss", loss)
        rec.grads(model.named_parameters())
        opt.step()
        opt.zero_grad()
        rec.state(model, opt)

"""Processes the tests start, forked from a server that imported torch, samestep and the models once: ``spawn``
(the ranks of a job), ``Forked`` (a command, script or snippet as its own process) and ``run_printed`` (a command
line as the docs print it). A process still running past its deadline fails its test with its stacks."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support import forked

__all__ = ["Forked", "PRELOAD", "run_printed", "spawn"]


# What the spawn server imports once (``forked.py``'s server: ``spawn`` and ``Forked`` share it); with
# transformers' Llama, which the examples' ranks build (about 3.5 s of CPU a process, paid once a server), and
# torchtitan's trainer and Llama 3, which its trainer processes import (about 2 s each; none changes torch's
# settings on import, and the CPU stand-ins patch its modules after the fork as before).
PRELOAD = [
    *forked.PRELOAD,
    forked.__name__,
    __name__,
    "tests.support.runs",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mixtral.modeling_mixtral",
    "torchtitan.train",
    "torchtitan.models.llama3",
]


# A spawned process still running after this long is stuck (the longest take a minute on a busy 2-core
# machine): its stacks are shown and every process is killed, so a hang fails its test, not the suite.
SPAWN_DEADLINE_S = 600
# Once a process has ended with an error, how long the others have to end by themselves (every rank of a run
# that a check stops reports what it found) before they are stopped (the peers of a rank that killed itself).
GRACE_S = 10


def _spawned(rank: int, fn, stacks: str, args: tuple) -> None:
    """One spawned process: its Python stacks go to ``stacks``/rank<N>.txt on SIGUSR1; ``fn(rank, *args)``;
    then the default process group, if ``fn`` made one, is destroyed. Here, not in ``fn``: by now ``fn``'s
    objects are gone, so the group dies by its Python reference, whose destructor lets go of the GIL. A DDP
    alive at ``destroy_process_group`` would hold the last reference instead, and its reducer's destructor
    joins gloo's threads holding the GIL that a thread finishing a collective waits for (pytorch#56297)."""
    import faulthandler
    import gc
    import signal

    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1, file=open(Path(stacks) / f"rank{rank}.txt", "w"), all_threads=True)
    fn(rank, *args)
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _stuck(ctx, stacks: Path) -> str:
    """The stacks of ``ctx``'s processes still running (SIGUSR1, see ``_spawned``), then every one killed."""
    import signal
    import time

    alive = [(rank, p) for rank, p in enumerate(ctx.processes) if p.is_alive()]
    for _, p in alive:
        os.kill(p.pid, signal.SIGUSR1)
    time.sleep(2)
    for p in ctx.processes:
        p.kill()
        p.join()
    return "\n".join(f"rank {rank} (pid {p.pid}):\n" + (stacks / f"rank{rank}.txt").read_text() for rank, p in alive)


def spawn(fn, args: tuple, nprocs: int, exit_code: int | None = None) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, its processes forked from a server that imported
    torch, samestep and ``fn``'s module once (each spawned interpreter would import them again, seconds
    apiece). The server imports and never computes, so no thread pool is forked. ``exit_code``: a process
    must end with it (a rank that kills itself: ``os._exit``'s code, or minus the signal), and the others
    end or are stopped (``GRACE_S``). A process still running after ``SPAWN_DEADLINE_S`` fails the test with
    the stacks of those still running."""
    import multiprocessing
    import tempfile
    import time

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload([*PRELOAD, fn.__module__])
    with tempfile.TemporaryDirectory() as stacks:
        ctx = mp.start_processes(
            _spawned, args=(fn, stacks, args), nprocs=nprocs, join=False, start_method="forkserver"
        )
        deadline = time.monotonic() + SPAWN_DEADLINE_S
        try:
            while not ctx.join(timeout=1, grace_period=GRACE_S):
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"{fn.__name__}'s processes still running after {SPAWN_DEADLINE_S} s; their "
                        f"stacks:\n{_stuck(ctx, Path(stacks))}",
                        pytrace=False,
                    )
        except (mp.ProcessExitedException, mp.ProcessRaisedException):
            # any process, not the first one found: the peers of a rank that killed itself fail too
            if exit_code is None or exit_code not in [p.exitcode for p in ctx.processes]:
                raise
            return
    assert exit_code is None, f"no process of {fn.__name__} ended with exit code {exit_code}"


class Forked(forked.Forked):
    """``forked.py``'s process (``python -m samestep *argv``, or ``python script *argv``, forked from the
    server that imported torch and samestep), whose ``wait`` fails the test where the process is still running
    after its timeout."""

    preload = PRELOAD

    def wait(self, timeout: float = 600) -> int:
        try:
            return super().wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"samestep still running after {timeout} s; its stderr:\n{(self.stderr or '')[-4000:]}")


def run_printed(command: str, cwd: Path, timeout: float = 600) -> tuple[int, str, str]:
    """A command line as the docs print it (``python SCRIPT ...``, ``samestep ...`` or ``torchrun ...``, parts
    joined by ``&&``), in ``cwd``, each part forked from the server (``Forked``: the imports a fresh interpreter
    would pay, paid once); (the exit code of the last part run, every part's stdout, every part's stderr)."""
    import shlex

    code, out, err = 0, [], []
    for part in command.split("&&"):
        head, *argv = shlex.split(part)
        if head == "samestep":
            proc = Forked(argv, cwd=cwd)
        elif head == "python":
            proc = Forked(argv[1:], script=Path(argv[0]), cwd=cwd)
        elif head == "torchrun":
            proc = Forked(argv, cwd=cwd, code="from torch.distributed.run import main; main()")
        else:
            raise ValueError(f"run_printed: {head!r} in {command!r} is none of python, samestep, torchrun")
        code = proc.wait(timeout)
        out.append(proc.stdout or "")
        err.append(proc.stderr or "")
        if code:
            break
    return code, "".join(out), "".join(err)

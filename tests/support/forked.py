"""A `samestep` command, a script or a Python snippet in a process of its own, forked from a server that imported
torch and samestep once: a fresh interpreter pays seconds of imports that a fork does not.

    proc = Forked(["train", "--run-dir", "runs/a"])        # python -m samestep train --run-dir runs/a
    proc = Forked(["runs/a"], script=Path("examples/x.py")) # python examples/x.py runs/a
    proc = Forked(["runs/a"], code="import sys; ...")       # python -c "..." runs/a
    proc.wait(600)

It behaves as the ``subprocess.Popen`` of that command (``pid``, ``poll``, ``send_signal``, ``kill``, ``wait``,
``returncode``; ``stdout`` and ``stderr``, the text, once it has ended), with the caller's environment and
directory; ``new_session``: in a session and process group of its own (``start_new_session``). Settings read as
torch or Inductor are imported (TORCHINDUCTOR_*, OMP_NUM_THREADS) are the server's: a claim about them runs a
fresh interpreter. The server imports and never computes, so no thread pool is forked. The bench scripts
(bench_faults.py) and the tests (tests/support/processes.py) start their processes with it.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["PRELOAD", "Forked"]

# What the server imports once: deterministic mode's torch.use_deterministic_algorithms imports Inductor's
# config (and with it Dynamo), most of two seconds a process would pay again.
PRELOAD = ["torch", "torch.distributed", "torch._inductor.config", "samestep", "samestep.cli"]


def _command(
    argv: list[str],
    script: str | None,
    code: str | None,
    env: dict[str, str],
    cwd: str,
    stdout: str,
    stderr: str,
    new_session: bool,
) -> None:
    """``samestep *argv``, ``python script *argv`` or ``python -c code *argv``, as a fresh process runs it: the
    caller's environment and directory, stdout and stderr to those files; the command's code is the process's
    exit code."""
    import signal

    if new_session:
        os.setsid()
    # a fresh interpreter's dispositions, whatever the server's parent had when it started the server (an ignored
    # SIGINT would outlive its exec, and a Ctrl-C sent to this process would be lost)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.dup2(os.open(stdout, os.O_WRONLY | os.O_APPEND), 1)
    os.dup2(os.open(stderr, os.O_WRONLY | os.O_APPEND), 2)
    if script is not None:
        import runpy

        sys.argv = [script, *argv]
        sys.orig_argv = [sys.executable, script, *argv]  # the interpreter's own, as a program records itself by it
        sys.path.insert(0, str(Path(script).parent))  # as python puts a script's folder first
        runpy.run_path(script, run_name="__main__")
        return
    if code is not None:
        sys.argv = ["-c", *argv]
        sys.orig_argv = [sys.executable, "-c", code, *argv]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        return
    from samestep.cli import main

    sys.orig_argv = [sys.executable, "-m", "samestep", *argv]
    raise SystemExit(main(argv))


class Forked:
    """A process forked from the server; see the module docstring. ``preload``: what the server imports (a
    subclass may add its own module), if this starts it."""

    preload = PRELOAD

    def __init__(
        self,
        argv: list[str],
        script: Path | None = None,
        cwd: Path | None = None,
        *,
        code: str | None = None,
        new_session: bool = False,
    ) -> None:
        multiprocessing.set_forkserver_preload([*self.preload, __name__])
        self._paths = []
        for _ in range(2):
            fd, path = tempfile.mkstemp(prefix="samestep-output-")
            os.close(fd)
            self._paths.append(path)
        self.args = argv
        self.stdout: str | None = None
        self.stderr: str | None = None
        self._process = multiprocessing.get_context("forkserver").Process(
            target=_command,
            args=(
                argv,
                None if script is None else str(script),
                code,
                dict(os.environ),
                str(cwd or os.getcwd()),
                *self._paths,
                new_session,
            ),
        )
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = 600) -> int:
        """The exit code (minus the signal that ended it). A process still running after ``timeout`` seconds
        is killed, and ``subprocess.TimeoutExpired`` raised with its output so far."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            self._process.kill()
            self._process.join()
            self._read()
            raise subprocess.TimeoutExpired(self.args, timeout, self.stdout, self.stderr)
        self._read()
        return self._process.exitcode

    def _read(self) -> str:
        """Takes in what the process printed; its stderr."""
        if self.stderr is None:
            self.stdout, self.stderr = (Path(p).read_text(errors="replace") for p in self._paths)
            for p in self._paths:
                os.unlink(p)
        return self.stderr

"""The verifier's word before a replay runs a program that a run directory names (docs/debugging.md,
"Verifying someone else's run").

A run's run.json is written by whoever made the run; ``samestep verify`` and ``samestep bisect`` of a loop of
one's own run the program it records. Before any of it runs, the verifier is shown the exact command, its
directory, its process count and what it will execute (``program.identity``), and it runs only on their word
(so does a replay of more processes than this machine has processors):
an interactive yes, ``--yes``, or the program given on the command line (``samestep verify RUN -- python
train.py ...``), as ``trust_remote_code`` asks before a model's own code runs. ``samestep train``'s runs
replay samestep's own trainer with the run's settings: nothing of the run's choosing runs, and nothing is
asked.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Consent", "ConsentError", "Launch", "code_line"]


class ConsentError(ValueError):
    """A replay would run a program the run directory names, and the verifier has not agreed to it (exit 2)."""


def code_line(identity: dict[str, Any]) -> str:
    """``train.py sha256:1a2b3c4d5e6f (3 files of the working tree, git commit 0123456789ab)``: what ran, as a
    verdict names it."""
    sha = identity.get("entry_sha256") or "-"
    commit = identity.get("commit")
    files = len(identity.get("files", {}))
    return (
        f"{identity.get('entry')} sha256:{sha[:12]} ({files} file{'s' if files != 1 else ''} of the working "
        f"tree, {'git commit ' + commit[:12] if commit else 'no git commit'}; program {identity['program'][:12]})"
    )


@dataclass(frozen=True, kw_only=True)
class Launch:
    """What a replay of one run starts: shown before it runs, named in the verdict."""

    run_dir: Path
    """The run replayed."""
    cmd: list[str]
    """The command (its interpreter this process's, or the verifier's given program's)."""
    cwd: Path
    """Where it runs."""
    env: dict[str, str] = field(default_factory=dict)
    """The run's bit-changing variables it applies (``env.ENV_VARS``)."""
    nproc: int = 1
    """Processes on this machine."""
    identity: dict[str, Any] | None = None
    """``program.identity`` of a program of the run's; None: samestep's own trainer."""
    given: bool = False
    """The verifier gave the program on the command line (their word)."""
    ignored: tuple[str, ...] = ()
    """The run's recorded variables not applied."""
    cap: tuple[int, str] | None = None
    """This machine's processors (``program.machine_cap``): more processes than these need the verifier's word."""

    @property
    def needs_word(self) -> bool:
        """Whether it runs what the run directory chose: a program of the run's (not one the verifier gave), or
        more processes than this machine has processors."""
        return (self.identity is not None and not self.given) or self.oversubscribed

    @property
    def oversubscribed(self) -> bool:
        return self.cap is not None and self.nproc > self.cap[0]

    def line(self) -> str:
        """The launch in one line (for a refusal without a terminal)."""
        code = f"; runs {code_line(self.identity)}" if self.identity else ""
        over = f", more than this machine's {self.cap[0]} {self.cap[1]}" if self.oversubscribed else ""
        return (
            f"`{shlex.join(self.cmd)}` in {self.cwd} ({self.nproc} process{'es' if self.nproc != 1 else ''}"
            f"{over}{code})"
        )

    def text(self) -> str:
        """The launch as shown before it runs: the command, directory, processes, variables and every file."""
        over = f" (this machine has {self.cap[0]} {self.cap[1]})" if self.oversubscribed else ""
        lines = [
            f"  run:        {self.run_dir}",
            f"  command:    {shlex.join(self.cmd)}",
            f"  directory:  {self.cwd}",
            f"  processes:  {self.nproc}{over}",
        ]
        if self.env:
            lines.append("  variables:  " + " ".join(f"{k}={v}" for k, v in sorted(self.env.items())))
        if self.ignored:
            lines.append(
                "  not applied (recorded, but not among the variables that change bits): " + ", ".join(self.ignored)
            )
        if self.identity:
            lines.append(f"  code:       {code_line(self.identity)}")
            lines += [f"    {sha or 'missing':<64}  {name}" for name, sha in self.identity["files"].items()]
        return "\n".join(lines)


@dataclass
class Consent:
    """The verifier's word: ``yes`` (``--yes``), else ``ask`` (a terminal's prompt: shown the text, returns
    their answer); without either, a launch of the run's program is refused. ``show``: where a launch agreed to
    by ``yes`` is shown before it runs (the CLI's stderr)."""

    yes: bool = False
    ask: Callable[[str], bool] | None = None
    show: Callable[[str], None] | None = None
    _granted: set[str] = field(default_factory=set)

    def grant(self, launches: list[Launch], command: str) -> None:
        """Agrees to ``launches`` (asked once for all, before any runs) or raises.

        Raises:
            ConsentError: one of them runs the run's program and the verifier did not agree: one line naming
                the command and how to agree.
        """
        asked = [x for x in launches if x.needs_word and x.line() not in self._granted]
        if not asked:
            return
        if self.yes:
            if self.show is not None:
                self.show(f"{command} runs (--yes):\n" + "\n".join(x.text() for x in asked))
            self._granted.update(x.line() for x in asked)
            return
        if self.ask is None:
            what = "; ".join(f"{x.run_dir / 'run.json'} names {x.line()}" for x in asked)
            raise ConsentError(
                f"{what}: nothing ran. {command} runs a program a run directory names, or more "
                "processes than this machine has processors, only on your word: look at it, then pass "
                "--yes (or, for verify, give the program yourself after --, e.g. -- python train.py "
                "ARGS)"
            )
        text = "\n".join(x.text() for x in asked)
        if not self.ask(f"{command} will run what each run directory records:\n{text}\nRun it? [y/N] "):
            raise ConsentError(f"{command}: not agreed to: nothing ran")
        self._granted.update(x.line() for x in asked)

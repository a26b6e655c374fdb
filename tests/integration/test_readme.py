"""The README's commands run as printed: every command block from the quick start to "When runs differ", in
order, each line in one fresh directory (``python`` and ``samestep`` this environment's, forked from the test's
server: ``run_printed``), each exiting 0; the digests the README calls the same are the same. The set-up block
(``make``) and the command line synopsis are not commands to run."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.support import run_printed

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RUN_SECTIONS = ("Quick start: a loop of your own", "The reference run", "When runs differ")

pytestmark = pytest.mark.slow


def _plain_blocks(text: str) -> list[str]:
    """The fenced blocks with no language, fence by fence (a closing fence is not an opening one)."""
    blocks, language, lines = [], None, []
    for line in text.splitlines(keepends=True):
        if line.startswith("```") and language is None:
            language, lines = line[3:].strip(), []
        elif line.startswith("```"):
            if not language:
                blocks.append("".join(lines))
            language = None
        elif language is not None:
            lines.append(line)
    return blocks


def _commands() -> list[tuple[str, str]]:
    """(section, command) of every line of the plain blocks in RUN_SECTIONS, in order, continuations joined
    and comments dropped (bash's own rule: ``#`` after a space)."""
    commands: list[tuple[str, str]] = []
    for section in re.split(r"^## ", README.read_text(encoding="utf-8"), flags=re.M)[1:]:
        title, _, body = section.partition("\n")
        if title.strip() not in RUN_SECTIONS:
            continue
        for block in _plain_blocks(body):
            for line in block.replace("\\\n", " ").splitlines():
                command = re.sub(r"(^|\s)#.*", "", line).strip()
                if command:
                    commands.append((title.strip(), command))
    return commands


def _digest(printed: str) -> str:
    """The weights' digest the quick start prints, or the state digest of samestep train's last run."""
    found = re.findall(r"state digest ([0-9a-f]{16})", printed) or re.findall(r"^([0-9a-f]{16,})$", printed, re.M)
    assert found, printed
    return found[-1]


def test_the_readmes_commands_run_in_order_as_printed(tmp_path, monkeypatch):
    """Negative control: the reference run with another seed prints another state digest and ``diff`` of it
    with ``runs/a`` exits 1 (``--force``: their configs differ), so the equalities below can fail."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.delenv("SAMESTEP_REPLAY", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    commands = _commands()
    assert {section for section, _ in commands} == set(RUN_SECTIONS), commands
    printed: dict[str, str] = {}
    for _, command in commands:
        code, out, err = run_printed(command, tmp_path)
        assert code == 0, (command, code, out[-2000:], err[-3000:])
        printed[command] = out

    def digest_of(prefix: str) -> str:
        matching = [out for command, out in printed.items() if command.startswith(prefix)]
        assert len(matching) == 1, (prefix, list(printed))
        return _digest(matching[0])

    quick = "python examples/quickstart.py runs/loop_"
    assert digest_of(quick + "a") == digest_of(quick + "b")
    trained = {digest_of(f"samestep train --run-dir runs/{name} ") for name in "abcd"}
    assert len(trained) == 1, trained
    for command, out in printed.items():
        if command.startswith(("samestep diff", "samestep bisect")):
            assert re.search(r"^identical", out, re.M), (command, out)
    code, out, err = run_printed(
        "samestep train --run-dir runs/control --set train.steps=50 --set train.seed=7", tmp_path
    )
    assert code == 0, err[-3000:]
    assert _digest(out) not in trained
    assert run_printed("samestep diff runs/a runs/control --force", tmp_path)[0] == 1

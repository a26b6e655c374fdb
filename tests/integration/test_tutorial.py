"""docs/tutorial.md runs as printed: every ``console`` block's commands, in order, in a fresh directory, each
printing the lines the page shows (``<X>``: a digest, the same letter the same bits; a line ending in ``...``:
a line that begins so) and exiting with the code its comment names (``# exit N``; 0 where none); every
``python`` block is an excerpt of the example file it introduces."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.support import run_printed

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial.md"

pytestmark = pytest.mark.slow


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", TUTORIAL.read_text(encoding="utf-8"), re.S)


def _steps() -> list[tuple[str, int, list[str]]]:
    """(command, exit code, expected lines) of every console block, in order."""
    steps: list[tuple[str, int, list[str]]] = []
    for block in _blocks("console"):
        for line in block.splitlines():
            if line.startswith("$ "):
                command, _, comment = line[2:].partition("  #")
                code = re.search(r"exit (\d+)", comment)
                steps.append((command.strip(), int(code.group(1)) if code else 0, []))
            elif line.strip():
                steps[-1][2].append(line)
    return steps


def _matches(expected: list[str], printed: list[str], seen: dict[str, str]) -> str | None:
    """Where ``expected`` is not a subsequence of ``printed`` (placeholders bound in ``seen``): the first line
    not found, or None."""
    lines = iter(printed)
    for want in expected:
        bound_here: set[str] = set()

        def placeholder(m: re.Match) -> str:
            name = m.group(1)
            if name in seen:
                return re.escape(seen[name])
            if name in bound_here:
                return f"(?P={name})"
            bound_here.add(name)
            return f"(?P<{name}>[0-9a-f]{{16,}})"

        text = want[:-3].rstrip() if want.endswith("...") else want
        pattern = "".join(
            re.sub(r"<([A-Z])>", placeholder, part) if i % 2 else re.escape(part)
            for i, part in enumerate(re.split(r"(<[A-Z]>)", text))
        )
        pattern += "" if want.endswith("...") else "$"
        for line in lines:
            m = re.match(pattern, line)
            if m:
                seen.update({k: v for k, v in m.groupdict().items() if v})
                break
        else:
            return want
    return None


def test_the_tutorial_runs_as_printed(tmp_path, monkeypatch):
    """Negative control: a digest placeholder bound to one run's bits does not match another's (``<A>`` after
    the planted run), so the check can fail where the page claims the same bits."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.delenv("SAMESTEP_REPLAY", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    seen: dict[str, str] = {}
    printed_of: dict[str, list[str]] = {}
    steps = _steps()
    assert len(steps) >= 12, steps
    for command, code, expected in steps:
        returncode, out, err = run_printed(command, tmp_path)
        printed = out.splitlines()
        assert returncode == code, (command, returncode, out[-2000:], err[-3000:])
        missing = _matches(expected, printed, seen)
        assert missing is None, (command, missing, printed)
        printed_of[command] = printed
    planted = printed_of["python examples/tutorial.py runs/tut_p --plant 30"]
    assert _matches(["digest <A>"], planted, dict(seen)) == "digest <A>"
    assert len({seen[k] for k in "APDT"}) == 4


def test_each_listing_is_an_excerpt_of_its_example():
    example = (ROOT / "examples" / "tutorial.py").read_text(encoding="utf-8")
    blocks = _blocks("python")
    assert blocks and all(block in example for block in blocks)

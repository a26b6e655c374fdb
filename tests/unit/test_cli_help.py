"""The README's command list and each command's ``--help`` agree: every flag a command takes is on its README line,
and ``samestep train --help`` names every config section and the exit codes."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from samestep.cli import build_parser
from samestep.train.config import Config

README = Path(__file__).resolve().parents[2] / "README.md"


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every leaf subcommand's parser, by its words (``receipts verify``)."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out |= _commands(sub, f"{prefix}{name} ")
    return out or {prefix.strip(): parser}


def _readme_lines() -> dict[str, str]:
    """The README's command block: each command's lines (its usage and continuations), by its words."""
    block = README.read_text(encoding="utf-8").split("## Command line", 1)[1].split("```")[1]
    lines: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        m = re.match(r"samestep ((?:[a-z]+ )*?[a-z]+)(?= [A-Z\[-]| *#|$)", line)
        if m:
            current = m.group(1)
            lines[current] = line
        elif current is not None and line.startswith(" "):
            lines[current] += line
    return lines


def test_every_flag_of_every_command_is_on_its_readme_line():
    """Negative control: a flag the README lacks is found (``--kill-at`` taken out of demo's line)."""
    commands, lines = _commands(build_parser()), _readme_lines()

    def missing(lines: dict[str, str]) -> list[str]:
        out = []
        for words, parser in commands.items():
            flags = [s for a in parser._actions for s in a.option_strings[:1] if s.startswith("--") and s != "--help"]
            out += [f"{words}: {f}" for f in flags if f not in lines.get(words, "") and f != "--debug"]
        return out

    assert set(commands) <= set(lines), sorted(set(commands) - set(lines))
    assert missing(lines) == []
    assert missing({**lines, "demo": lines["demo"].replace("--kill-at", "")}) == ["demo: --kill-at"]


def test_train_help_names_every_config_section_and_the_exit_codes():
    text = _commands(build_parser())["train"].format_help()
    for f in dataclasses.fields(Config):
        assert f"[{f.name}]" in text, f.name
    for code in ("0 done", "2 bad input", "4 a fault", "5 a non-finite", "75", "130"):
        assert code in text, code

"""The public API is the table in docs/api.md, "What is public": each name in it imports from its module, the
packages a user imports from export exactly their row, and what a user reads (the README, docs/api.md, the
tutorial, the examples) uses no other name of samestep's."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# what a user reads and copies; docs/design.md, layouts.md and formats.md explain the internals by their names
USER_FACING = [ROOT / "README.md", ROOT / "docs" / "api.md", ROOT / "docs" / "tutorial.md", *ROOT.glob("examples/*.py")]
# the packages a user's `from samestep.X import ...` reads from: their __all__ is their row, no more
EXPORT_EXACTLY = ["samestep", "samestep.distributed", "samestep.ops"]
# the earlier paths docs/api.md names, aliases of the table's modules (samestep/__init__.py)
OLD_PATHS = {
    "samestep.checksums": "samestep.hashing.checksums",
    "samestep.loop_checks": "samestep.loop.step_checks",
    "samestep.protocol": "samestep.loop.protocol",
    "samestep.receipts": "samestep.records.receipts",
    "samestep.run": "samestep.loop.run",
}


def public_table(text: str) -> dict[str, set[str]]:
    """The "What is public" table of docs/api.md: module -> its public names."""
    section = text.split("## What is public", 1)[1].split("\n## ", 1)[0]
    table = {}
    for module, names in re.findall(r"^\| `(samestep[\w.]*)` \| (.+) \|$", section, re.M):
        table[module] = set(re.findall(r"`(\w+)`", names))
    return table


def _references(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for each `from samestep.X import name` and each dotted `samestep.X.Y` the file names;
    name None where a dotted reference may end at a module."""
    text = path.read_text()
    found: list[tuple[str, str | None]] = []
    for module, wrapped, names in re.findall(r"from (samestep[\w.]*) import (?:\(([^)]*)\)|([\w, ]+))", text):
        found += [(module, n) for n in re.findall(r"\w+", wrapped or names)]
    for dotted in re.findall(r"(?<![\w/.])(?<!from )samestep(?:\.\w+)+", text):
        found.append((dotted, None))
    return found


def outside_the_table(path: Path, table: dict[str, set[str]]) -> list[str]:
    """The references of ``path`` to samestep that the table does not make public."""
    modules = set(table) | set(OLD_PATHS)
    bad = []
    for module, name in _references(path):
        module = OLD_PATHS.get(module, module)
        if name is not None:
            if module not in table or name not in table[module]:
                bad.append(f"{module}.{name}")
            continue
        if module in modules:
            continue
        head, _, tail = module.rpartition(".")
        head = OLD_PATHS.get(head, head)
        # a word after the module that is no attribute (`samestep.json` in a sentence, a file name) is no reference
        if head in table and (tail in table[head] or not hasattr(importlib.import_module(head), tail)):
            continue
        bad.append(module)
    return bad


@pytest.fixture(scope="module")
def table() -> dict[str, set[str]]:
    return public_table((ROOT / "docs" / "api.md").read_text())


def test_every_public_name_imports_from_its_module(table):
    assert len(table) >= 15 and "Run" in table["samestep"]
    missing = [f"{m}.{n}" for m, names in table.items() for n in names if not hasattr(importlib.import_module(m), n)]
    assert not missing, missing


@pytest.mark.parametrize("module", EXPORT_EXACTLY)
def test_the_packages_users_import_from_export_exactly_their_row(table, module):
    assert set(importlib.import_module(module).__all__) == table[module]


def test_what_a_user_reads_names_only_public_api(table):
    bad = {str(p.relative_to(ROOT)): outside_the_table(p, table) for p in USER_FACING}
    assert not any(bad.values()), {k: v for k, v in bad.items() if v}


def test_a_reference_to_an_internal_name_is_caught(table, tmp_path):
    """Negative control: an internal function, an internal module and an undocumented package name are named."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Call `samestep.records.rundir.read_run(path)` or\n"
        "```python\nfrom samestep.distributed import clip_grad_norm_, canonical_sum\n"
        "from samestep.tracing.recorder import Recorder\n```\n"
        "`samestep.rng.generator` and `samestep.protocol.RunProtocol` are public.\n"
    )
    assert outside_the_table(doc, table) == [
        "samestep.distributed.canonical_sum",
        "samestep.tracing.recorder.Recorder",
        "samestep.records.rundir.read_run",
    ]


def test_the_old_paths_are_the_tables_modules():
    for old, new in OLD_PATHS.items():
        assert importlib.import_module(old) is importlib.import_module(new)
    tree = ast.parse((ROOT / "src" / "samestep" / "__init__.py").read_text())
    aliases = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "_OLD_PATHS")
    documented = {f"samestep.{k.value}": f"{v.value}" for k, v in zip(aliases.keys, aliases.values)}
    assert {k: v for k, v in documented.items() if k in OLD_PATHS} == OLD_PATHS

"""The package's layout (docs/design.md, "Layers"): files of one concept, no reaching into another
module's private names, no import circles."""

from __future__ import annotations

import ast
from pathlib import Path

import samestep

MAX_LINES = 450
# docs/design.md, "Layers": bottom first. A module imports modules of its own layer or lower ones only.
LAYERS = (
    (
        "samestep.digests",
        "samestep.ops",
        "samestep.distributed",
        "samestep.hashing",
        "samestep.records.durable",
        "samestep.version",
        "samestep.determinism.numerics",
        "samestep.exit_codes",
    ),
    (
        "samestep.determinism",
        "samestep.records",
        "samestep.loop.data",
        "samestep.loop.step_checks",
        "samestep.replay.program",
        "samestep.replay.request",
        "samestep.replay.resume_points",
        "samestep.testing",
    ),
    ("samestep.checkpoint", "samestep.tracing"),
    ("samestep.analysis", "samestep.train", "samestep.loop", "samestep.integrations", "samestep.replay"),
    ("samestep.cli", "samestep.__main__"),
    ("samestep",),
)


def _modules(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(root: Path) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Each module's imports of the package's modules (at any depth of the code: a lazy import counts),
    and the private names it imports from another module."""
    modules = _modules(root)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base not in modules:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in modules:
                        edges[name].add(sub)
                        continue
                    edges[name].add(base)
                    if alias.name.startswith("_") and not alias.name.startswith("__") and base != name:
                        private.append((name, base, alias.name))
    return edges, private


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles (each as the path that closes it)."""
    found, done, path = [], set(), []

    def visit(m: str) -> None:
        path.append(m)
        for n in sorted(edges.get(m, ())):
            if n in path:
                found.append(path[path.index(n) :] + [n])
            elif n not in done:
                visit(n)
        path.pop()
        done.add(m)

    for m in sorted(edges):
        if m not in done:
            visit(m)
    return found


def test_no_import_circle_and_no_private_import_in_the_package():
    """No module imports a module that imports it back (lazily or not), nor another module's private names.
    Negative control: a made-up package with a lazy circle and a private import is caught."""
    root = Path(samestep.__file__).parent
    edges, private = _imports(root)
    assert "samestep.tracing.recorder" in edges["samestep.tracing.start"]  # the walk sees the package's imports
    assert _circles(edges) == []
    assert private == []


def _layer(module: str) -> int:
    """The layer of a module: that of the longest listed name it is, or lies under."""
    best = max((name for layer in LAYERS for name in layer if module == name or module.startswith(name + ".")), key=len)
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def _upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, n) for m, targets in edges.items() for n in targets if _layer(n) > _layer(m))


def test_no_module_imports_a_higher_layer():
    """Data flows top to bottom: the ground floor (the digest, the kernels) imports nothing above it, the
    library layers none of the reference trainer, the CLI or the package's re-exports. Negative control:
    an import of the trainer from the tracing layer would be caught."""
    edges, _ = _imports(Path(samestep.__file__).parent)
    assert _upward(edges) == []
    edges["samestep.tracing.recorder"].add("samestep.train.loop")
    assert _upward(edges) == [("samestep.tracing.recorder", "samestep.train.loop")]


def test_the_layout_check_catches_a_circle_and_a_private_import(tmp_path):
    """Negative control for the check above: a package whose a.py imports b lazily while b imports a,
    and whose c.py imports a private name of a."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n_hidden = 1\n")
    (pkg / "b.py").write_text("from pkg.a import f\n")
    (pkg / "c.py").write_text("from pkg.a import _hidden\n")
    edges, private = _imports(pkg)
    assert _circles(edges) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert private == [("pkg.c", "pkg.a", "_hidden")]


def test_every_source_file_holds_one_concept_in_at_most_450_lines():
    """One concept per file: none grows past MAX_LINES (split it into a package instead)."""
    root = Path(samestep.__file__).parent
    long = {
        str(p.relative_to(root)): n
        for p in root.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


def test_import_samestep_stays_light():
    """``import samestep`` loads neither the recorder nor pyarrow (``samestep.trace`` loads them when
    used). Negative control: touching ``samestep.trace`` loads them."""
    import subprocess
    import sys

    code = (
        "import sys, samestep; print('pyarrow' in sys.modules, 'samestep.tracing.recorder' in sys.modules); "
        "samestep.trace; print('pyarrow' in sys.modules, 'samestep.tracing.recorder' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "True", "True"]


def _diagram_layers() -> list[set[str]]:
    """docs/design.md's layer diagram, top first: the module names of each layer (its lines that begin at the
    left edge start a layer; indented lines continue it), each name's first column only."""
    text = (Path(samestep.__file__).parents[2] / "docs" / "design.md").read_text()
    block = text[text.index("## Layers") :]
    block = block[block.index("```\n") + 4 :]
    block = block[: block.index("```")]
    layers: list[set[str]] = []
    for line in block.splitlines():
        names = line[:30].replace("/", " ").split()
        if not line.startswith(" "):
            layers.append(set())
        layers[-1].update(names)
    return layers


def test_the_design_diagram_is_the_layer_check():
    """docs/design.md's diagram names the modules of each layer that this file's check enforces, in the same
    order (numerics and preempt included). Control: a module left out of the diagram would be named."""
    diagram = _diagram_layers()[::-1]  # bottom first, as LAYERS
    checked = [{m.removeprefix("samestep.") if m != "samestep" else "samestep" for m in layer} for layer in LAYERS]
    diagram[-1] = {"samestep"} if diagram[-1] == {"samestep", "__init__.py"} else diagram[-1]  # the package itself
    assert len(diagram) == len(checked)
    for drawn, layer in zip(diagram, checked):
        assert layer == drawn, f"diagram {sorted(drawn)} vs check {sorted(layer)}"


def test_only_rundir_names_the_run_directorys_paths():
    """run.json, metrics.jsonl, final.json, checkpoints/, receipts/ and trace/ are named in rundir.py only; every
    other module asks it (rundir.run_json, metrics_path, ...)."""
    names = ('"run.json"', '"metrics.jsonl"', '"final.json"', '"checkpoints"', '"receipts"', '"trace"')
    root = Path(samestep.__file__).parent
    found = [
        f"{path.relative_to(root)}: {name}"
        for path in root.rglob("*.py")
        if path.name != "rundir.py"
        for name in names
        if f"/ {name}" in path.read_text()
    ]
    assert not found, found


def test_the_top_level_holds_at_most_five_modules_and_the_documented_old_paths_import():
    """Each flow lives in a package: the top of src/samestep keeps at most five modules. The module paths
    docs/api.md named before (``samestep.preempt``, ``samestep.protocol``, ...) still import, as the same
    module objects. Control: a path never documented does not import."""
    import importlib

    root = Path(samestep.__file__).parent
    assert len(list(root.glob("*.py"))) <= 5, sorted(p.name for p in root.glob("*.py"))
    old = {
        "samestep.preempt": "samestep.determinism.preempt",
        "samestep.rng": "samestep.determinism.rng",
        "samestep.protocol": "samestep.loop.protocol",
        "samestep.loop_checks": "samestep.loop.step_checks",
        "samestep.checksums": "samestep.hashing.checksums",
        "samestep.receipts": "samestep.records.receipts",
        "samestep.run": "samestep.loop.run",
    }
    for path, new in old.items():
        assert importlib.import_module(path) is importlib.import_module(new), path
    from samestep.preempt import EXIT_PREEMPTED, StopRequest  # noqa: F401 (the form docs/api.md shows)
    from samestep.protocol import RunProtocol  # noqa: F401

    try:
        importlib.import_module("samestep.rundir")
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("samestep.rundir was never a documented path")


def test_the_exit_code_table_in_code_is_the_one_the_docs_show():
    """samestep.exit_codes holds every code; docs/debugging.md's "Exit codes" table lists the same numbers (and
    128 + N). Control: a code missing from the docs' table would be named."""
    import re

    from samestep import exit_codes

    text = (Path(samestep.__file__).parents[2] / "docs" / "debugging.md").read_text()
    table = text[text.index("## Exit codes") :].split("\n\n")[1]
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)}
    assert documented == set(exit_codes.MEANINGS), (documented, set(exit_codes.MEANINGS))
    assert "| 128 + N |" in table and exit_codes.SIGNALLED == 128
    assert documented - {exit_codes.PEER_LOST} != set(exit_codes.MEANINGS)  # the control
    from samestep.cli.errors import EXIT_PEER_LOST, INPUT_ERROR
    from samestep.preempt import EXIT_PREEMPTED
    from samestep.train.checks import EXIT_FAULT

    assert (INPUT_ERROR, EXIT_PEER_LOST, EXIT_PREEMPTED, EXIT_FAULT) == (2, 6, 75, 4)


def test_no_test_imports_bench_or_conftest():
    """What tests share is tests/support, a package; no test imports bench/ (a bench script is run as a
    program) or conftest.py (pytest's hooks and fixtures only). Control: such an import is found."""
    tests = Path(__file__).resolve().parents[1]

    def bad(text: str) -> list[str]:
        found = []
        for node in ast.walk(ast.parse(text)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [n for n in names if n.split(".")[0] == "bench" or n.endswith("conftest")]
        return found

    assert {str(p.relative_to(tests)): b for p in tests.rglob("*.py") if (b := bad(p.read_text()))} == {}
    assert sorted(bad("def f():\n    from bench.bench_mask import keep_by_int64\nimport tests.conftest\n")) == [
        "bench.bench_mask",
        "tests.conftest",
    ]

"""The test suite's CPU, test by test: a pytest plugin, and a summary of what it wrote.

    PYTHONPATH=bench .venv/bin/python -m pytest -q -n 3 --dist loadfile -p suite_cpu tests
    .venv/bin/python bench/suite_cpu.py suite_cpu.jsonl [--durations tests/durations.json]

Around each test, the plugin reads the CPU time (user and system) of the worker itself, of its children
that it waited for (subprocesses), and of the children of its fork server (``tests/support/processes.py``'s spawned
ranks and ``Forked`` processes, which the server reaps), and adds one line to $SUITE_CPU_OUT
(suite_cpu.jsonl by default), with the worker that ran the test and when it began (the suite's timeline). A
process that nobody waits for (an orphan) is not counted. ``--durations``: each test's seconds written where
tests/conftest.py reads them to order the suite.
"""

from __future__ import annotations

import json
import os
import time

import pytest


def _fork_server_cpu() -> float:
    """The fork server's CPU and that of the children it reaped (0 when it is not running)."""
    try:
        import multiprocessing.forkserver as forkserver

        pid = forkserver._forkserver._forkserver_pid
        if not pid:
            return 0.0
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except (OSError, AttributeError, ImportError):
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, c0, f0, began = time.monotonic(), os.times(), _fork_server_cpu(), time.time()
    yield
    t1, c1, f1 = time.monotonic(), os.times(), _fork_server_cpu()
    row = {
        "test": item.nodeid,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
        "start": round(began, 2),
        "wall": round(t1 - t0, 2),
        "own": round(c1.user - c0.user + c1.system - c0.system, 2),
        "children": round(c1.children_user - c0.children_user + c1.children_system - c0.children_system, 2),
        "forked": round(f1 - f0, 2),
    }
    with open(os.environ.get("SUITE_CPU_OUT", "suite_cpu.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def durations(rows: list[dict], out: str) -> None:
    """Each test's seconds (wall, 0.1 s and over), as tests/conftest.py orders the suite by them."""
    known = {r["test"]: round(r["wall"], 1) for r in sorted(rows, key=lambda r: -r["wall"]) if r["wall"] >= 0.1}
    with open(out, "w") as f:
        f.write("{\n" + ",\n".join(f"{json.dumps(k)}: {v}" for k, v in known.items()) + "\n}\n")


def main(path: str, out: str | None = None) -> None:
    rows = [json.loads(line) for line in open(path)]
    if out is not None:
        durations(rows, out)
    for r in rows:
        r["cpu"] = r["own"] + r["children"] + r["forked"]
    print(f"{len(rows)} tests, {sum(r['cpu'] for r in rows):,.0f} s of CPU")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:15]:
        print(f"{r['cpu']:7.1f} s CPU {r['wall']:7.1f} s  {r['test']}")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", nargs="?", default="suite_cpu.jsonl")
    ap.add_argument("--durations", metavar="OUT", help="write each test's seconds there (tests/durations.json)")
    args = ap.parse_args()
    main(args.path, args.durations)

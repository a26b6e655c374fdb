"""pytest's fixtures and hooks: global numerics state is restored after every test, the modules run longest
first, a test's random choices can be rerun, one TINY run is shared. What tests call (running the CLI, the
ranks of a job) is tests/support."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton's kernels run under its interpreter (tests/kernels), which must be on before
# anything imports triton: transformers and torch.compile import it too (tests/integration).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import samestep  # noqa: E402
from tests.support import TINY, run_files, run_train  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Modules by their seconds in tests/durations.json (a suite run's, per test: ``bench/suite_cpu.py
    --durations``), most first, and each module's tests longest first. make test hands each worker a whole
    module as it frees up (``--dist loadfile``: its fixtures made once) in xdist's own order, the modules with
    the most tests first, which keeps this order among modules of as many tests (docs/performance.md, "The test
    suite"); without xdist (``-n 0``) this order is the run's."""
    known = json.loads((Path(__file__).parent / "durations.json").read_text())
    total: dict[str, float] = {}
    for item in items:
        total[item.module.__name__] = total.get(item.module.__name__, 0) + known.get(item.nodeid, 0)
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda it: (-total[it.module.__name__], it.module.__name__, -known.get(it.nodeid, 0), order[id(it)]))


@pytest.fixture(autouse=True)
def restore_global_state():
    """Undoes deterministic mode, thread count and environment changes a test made."""
    env = dict(os.environ)
    threads = torch.get_num_threads()
    det = torch.are_deterministic_algorithms_enabled()
    yield
    samestep.disable()
    torch.use_deterministic_algorithms(det)
    torch.set_num_threads(threads)
    os.environ.clear()
    os.environ.update(env)


@pytest.fixture
def rng(request) -> random.Random:
    """The random source of a test's random choices (kill instants): seeded from SAMESTEP_TEST_SEED, or
    afresh, and the seed printed (pytest shows it with a failure), so a failing choice can be rerun."""
    seed = int(os.environ.get("SAMESTEP_TEST_SEED") or random.SystemRandom().randrange(2**32))
    print(f"rerun with SAMESTEP_TEST_SEED={seed} pytest '{request.node.nodeid}'")
    return random.Random(seed)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """One finished TINY run, made once in a fresh process and shared by every test that compares with it or
    copies it (copy it before changing anything: at the session's end it must hold the bytes it was made
    with)."""
    d = tmp_path_factory.mktemp("tiny") / "run"
    run_train(d, *TINY)
    made = run_files(d)
    yield d
    assert run_files(d) == made, f"a test changed the shared run {d}; copy it first"

"""What the tests share, imported as a library (``from tests.support import ...``); tests/conftest.py holds
pytest's fixtures and hooks only."""

from tests.support.processes import PRELOAD, Forked, run_printed, spawn
from tests.support.runs import (
    TINY,
    cli_here,
    killed_in_step_4,
    metrics_bytes,
    origin_of,
    run_files,
    run_train,
    script_here,
    script_ranks,
    side_by_side,
    traced_step,
    train_cmd,
    train_here,
    train_ranks,
)

__all__ = [
    "PRELOAD",
    "TINY",
    "Forked",
    "cli_here",
    "killed_in_step_4",
    "metrics_bytes",
    "origin_of",
    "run_files",
    "run_printed",
    "run_train",
    "script_here",
    "script_ranks",
    "side_by_side",
    "spawn",
    "traced_step",
    "train_cmd",
    "train_here",
    "train_ranks",
]

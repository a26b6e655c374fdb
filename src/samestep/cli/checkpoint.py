"""``samestep checkpoint verify PATH``: check every digest of a checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from samestep.checkpoint import CheckpointError, committed_steps, verify_checkpoint
from samestep.cli.errors import InputError, verdict
from samestep.records.rundir import checkpoints_dir, run_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "checkpoint",
        help="inspect checkpoints",
        description="Checkpoint tools.",
        epilog="examples:\n  samestep checkpoint verify runs/a/checkpoints\n"
        "  samestep checkpoint verify runs/a/checkpoints/step_000100 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    v = verbs.add_parser("verify", help="check every file and tensor digest (exit 0 intact, 1 corrupt)")
    v.add_argument("path", help="a step_NNNNNN directory, or a checkpoints directory (checks its newest committed one)")
    v.add_argument("--json", action="store_true", help="print JSON")
    v.set_defaults(run=run, subparser=v)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    path = Path(args.path)
    if not path.is_dir():
        raise InputError(
            f"{path}: {'is not a directory' if path.exists() else 'does not exist'}; give a "
            "step_NNNNNN checkpoint, a checkpoints directory or a run directory"
        )
    if run_json(path).is_file() and checkpoints_dir(path).is_dir():
        path = checkpoints_dir(path)  # a run directory: its checkpoints
    if not path.name.startswith("step_") and not (path / "manifest.json").exists() and not committed_steps(path):
        raise InputError(f"{path}: holds no checkpoint (no step_NNNNNN directory, no manifest.json); nothing to verify")
    try:
        checked = verify_checkpoint(path)
    except CheckpointError as e:
        verdict(args, 1)
        print(json.dumps({"intact": False, "path": str(path), "error": str(e)}) if args.json else f"CORRUPT: {e}")
        return 1
    print(json.dumps({"intact": True, "path": str(checked)}) if args.json else f"intact: {checked}")
    return 0

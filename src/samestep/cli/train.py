"""``samestep train``: the reference pretraining run (one process, --nproc processes, or under torchrun)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from samestep.cli.errors import InputError
from samestep.train.config import PRESETS, Config

_SECTIONS = [f.name for f in dataclasses.fields(Config)]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="run (or resume) the reference pretraining run (GPT or Llama-style)",
        description="Trains the reference decoder (model.arch gpt or llama) into a run directory (run.json, "
        "metrics.jsonl, checkpoints/, final.json).",
        epilog="examples:\n"
        "  samestep train --run-dir runs/a\n"
        "  samestep train --run-dir runs/a --set train.steps=50 --set model.dropout=0.0\n"
        "  samestep train --run-dir runs/a --resume\n"
        "  samestep train --run-dir runs/l --preset small --set train.steps=100\n"
        "  samestep train --run-dir runs/b --nproc 2\n"
        "  samestep train --show-config --preset small   # every key, its value and what it does\n"
        "  torchrun --standalone --nproc_per_node 2 -m samestep train --run-dir runs/b\n\n"
        "exit codes: 0 done, 2 bad input (one line naming it), 3 an unexpected error, 4 a fault check "
        "stopped it,\n  5 a non-finite loss or gradient norm, 6 a process of the job lost another, 75 "
        "preempted (SIGTERM,\n  SIGUSR1, Ctrl-C: --resume continues), 128 + N stopped at once by a second "
        "signal N, 130 interrupted",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--run-dir", help="the run directory (required to train)")
    p.add_argument(
        "--config",
        help=f"a TOML file with {', '.join(f'[{name}]' for name in _SECTIONS)} sections "
        "(--show-config prints them all)",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="start from a named config: 'small' (a 12.8M Llama "
        "for a CPU), 'gpu' (a 133M Llama for one GPU); --config and --set apply on top",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one config value (repeatable)"
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="data-parallel processes on this machine, run as one job (signals forwarded, exit 75 when preempted)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest intact checkpoint")
    p.add_argument(
        "--stop-after",
        type=int,
        metavar="STEPS",
        help="leave after this many steps (with a checkpoint); continue later with --resume",
    )
    p.add_argument("--json", action="store_true", help="print final.json as JSON at the end")
    p.add_argument(
        "--show-config",
        action="store_true",
        help="print every config key with its value (after --preset, --config and --set) and what it does, "
        "as TOML a --config file takes; train nothing",
    )
    p.set_defaults(run=run, subparser=p)


def _launch(args: argparse.Namespace, threads: int, signals: tuple[str, ...]) -> int:
    """Re-runs this command as ``--nproc`` processes on this machine (see launch.py)."""
    from samestep.cli.launch import launch

    rest = [
        "train",
        "--run-dir",
        args.run_dir,
        *(["--config", args.config] if args.config else []),
        *(["--preset", args.preset] if args.preset else []),
        *[x for s in args.set for x in ("--set", s)],
        *(["--resume"] if args.resume else []),
        *(["--stop-after", str(args.stop_after)] if args.stop_after else []),
        *(["--json"] if args.json else []),
    ]
    return launch(rest, args.nproc, threads, signals)


def _show_config(cfg, as_json: bool) -> int:
    """Every key of ``cfg``'s sections with its value and docstring, as TOML (or JSON)."""
    from samestep.hashing.state import dotted
    from samestep.train.config import Config

    values = dotted(cfg.to_dict())
    rows = [{"key": key, "value": values[key], "default": default, "doc": doc} for key, default, doc in Config.keys()]
    if as_json:
        print(json.dumps(rows))
        return 0
    section = None
    for row in rows:
        name, _, key = row["key"].partition(".")
        if name != section:
            print(f"{'' if section is None else chr(10)}[{name}]")
            section = name
        value = row["value"]
        text = json.dumps(value) if isinstance(value, (str, bool)) else repr(value)
        print(f"{key} = {text}  # {row['doc']}")
    return 0


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from samestep.train import load_config, train

    cfg = load_config(args.config, args.set, preset=args.preset)  # bad input: one line, exit 2 (cli.errors)
    if args.show_config:
        return _show_config(cfg, args.json)
    if args.run_dir is None:
        parser.error("--run-dir is required (or --show-config)")
    if args.nproc < 1:
        raise InputError(f"--nproc={args.nproc} must be at least 1")
    if args.stop_after is not None and args.stop_after < 1:
        raise InputError(f"--stop-after={args.stop_after} must be at least 1")
    from samestep.determinism.preempt import EXIT_PREEMPTED, parse_signals

    if args.nproc > 1:
        from samestep.train.loop import check_layout

        check_layout(cfg, args.nproc)  # one line now, not one from each process started
        return _launch(args, cfg.determinism.threads, parse_signals(cfg.train.exit_signals))
    from samestep.cli.launch import follow_launcher

    follow_launcher()
    from samestep.train.checks import EXIT_FAULT, EXIT_NONFINITE, FaultDetected, NonFinite
    from samestep.train.loop import Preempted

    try:
        final = train(cfg, args.run_dir, resume=args.resume, stop_after=args.stop_after)
    except FaultDetected as e:  # not a crash: a check found what deterministic training cannot make
        print(f"samestep train: {e}", file=sys.stderr)
        return EXIT_FAULT
    except NonFinite as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"samestep train: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except Preempted as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"samestep train: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    if args.json and final is not None and int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(final))
    return 0

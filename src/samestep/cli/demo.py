"""``samestep demo``: two runs of the reference GPT, one killed with SIGKILL and resumed: same bits?"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from samestep.cli.errors import verdict
from samestep.records.final import read_final
from samestep.records.metrics import last_logged_step
from samestep.records.rundir import metrics_path, read_run

# Sized for about two minutes on a 2-core laptop CPU.
DEMO_SETTINGS = ("train.steps=200", "train.checkpoint_every=25", "train.warmup_steps=20")
# The second pair: deterministic mode off, the token lookup done by indexing (its backward,
# index_put_ with accumulate, races between threads on CPU), both steps traced op by op (the race may
# first fire in either). Microbatches of 8 x 64 tokens: the race needs at least 32768 gradient elements
# per index_put_.
NONDET_SETTINGS = (
    "train.steps=2",
    "train.global_batch=16",
    "train.micro_batch=8",
    "determinism.enabled=false",
    "model.embedding=index",
    "trace.level=op",
    "trace.steps=1-2",
)


# Pairs of runs C and D at most (--race-pairs): a race needs its two threads to overlap, which a busy machine's
# scheduler may not let happen in one pair; each pair is about as long as a few steps of run A.
NONDET_TRIES = 3


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="prove exact resume in minutes on a laptop CPU",
        description="Trains run A; trains run B, kills it with SIGKILL partway, resumes it; compares the final "
        "state digests and every step's loss bits. Then trains runs C and D with deterministic mode off "
        "and shows where `samestep diff` says they diverged. Exit 0 if A and B are bit-identical, 1 if "
        "not.",
        epilog="examples:\n  samestep demo\n  samestep demo --workdir runs/demo --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workdir", help="where the runs go (default: a new temporary directory)")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override the demo config (repeatable)"
    )
    p.add_argument("--kill-at", type=int, default=0, help="step at which run B is killed (default: about 60%%)")
    p.add_argument(
        "--race-pairs",
        type=int,
        default=NONDET_TRIES,
        metavar="N",
        help=f"pairs of runs C and D at most, until their race shows (default {NONDET_TRIES})",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(run=run, subparser=p)


def _train_cmd(run_dir: Path, settings: list[str], *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "samestep",
        "train",
        "--run-dir",
        str(run_dir),
        *[x for s in settings for x in ("--set", s)],
        *extra,
    ]


def _run_killed(run_dir: Path, settings: list[str], kill_at: int) -> int:
    """Starts a run, SIGKILLs it once it has finished step ``kill_at``; returns the last step it logged."""
    proc = subprocess.Popen(_train_cmd(run_dir, settings), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while proc.poll() is None and last_logged_step(run_dir) < kill_at:
        time.sleep(0.02)
    if proc.poll() is not None:
        raise RuntimeError(
            f"run B ended (exit {proc.returncode}) before step {kill_at}: "
            f"{proc.stderr.read().decode(errors='replace')[-2000:]}"
        )
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return last_logged_step(run_dir)


def _nondeterministic_pair(work: Path, settings: list[str], on_cuda: bool, say, tries: int = NONDET_TRIES) -> dict:
    """Two runs with deterministic mode off, then `samestep diff` on them; again, up to ``tries`` pairs, until
    the race shows (on CUDA, one pair: PyTorch's kernel there does not race)."""
    from samestep.analysis import diff_runs

    nondet = [*settings, *NONDET_SETTINGS]
    tries = 1 if on_cuda else tries
    say("runs C and D: deterministic mode off, token embedding by indexing, traced op by op ...")
    for attempt in range(1, tries + 1):
        suffix = "" if attempt == 1 else f"_{attempt}"
        c, d = work / f"run_c{suffix}", work / f"run_d{suffix}"
        for run_dir in (c, d):
            subprocess.run(_train_cmd(run_dir, nondet), check=True, stdout=subprocess.DEVNULL)
        report = diff_runs(c, d)
        if not report["identical"]:
            break
        if attempt < tries:
            say(f"  pair {attempt}: identical (the race did not fire); another pair ...")
    say(f"samestep diff {c} {d}:")
    say(f"  {report['summary']}")
    if report["identical"] and on_cuda:
        say(
            "  (on CUDA, PyTorch's index_put_ accumulate sorts its indices: it agreed run to run on an H200."
            " The race shows on a CPU with 2 or more threads: --set train.device=cpu)"
        )
    elif report["identical"]:
        say(
            f"  (the race did not fire in {attempt} pairs: its threads did not overlap on this machine, busy or "
            "of one core; two nondeterministic runs can agree by chance)"
        )
    return {
        "diverged": not report["identical"],
        "pairs": attempt,
        "summary": report["summary"],
        "origin": report["origin"],
    }


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from samestep.train import load_config
    from samestep.train.processes import device_kind

    settings = [*DEMO_SETTINGS, *args.set]
    try:
        cfg = load_config(None, settings)
    except ValueError as e:
        parser.error(str(e))
    if args.race_pairs < 1:
        parser.error(f"--race-pairs={args.race_pairs}: at least 1 pair of runs C and D")
    kill_at = args.kill_at or max(1, cfg.train.steps * 6 // 10 + 1)
    if not 0 < kill_at < cfg.train.steps:
        parser.error(f"--kill-at={kill_at} must be between 1 and train.steps-1={cfg.train.steps - 1}")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="samestep-demo-"))
    a, b = work / "run_a", work / "run_b"
    for d in (a, b):
        if d.exists():
            parser.error(f"{d} already exists; choose an empty --workdir")
    say = (lambda _m: None) if args.json else print
    t0 = time.perf_counter()
    say(f"samestep demo in {work}: {cfg.train.steps} steps of a {cfg.model.n_layer}-layer GPT on the stdlib corpus")
    say("run A: uninterrupted ...")
    subprocess.run(_train_cmd(a, settings), check=True, stdout=subprocess.DEVNULL)
    say(f"run B: killed with SIGKILL after step {kill_at} ...")
    killed = _run_killed(b, settings, kill_at)
    say(f"run B: resumed (killed at step {killed}) ...")
    subprocess.run(_train_cmd(b, settings, "--resume"), check=True, stdout=subprocess.DEVNULL)
    fa, fb = read_final(a), read_final(b)
    resumed_from = read_run(b)["resumes"][-1]["step"]
    same_metrics = metrics_path(a).read_bytes() == metrics_path(b).read_bytes()
    identical = fa["state_digest"] == fb["state_digest"] and same_metrics
    code = verdict(args, 0 if identical else 1)
    say(f"run A final state digest: {fa['state_digest']}")
    say(
        f"run B final state digest: {fb['state_digest']}  (killed at step {killed}, resumed from checkpoint step "
        f"{resumed_from})"
    )
    say(f"per-step loss and grad-norm bits: {'identical' if same_metrics else 'DIFFERENT'}")
    say(
        "BIT-IDENTICAL: the killed and resumed run followed the same numerical path."
        if identical
        else "NOT IDENTICAL: the resumed run diverged."
    )
    pair = _nondeterministic_pair(work, settings, device_kind(cfg) == "cuda", say, args.race_pairs)
    result = {
        "identical": identical,
        "state_digest_a": fa["state_digest"],
        "state_digest_b": fb["state_digest"],
        "metrics_identical": same_metrics,
        "killed_at_step": killed,
        "resumed_from_step": resumed_from,
        "nondeterministic_pair": pair,
        "seconds": round(time.perf_counter() - t0, 1),
        "workdir": str(work),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"({result['seconds']}s; runs in {work})")
    return code

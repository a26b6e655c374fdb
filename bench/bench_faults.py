"""Fault harness: kills, crashes, signals, concurrent writers and malformed input, counted.

    .venv/bin/python bench/bench_faults.py [--kills 10] [--signals 4] [--save-ops all] [--json]

Every trial runs `samestep train` in processes of its own on a small config (its resume in this one), forked from
a server that imported torch and samestep once (tests/support/forked.py: a fresh interpreter's imports cost seconds; the
launcher's ranks are fresh interpreters, as it starts them), and checks the outcome against an uninterrupted
reference run, bit for bit (final state digest and metrics.jsonl bytes):
  kills     SIGKILL at a random instant (after a random step, at a random delay), then --resume; as many
            again before the run's first checkpoint (the resume starts from step 0)
  save ops  SIGKILL at each filesystem operation of a checkpoint save, in turn, then --resume
  signals   SIGTERM at a random instant: exit 75 with the step it was in saved, then --resume; as many
            SIGINTs to the whole process group (a Ctrl-C: the trace worker process gets it too)
  launcher  SIGKILL of the `--nproc 2` launcher alone: its ranks save, stop, and none trains on
  writers   two trainers started at once on one run directory: one refused (exit 2, one line), the
            other finishes the run; and a samestep.Run started beside the trainer: refused
  corpus    malformed, forged and odd files, paths and settings given to each command: the documented
            exit code, one line naming the problem on stderr, no traceback, nothing blocking
A trial fails if a resume is not exact, a step is lost beyond the checkpoint interval (a SIGKILL loses
at most the steps since the last committed checkpoint; a signal loses none), or an outcome differs from
the documented one. The counts go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from fault_corpus import CASES, run_case  # noqa: E402

from samestep.records.metrics import last_logged_step  # noqa: E402
from tests.support.forked import Forked  # noqa: E402  (the tests' fork server, started the same way)

SMALL = (
    "train.device=cpu",
    "train.global_batch=8",
    "train.micro_batch=2",
    "train.warmup_steps=2",
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "trace.level=step",
)
EVERY = 2
RUN = (*SMALL, "train.steps=8", f"train.checkpoint_every={EVERY}")
LONG = (*SMALL, "train.steps=60", "train.checkpoint_every=1000")


def _cmd(run: Path, settings: tuple[str, ...], *extra: str) -> list[str]:
    """``samestep train``'s arguments for ``run``."""
    return ["train", "--run-dir", str(run), *[x for s in settings for x in ("--set", s)], *extra]


def _finished(proc: Forked, timeout: float = 600) -> Forked:
    proc.wait(timeout)
    return proc


def _outcome(run: Path) -> tuple[str | None, bytes]:
    try:
        final = json.loads((run / "final.json").read_text())["state_digest"]
    except FileNotFoundError:
        final = None
    return final, (run / "metrics.jsonl").read_bytes()


def _resume(run: Path, settings: tuple[str, ...]) -> tuple[int, int | None]:
    """Resumes a run to its end, in this process (a resume's bits are a fresh process's: tests/integration
    shows it); the exit code and the step it resumed from."""
    from samestep.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(_cmd(run, settings, "--resume"))
    resumes = json.loads((run / "run.json").read_text()).get("resumes", []) if (run / "run.json").exists() else []
    return code, (resumes[-1]["step"] if resumes else 0)


def _signal_after(
    run: Path, settings: tuple[str, ...], step: int, delay: float, sig: int, group: bool = False
) -> tuple[int, int]:
    """Starts a run and sends ``sig`` once it has logged ``step`` and ``delay`` more seconds have passed (with
    ``group``, to its whole process group); its exit code and the last step it had logged then."""
    proc = Forked(_cmd(run, settings), new_session=group)
    deadline = time.monotonic() + 600
    while proc.poll() is None and last_logged_step(run) < step and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(delay)
    logged = last_logged_step(run)
    if proc.poll() is None:
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
    return proc.wait(), logged


def kills(
    work: Path,
    reference: tuple,
    trials: int,
    rng: random.Random,
    settings: tuple[str, ...] = RUN,
    last: int = 7,
    name: str = "kill",
    every: int = EVERY,
) -> dict:
    """SIGKILL after a random step of ``settings``'s run (at most ``last``, plus what it trains while the kill
    waits its random delay), then --resume; ``every``: the steps a kill may lose (the checkpoint interval)."""
    out = {"trials": 0, "exact": 0, "max_steps_lost": 0, "lost_beyond_interval": 0, "killed_before_end": 0}
    for i in range(trials):
        run = work / f"{name}_{i}"
        code, logged = _signal_after(run, settings, rng.randint(0, last), rng.uniform(0, 0.08), signal.SIGKILL)
        out["trials"] += 1
        out["killed_before_end"] += code == -signal.SIGKILL
        rc, resumed_from = _resume(run, settings)
        lost = max(logged - (resumed_from or 0), 0) if code == -signal.SIGKILL else 0
        out["max_steps_lost"] = max(out["max_steps_lost"], lost)
        out["lost_beyond_interval"] += lost > every
        out["exact"] += rc == 0 and _outcome(run) == reference
    return out


_SAVE_OPS = textwrap.dedent("""
    import os, shutil, signal, sys
    import samestep.checkpoint._format as fmt
    import samestep.checkpoint.save as save_mod
    import samestep.records.durable as durable
    from samestep.train import loop
    target, at_step, count, saving = int(sys.argv[1]), int(sys.argv[2]), [0], [False]

    def wrap(owner, name):
        real = getattr(owner, name)
        def op(*a, **k):
            if saving[0]:
                count[0] += 1
                if count[0] == target:
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)
        setattr(owner, name, op)

    for owner, name in ((save_mod, "write_durable"), (fmt, "write_durable"), (save_mod, "fsync_dir"),
                        (save_mod, "replace_atomic"), (os, "replace"), (shutil, "rmtree"), (os, "mkdir")):
        wrap(owner, name)
    real_save = loop.save_checkpoint

    def save(root, step, **kw):
        saving[0] = step == at_step
        try:
            return real_save(root, step, **kw)
        finally:
            saving[0] = False
    loop.save_checkpoint = save
    from samestep.cli import main
    code = main(sys.argv[3:])
    print(f"ops={count[0]}", file=sys.stderr)
    sys.exit(code)
""")


def save_ops(work: Path, reference: tuple, which: str) -> dict:
    """SIGKILL at the k-th filesystem operation of the save of step 4 (of 8, a save every 2 steps, the
    oldest pruned: keep 1), for each k; then --resume."""
    settings = (*RUN, "train.keep_checkpoints=1")

    def child(run: Path, target: int) -> Forked:
        return _finished(Forked([str(target), "4", *_cmd(run, settings)], code=_SAVE_OPS))

    counted = child(work / "ops_count", 0)
    n = int(counted.stderr.strip().splitlines()[-1].split("=")[1])
    ks = list(range(1, n + 1)) if which == "all" else sorted({1, (n + 1) // 2, n})
    out = {"operations": n, "trials": 0, "killed": 0, "exact": 0, "verify_ok": 0}
    for k in ks:
        run = work / f"op_{k}"
        proc = child(run, k)
        out["trials"] += 1
        out["killed"] += proc.returncode == -signal.SIGKILL
        verify = _finished(Forked(["checkpoint", "verify", str(run / "checkpoints")]))
        out["verify_ok"] += verify.returncode == 0
        rc, _ = _resume(run, settings)
        out["exact"] += rc == 0 and _outcome(run) == reference
    return out


def signals(work: Path, reference: tuple, trials: int, rng: random.Random, group: bool = False) -> dict:
    """SIGTERM at a random instant; with ``group``, SIGINT to the trainer's whole process group, its trace
    worker process included (a Ctrl-C)."""
    out = {"trials": 0, "exit_75": 0, "steps_lost": 0, "exact": 0}
    settings = (*LONG, "trace.worker=process") if group else LONG
    for i in range(trials):
        run = work / f"{'group' if group else 'sig'}_{i}"
        code, _ = _signal_after(
            run,
            settings,
            rng.randint(1, 40),
            rng.uniform(0, 0.08),
            signal.SIGINT if group else signal.SIGTERM,
            group=group,
        )
        out["trials"] += 1
        out["exit_75"] += code == 75
        saved = (
            (run / "checkpoints" / "latest").read_text().strip() if (run / "checkpoints" / "latest").exists() else ""
        )
        out["steps_lost"] += max(last_logged_step(run) - (int(saved[5:]) if saved else 0), 0)
        rc, _ = _resume(run, LONG)
        out["exact"] += rc == 0 and _outcome(run) == reference
    return out


def launcher(work: Path, trials: int) -> dict:
    """SIGKILL of the `--nproc 2` launcher alone, after step 2: its ranks (in sessions of their own) get SIGTERM
    from the kernel, save and stop; none trains on."""
    out = {"trials": 0, "ranks_stopped": 0, "saved": 0}
    for i in range(trials):
        run = work / f"launcher_{i}"
        proc = Forked(_cmd(run, LONG, "--nproc", "2"), new_session=True)
        deadline = time.monotonic() + 600
        while last_logged_step(run) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        while _ranks_of(run) and time.monotonic() < deadline:
            time.sleep(0.1)
        out["trials"] += 1
        out["ranks_stopped"] += not _ranks_of(run) and last_logged_step(run) < 60
        out["saved"] += (run / "checkpoints" / "latest").exists()
    return out


def _ranks_of(run: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run).encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


_OWN_LOOP = textwrap.dedent("""
    import sys, torch, samestep
    model = torch.nn.Linear(4, 1)
    try:
        samestep.Run(sys.argv[1], model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), level="off")
    except ValueError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
""")


def writers(work: Path, reference: tuple, trials: int) -> dict:
    out = {"trials": 0, "one_refused": 0, "refusal_one_line": 0, "exact": 0, "own_loop_refused": 0}
    for i in range(trials):
        run = work / f"writers_{i}"
        procs = [Forked(_cmd(run, LONG, "--resume")) for _ in range(2)]
        results = [(p.wait(), p.stderr) for p in procs]
        codes = sorted(c for c, _ in results)
        out["trials"] += 1
        out["one_refused"] += codes == [0, 2]
        refusal = [err for c, err in results if c == 2]
        out["refusal_one_line"] += (
            bool(refusal) and len(refusal[0].strip().splitlines()) == 1 and "in use by pid" in refusal[0]
        )
        out["exact"] += _outcome(run) == reference
        beside = work / f"beside_{i}"  # a loop of one's own started beside a live trainer
        trainer = Forked(_cmd(beside, (*LONG, "train.steps=100000")))  # alive until killed below
        deadline = time.monotonic() + 600
        while last_logged_step(beside) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        own = _finished(Forked([str(beside)], code=_OWN_LOOP))
        trainer.kill()
        trainer.wait()
        out["own_loop_refused"] += own.returncode == 2 and "in use by pid" in own.stderr
    return out


def corpus(work: Path, reference_run: Path) -> dict:
    """Every case of the corpus; and a control: a case expecting the wrong outcome (a flipped checkpoint byte
    called intact) must be caught, or the check could not fail."""
    out = {"cases": 0, "as_documented": 0, "failures": []}
    outcomes = [run_case(case, work, reference_run, RUN) for case in CASES]  # in this process, one at a time
    for case, (ok, why) in zip(CASES, outcomes):
        out["cases"] += 1
        out["as_documented"] += ok
        if not ok:
            out["failures"].append(f"{case.name}: {why}")
    wrong = next(c for c in CASES if c.name == "a flipped bit in model.safetensors")
    out["control_caught"] = not run_case(replace(wrong, name="control", code=0), work, reference_run, RUN)[0]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--signals", type=int, default=4)
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--launcher", type=int, default=1)
    ap.add_argument("--save-ops", choices=["all", "some", "none"], default="all")
    ap.add_argument("--corpus", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    # the launcher's ranks are fresh interpreters: they find this checkout's samestep as this process did
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="samestep-faults-") as tmp:
        work = Path(tmp)
        with ThreadPoolExecutor(max_workers=2) as pool:  # two single-threaded runs, side by side
            for proc in pool.map(
                lambda job: _finished(Forked(_cmd(work / job[0], job[1]))),
                (("reference", RUN), ("reference_long", LONG)),
            ):
                if proc.returncode:
                    raise SystemExit(f"a reference run failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
        reference, reference_long = _outcome(work / "reference"), _outcome(work / "reference_long")
        result = {
            "kills": kills(work, reference, args.kills, rng),
            # a run that saves only at its end loses what it trained, and resumes from step 0
            "kills_before_a_checkpoint": kills(work, reference_long, args.kills, rng, LONG, 40, "unsaved", 60),
        }
        if args.save_ops != "none":
            result["save_ops"] = save_ops(work, reference, args.save_ops)
        result["signals"] = signals(work, reference_long, args.signals, rng)
        result["group_signals"] = signals(work, reference_long, args.signals, rng, group=True)
        result["launcher"] = launcher(work, args.launcher)
        result["writers"] = writers(work, reference_long, args.writers)
        if args.corpus:
            result["corpus"] = corpus(work, work / "reference")
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        for name, counts in result.items():
            print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in counts.items() if k != "failures"))
            for failure in counts.get("failures", []):
                print(f"  FAILED {failure}")
    return 0 if _all_good(result) else 1


def _all_good(r: dict) -> bool:
    """Zero wrong outcomes: every resume exact, no step lost beyond the interval (before a first checkpoint:
    beyond the run), every signal a 75 with nothing lost, every launcher's ranks stopped with a checkpoint,
    one writer refused each time, every corpus case as documented and the control caught."""
    ok = True
    for k in (r["kills"], r["kills_before_a_checkpoint"]):
        ok &= k["exact"] == k["trials"] and not k["lost_beyond_interval"]
    for s in (r["signals"], r["group_signals"]):
        ok &= s["exact"] == s["exit_75"] == s["trials"] and not s["steps_lost"]
    w, launched = r["writers"], r["launcher"]
    ok &= w["exact"] == w["one_refused"] == w["refusal_one_line"] == w["own_loop_refused"] == w["trials"]
    ok &= launched["ranks_stopped"] == launched["saved"] == launched["trials"]
    if "save_ops" in r:
        o = r["save_ops"]
        ok &= o["exact"] == o["killed"] == o["verify_ok"] == o["trials"]
    if "corpus" in r:
        ok &= not r["corpus"]["failures"] and r["corpus"]["control_caught"]
    return bool(ok)


if __name__ == "__main__":
    sys.exit(main())

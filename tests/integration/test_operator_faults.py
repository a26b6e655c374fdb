"""What an operator does to a run: kill it anywhere, signal it, start two writers, tamper with its files,
fill the disk, feed it malformed input. Nothing is lost, nothing forged is resumed, nothing hangs, and
every input error is one line with exit 2."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import samestep
from samestep.records.metrics import last_logged_step
from samestep.records.rundir import RunDirError
from tests.forgery import flip_a_weight, move_cursor, reseal, reseal_manifest
from tests.support import TINY, Forked, cli_here, run_files, train_cmd, train_here

# Checkpoints only at the end: a kill before it leaves a run with no checkpoint at all.
UNSAVED = (*TINY, "train.steps=40", "train.checkpoint_every=1000")


def _kill_after(run_dir: Path, step: int, *settings: str) -> None:
    """Starts ``samestep train``, SIGKILLs it once it has logged ``step``."""
    proc = Forked(train_cmd(run_dir, *settings)[3:])
    deadline = time.monotonic() + 300
    while proc.poll() is None and last_logged_step(run_dir) < step and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, f"the run ended before step {step}: {proc.wait()} {proc.stderr[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_run_killed_before_its_first_checkpoint_resumes_from_step_0(tmp_path):
    """SIGKILL before the first checkpoint: --resume starts again from step 0 and ends on the bits of the run
    straight through. A resume that is refused (another seed) changes no file (the control that the check
    runs before any write); a fresh start into the directory is refused, pointing at --resume."""
    straight = train_here(tmp_path / "straight", *UNSAVED)
    run = tmp_path / "run"
    _kill_after(run, 3, *UNSAVED)
    before = run_files(run)
    with pytest.raises(ValueError, match="train.seed"):
        train_here(run, *UNSAVED, "train.seed=7", resume=True)
    assert run_files(run) == before
    with pytest.raises(ValueError, match="pass --resume to continue it"):
        train_here(run, *UNSAVED)
    assert train_here(run, *UNSAVED, resume=True)["state_digest"] == straight["state_digest"]
    assert (run / "metrics.jsonl").read_bytes() == (tmp_path / "straight" / "metrics.jsonl").read_bytes()


def _own_loop(run_dir: Path, steps: int, **kw) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with samestep.Run(run_dir, model=model, optimizer=opt, **kw) as run:
        for step in run.steps(steps):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()


_OTHER_WRITER = """
import sys, torch, samestep
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    samestep.Run(sys.argv[1], model=model, optimizer=opt, level="off").close()
except ValueError as e:
    print(e)
    sys.exit(2)
"""


def test_every_writer_of_a_run_directory_takes_the_same_lock(tmp_path):
    """A samestep.Run at level "off" holds its run directory: a second Run in another process is refused
    naming the holder, as is one started beside a live samestep train (which holds it the same way);
    once the first closes, the second runs (the control). The Run at level "off" leaves a run.json."""
    run = tmp_path / "run"
    model = torch.nn.Linear(4, 1)
    first = samestep.Run(run, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), level="off")
    try:
        proc = Forked([str(run)], code=_OTHER_WRITER)
        assert proc.wait(300) == 2 and f"is in use by pid {__import__('os').getpid()}" in proc.stdout
    finally:
        first.close()
    assert (run / "run.json").exists()
    proc = Forked([str(run)], code=_OTHER_WRITER)
    assert proc.wait(300) == 0, proc.stdout + proc.stderr

    trained = tmp_path / "trained"
    holder = Forked(train_cmd(trained, *UNSAVED, "train.steps=2000")[3:])
    try:
        deadline = time.monotonic() + 300
        while last_logged_step(trained) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RunDirError, match=f"is in use by pid {holder.pid}"):
            _own_loop(trained, 2, level="off")
    finally:
        holder.kill()
        holder.wait()


_OWN_LOOP = """
import sys, time, torch, samestep
run_dir, total, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with samestep.Run(run_dir, model=model, optimizer=opt, checkpoint_every=1000) as run:
    for step in run.steps(total):
        g = samestep.rng.generator(0, step, 0, "data")
        model(torch.randn(2, 4, generator=g)).sum().backward()
        opt.step()
        opt.zero_grad()
        print(step, flush=True)
        time.sleep(pause)  # a step that takes a while, so that a kill lands mid-run
torch.save(model.state_dict(), run_dir + "/weights.pt")
"""


def _own_loop_here(monkeypatch, run_dir: Path, total: int) -> None:
    """The loop above, run straight through in this process (no kill to survive, so no fresh process)."""
    with monkeypatch.context() as m:
        m.setattr(sys, "argv", ["own_loop", str(run_dir), str(total), "0"])
        exec(compile(_OWN_LOOP, "own_loop", "exec"), {"__name__": "own_loop"})


def test_a_loop_of_ones_own_killed_before_its_first_checkpoint_goes_on_from_step_0(tmp_path, monkeypatch):
    """samestep.Run killed before its first checkpoint: the same loop run again continues the run from step 0
    (a new trace segment, receipts afresh) and ends on the straight run's weights and receipts, and its trace
    certifies complete: a segment a kill ended and a resume followed needs no close. Control: right after
    the kill, with no resume, it does not certify."""
    from samestep.analysis import certify_trace

    straight, run = tmp_path / "straight", tmp_path / "run"
    _own_loop_here(monkeypatch, straight, 30)
    proc = subprocess.Popen(
        [sys.executable, "-c", _OWN_LOOP, str(run), "30", "0.5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while int(proc.stdout.readline() or 0) < 3:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
    proc.kill()
    proc.wait()
    assert not certify_trace(run)["complete"]
    _own_loop_here(monkeypatch, run, 30)
    for name, t in torch.load(straight / "weights.pt").items():
        assert torch.equal(t.view(torch.int32), torch.load(run / "weights.pt")[name].view(torch.int32))
    assert (run / "receipts" / "rank_00000.jsonl").read_bytes() == (
        straight / "receipts" / "rank_00000.jsonl"
    ).read_bytes()
    assert certify_trace(run)["complete"], certify_trace(run)["problems"]


def _pids_of(run_dir: Path) -> list[int]:
    """The processes whose command line names ``run_dir``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run_dir).encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_a_signal_to_the_whole_process_group_stops_the_run_with_a_checkpoint(tmp_path):
    """Ctrl-C, which reaches the trainer's whole process group (its trace worker process too): the worker
    ignores it and follows the trainer, which finishes its step, saves, exits 75; --resume ends on the
    straight run's bits. Control: with no exit signals the same group signal ends the run at once."""
    import os
    import signal

    from samestep.determinism.preempt import EXIT_PREEMPTED

    traced = (*UNSAVED, "trace.level=step", "trace.worker=process")
    straight = train_here(tmp_path / "straight", *UNSAVED)
    outcomes = {}
    for name, extra in (("run", ()), ("control", ("train.exit_signals=",))):
        run = tmp_path / name
        proc = Forked(train_cmd(run, *traced, *extra)[3:], new_session=True)
        deadline = time.monotonic() + 300
        while proc.poll() is None and last_logged_step(run) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)
        outcomes[name] = proc.wait(300), proc.stderr
    assert outcomes["run"][0] == EXIT_PREEMPTED, outcomes["run"][1][-2000:]
    assert outcomes["control"][0] != EXIT_PREEMPTED and not (tmp_path / "control" / "checkpoints").exists(), (
        outcomes["control"][0],
        outcomes["control"][1][-2000:],
    )
    assert train_here(tmp_path / "run", *traced, resume=True)["state_digest"] == straight["state_digest"]


def test_ranks_whose_launcher_is_killed_save_and_stop(tmp_path):
    """SIGKILL of the `--nproc 2` launcher alone: its ranks, in sessions of their own, get a SIGTERM from the
    kernel, finish their step, save and exit, instead of training on unsupervised to the end."""
    import os
    import signal

    run = tmp_path / "run"
    launcher = Forked(train_cmd(run, *UNSAVED, "train.steps=100000", nproc=2)[3:], new_session=True)
    deadline = time.monotonic() + 300
    while last_logged_step(run) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    while _pids_of(run) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pids_of(run), "the ranks trained on after their launcher died"
    assert last_logged_step(run) < 1000 and (run / "checkpoints" / "latest").exists()


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of ``rank`` of the job that launcher ``launcher`` started (its variables name both)."""
    want = {f"SAMESTEP_LAUNCHER_PID={launcher}".encode(), f"RANK={rank}".encode()}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and want <= set((proc / "environ").read_bytes().split(b"\0")):
                return int(proc.name)
        except OSError:
            continue
    return None


@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_killed_by_a_signal_is_named_by_the_launcher(tmp_path, rank):
    """SIGKILL of one rank of a `--nproc 2` job: the launcher names the rank and the signal in one line and the
    job exits 137 (128 + 9); the other rank says in one line that it lost a peer (no gloo error, no
    traceback). The rank killed is the rank named (control: rank 0 killed instead names rank 0)."""
    import os
    import signal

    run = tmp_path / "run"
    launcher = Forked(train_cmd(run, *UNSAVED, "train.steps=100000", nproc=2)[3:], new_session=True)
    deadline = time.monotonic() + 300
    while last_logged_step(run) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(_rank_pid(launcher.pid, rank), signal.SIGKILL)
    assert launcher.wait() == 137, launcher.stderr
    lines = [line for line in launcher.stderr.splitlines() if line.startswith("samestep train: ")]
    assert (
        f"samestep train: rank {rank} was killed by SIGKILL (exit 137); the job's other processes were "
        "stopped" in launcher.stderr
    ), launcher.stderr
    assert f"samestep train: rank {1 - rank} stopped: another process of the job ended" in launcher.stderr
    assert len(lines) == 2 and "Traceback" not in launcher.stderr and "gloo" not in launcher.stderr, launcher.stderr


_SECOND_SIGNAL = """
import signal, sys, time
from samestep.determinism.preempt import StopRequest
with StopRequest(("SIGTERM",)) as stop:
    if sys.argv[1] == "stop":
        signal.raise_signal(signal.SIGTERM)
time.sleep(0.6)  # past the window in which a repeat counts as the same request
signal.raise_signal(signal.SIGTERM)
time.sleep(5)
"""


def test_a_signal_after_the_graceful_stop_exits_as_preempted():
    """Once a stop was asked for and the loop has saved and left, a further SIGTERM exits 75 (preempted,
    everything saved), not 143. Control: with no stop asked for, the same signal acts as it always does."""
    import signal

    from samestep.determinism.preempt import EXIT_PREEMPTED

    stopped, plain = Forked(["stop"], code=_SECOND_SIGNAL), Forked(["plain"], code=_SECOND_SIGNAL)
    assert stopped.wait(60) == EXIT_PREEMPTED, stopped.stderr
    assert plain.wait(60) == -signal.SIGTERM, plain.stderr


@pytest.mark.parametrize("forgery", ["manifest step", "a weight bit", "the data cursor"])
def test_a_forged_checkpoint_is_refused(tmp_path, forgery):
    """A checkpoint edited with every digest of its manifest recomputed: the loader refuses a manifest whose
    step is not its directory's, and a resume refuses state that is not what the run's receipt of that step
    records (the receipts are a chain the checkpoint cannot rewrite); `receipts verify` names it. Control: an
    untouched copy of the checkpoint verifies and resumes to the straight run's bits."""
    import json
    import shutil

    from samestep.analysis.receipt_check import check_receipts
    from samestep.checkpoint import CheckpointError, verify_checkpoint
    from samestep.records.receipts import ReceiptError

    straight = train_here(tmp_path / "straight", *TINY)
    run, control = tmp_path / "run", tmp_path / "control"
    train_here(run, *TINY, stop_after=4)
    shutil.copytree(run, control)
    step_dir = run / "checkpoints" / "step_000004"
    assert check_receipts(run)["ok"]
    if forgery == "manifest step":
        manifest = json.loads((step_dir / "manifest.json").read_bytes())
        manifest["step"] = 6
        reseal_manifest(step_dir, manifest)
        with pytest.raises(CheckpointError, match="says step 6, but it is step_000004"):
            verify_checkpoint(step_dir)
    else:
        if forgery == "a weight bit":
            reseal(step_dir, "model.safetensors", flip_a_weight((step_dir / "model.safetensors").read_bytes()))
        else:
            reseal(step_dir, "state.json", move_cursor((step_dir / "state.json").read_bytes()))
        assert verify_checkpoint(step_dir) == step_dir  # every byte matches the (recomputed) manifest
        report = check_receipts(run)
        assert not report["ok"] and "is not the receipt's of step 4" in report["problems"][0]
        before = run_files(run)
        with pytest.raises(ReceiptError, match="the checkpoint of step 4 restores state"):
            train_here(run, *TINY, resume=True)
        assert run_files(run) == before

    untouched = control / "checkpoints" / "step_000004"
    assert verify_checkpoint(untouched) == untouched and check_receipts(control)["ok"]
    assert train_here(control, *TINY, resume=True)["state_digest"] == straight["state_digest"]


@pytest.mark.parametrize(
    "damage",
    [
        "a row deleted",
        "a torn last row",
        "emptied",
        "deleted",
        "two rows swapped",
        "a row repeated",
        "final.json's loss",
    ],
)
def test_receipts_verify_names_damage_to_metrics_and_final(tmp_path, damage):
    """Every edit of metrics.jsonl or final.json of a finished run is named by `receipts verify` (control: the
    untouched run holds); a --resume of a finished run whose metrics.jsonl was deleted is refused rather than
    rewriting final.json."""
    import json

    from samestep.analysis.receipt_check import check_receipts

    run = tmp_path / "run"
    train_here(run, *TINY)
    assert check_receipts(run)["ok"]
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    edits = {
        "a row deleted": lambda: metrics.write_text("".join(lines[:3] + lines[4:])),
        "a torn last row": lambda: metrics.write_text("".join(lines) + lines[-1][:20]),
        "emptied": lambda: metrics.write_text(""),
        "deleted": lambda: metrics.unlink(),
        "two rows swapped": lambda: metrics.write_text("".join(lines[:2] + [lines[3], lines[2]] + lines[4:])),
        "a row repeated": lambda: metrics.write_text("".join(lines[:3] + lines[2:])),
        "final.json's loss": lambda: (run / "final.json").write_text(
            json.dumps({**json.loads((run / "final.json").read_text()), "loss_hex": (1.5).hex()})
        ),
    }
    edits[damage]()
    report = check_receipts(run)
    assert not report["ok"], report
    if damage == "deleted":
        before = run_files(run)
        with pytest.raises(RunDirError, match="metrics.jsonl: missing"):
            train_here(run, *TINY, resume=True)
        assert run_files(run) == before


def test_receipts_verify_of_a_run_without_receipts_is_an_input_error(tmp_path):
    """A run that kept no receipt (train.receipts=false) has nothing to verify: an input error, not "hold"."""
    from samestep.analysis.receipt_check import check_receipts
    from samestep.records.receipts import ReceiptError

    train_here(tmp_path / "run", *TINY, "train.receipts=false")
    with pytest.raises(ReceiptError):
        check_receipts(tmp_path / "run")


@pytest.mark.slow
def test_swapped_shards_of_a_sharded_checkpoint_are_refused(tmp_path):
    """A 2-process FSDP2 run: `receipts verify` compares each rank's shards of the newest checkpoint with that
    rank's receipts (they hold); rank 1's receipts cut short fail its resume alone, and the job exits with
    its input error; with the two ranks' model shards swapped and the manifest resealed,
    `checkpoint verify` still passes, but `receipts verify` names rank 0's shards and a --resume is refused
    (exit 2): on 2 processes by each rank's restored shards, on 1 unsharded process (another layout, whose
    state no receipt records) by the checkpoint's files against the receipts of the ranks that wrote them.
    Control: unswapped, the checkpoint passes that check on 1 process (a resume of 0 further steps)."""
    from samestep.analysis.receipt_check import check_receipts
    from samestep.checkpoint import verify_checkpoint
    from tests.support import train_ranks

    run = tmp_path / "run"
    train_ranks(run, *TINY, "parallel.fsdp=true", nproc=2)
    report = check_receipts(run)
    assert report["ok"] and "checkpoint step_000008 against its step's receipt(s)" in report["checked"], report
    # an input error on rank 1 alone (its receipts cut short): the job's exit is rank 1's 2, not the
    # connection error rank 0 then meets
    mine = run / "receipts" / "rank_00001.jsonl"
    kept = mine.read_bytes()
    mine.write_bytes(b"".join(kept.splitlines(keepends=True)[:3]))
    proc = subprocess.run(
        train_cmd(run, *TINY, "parallel.fsdp=true", resume=True, nproc=2), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 2 and "rank_00001.jsonl" in proc.stderr, proc.stderr[-2000:]
    mine.write_bytes(kept)
    step_dir = run / "checkpoints" / "step_000008"
    from samestep.analysis.receipt_check import checkpoint_mismatches
    from samestep.records.receipts import read_run_receipts

    assert checkpoint_mismatches(run, step_dir, read_run_receipts(run), None) == []
    zero, one = (
        (step_dir / "model.rank_00000.safetensors").read_bytes(),
        (step_dir / "model.rank_00001.safetensors").read_bytes(),
    )
    reseal(step_dir, "model.rank_00000.safetensors", one)
    reseal(step_dir, "model.rank_00001.safetensors", zero)
    assert verify_checkpoint(step_dir) == step_dir
    report = check_receipts(run)
    assert not report["ok"] and "rank 0's shards" in report["problems"][0], report
    err = tmp_path / "stderr"  # the ranks, as the launcher above starts them
    train_ranks(run, *TINY, "parallel.fsdp=true", resume=True, nproc=2, exit_code=2, stderr=err)
    assert "the checkpoint of step 8 restores state" in err.read_text(), err.read_text()[-2000:]
    proc = cli_here(*train_cmd(run, *TINY, resume=True)[3:])
    assert proc.returncode == 2 and "rank 0's shards checksum" in proc.stderr, proc.stderr[-2000:]


def test_a_stream_cut_at_a_batch_boundary_does_not_certify(tmp_path):
    """An own loop's stream cut back to an earlier batch boundary (every batch left whole, its steps
    complete) is named by certify: its recorder closed the segment with more records. Control: uncut, it
    certifies complete."""
    from samestep.analysis import certify_trace

    samestep.enable(threads=1)
    run = tmp_path / "run"
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = samestep.trace(run, level="step")
    rec.attach(model)
    sizes = {}
    for step in range(1, 5):
        with rec.step(step):
            model(torch.ones(2, 4)).sum().backward()
            rec.grads(model.named_parameters())
            opt.step()
            opt.zero_grad()
            rec.state(model, opt)
        rec.sync()
        sizes[step] = (run / "trace" / "rank_00000.arrows").stat().st_size
    rec.close()
    assert certify_trace(run)["complete"]
    stream = run / "trace" / "rank_00000.arrows"
    with open(stream, "r+b") as f:
        f.truncate(sizes[2])
    report = certify_trace(run)
    assert not report["complete"] and any("the stream was cut" in p for p in report["problems"]), report


def _cli(*argv: str, timeout: float = 300) -> tuple[int, str, str]:
    """Runs the samestep CLI in this process (no interpreter to start), on a thread that must finish within
    ``timeout``: a command that blocks fails the test instead of hanging it."""
    import contextlib
    import io
    import threading

    from samestep.cli import main

    out, err, result = io.StringIO(), io.StringIO(), []

    def run() -> None:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            result.append(main(list(argv)))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), f"samestep {' '.join(argv)} blocked for {timeout} s"
    return result[0], out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def finished(tiny_run):
    """A finished reference run with checkpoints at steps 4, 6 and 8, copied by each test that damages it."""
    return tiny_run


def _copy(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to, symlinks=True)
    return to


@pytest.mark.parametrize(
    "target",
    [
        "run.json",
        "final.json",
        "receipts/rank_00000.jsonl",
        "metrics.jsonl",
        "checkpoints/step_000008/manifest.json",
        "checkpoints/step_000008/model.safetensors",
    ],
)
def test_a_fifo_in_place_of_a_file_is_an_error_not_a_wait(finished, tmp_path, target):
    """A FIFO where samestep reads a file: every command that reads it ends at once, with one line naming it
    and exit 2 (a resume falls back to the older checkpoint where the newest is the damaged one, as for any
    damage; final.json a resume does not read, but writes). Control: the same commands on the undamaged run
    give their verdicts."""
    import os

    run = _copy(finished, tmp_path / "run")
    commands = [("receipts", "verify", str(run)), ("trace", "certify", str(run)), ("diff", str(run), str(finished))]
    for argv in commands:
        assert _cli(*argv)[0] in (0, 1), argv  # a verdict on the whole run (certify: not traced)
    (run / target).unlink()
    os.mkfifo(run / target)
    for argv in commands:  # every one ends; receipts verify, which reads all of them, names the damage
        code, _, err = _cli(*argv, timeout=120)
        assert code in (0, 1, 2) and (code != 2 or len(err.strip().splitlines()) == 1), (argv, code, err)
    assert _cli("receipts", "verify", str(run), timeout=120)[0] in (1, 2)
    code, _, err = _cli(
        "train", "--run-dir", str(run), *[x for s in TINY for x in ("--set", s)], "--resume", timeout=300
    )
    if target.startswith("checkpoints/"):
        assert code == 0, err  # the newest checkpoint is skipped as damaged, step 6 resumes
    elif target == "final.json":
        assert code == 0 and (run / target).is_file(), err  # not read by a resume: written anew
    else:
        assert code == 2 and len(err.strip().splitlines()) == 1 and "FIFO" in err, err


def test_bad_paths_and_oversized_configs_are_input_errors(tmp_path):
    """One line and exit 2 for: a --run-dir that is empty, a file, a FIFO, a symlink loop, too long or under
    /proc; a --config that is a directory or a symlink loop; diff and receipts verify given a file;
    checkpoint verify on a file, /dev/zero, a FIFO or an empty directory; a trace.steps range that selects
    nothing; a step that would read the corpus many times over; a model, a vocabulary or a microbatch's attention
    too big for memory, refused before anything is allocated. Control: the tiny config trains (exit 0)."""
    import os

    a_file, fifo, loop, empty = tmp_path / "file", tmp_path / "fifo", tmp_path / "loop", tmp_path / "empty"
    a_file.write_text("x")
    os.mkfifo(fifo)
    loop.symlink_to(loop)
    empty.mkdir()
    tiny = [x for s in TINY for x in ("--set", s)]
    cases = {
        "run-dir ''": ("train", "--run-dir", "", *tiny),
        "run-dir a file": ("train", "--run-dir", str(a_file), *tiny),
        "run-dir a FIFO": ("train", "--run-dir", str(fifo), *tiny),
        "run-dir a loop": ("train", "--run-dir", str(loop), *tiny),
        "run-dir too long": ("train", "--run-dir", str(tmp_path / ("x" * 300)), *tiny),
        "run-dir under /proc": ("train", "--run-dir", "/proc/samestep-run", *tiny),
        "config a directory": ("train", "--run-dir", str(tmp_path / "r1"), "--config", str(empty)),
        "config a loop": ("train", "--run-dir", str(tmp_path / "r2"), "--config", str(loop)),
        "diff of a file": ("diff", str(a_file), str(a_file)),
        "receipts verify of a file": ("receipts", "verify", str(a_file)),
        "checkpoint verify of a file": ("checkpoint", "verify", str(a_file)),
        "checkpoint verify of /dev/zero": ("checkpoint", "verify", "/dev/zero"),
        "checkpoint verify of a FIFO": ("checkpoint", "verify", str(fifo)),
        "checkpoint verify of an empty directory": ("checkpoint", "verify", str(empty)),
        "trace.steps=5-1": ("train", "--run-dir", str(tmp_path / "r3"), *tiny, "--set", "trace.steps=5-1"),
        "a step past the corpus": (
            "train",
            "--run-dir",
            str(tmp_path / "r4"),
            *tiny,
            "--set",
            "train.global_batch=1000000000",
        ),
        "a model past memory": ("train", "--run-dir", str(tmp_path / "r5"), *tiny, "--set", "model.n_layer=1000000"),
        "a vocabulary past memory": (
            "train",
            "--run-dir",
            str(tmp_path / "r6"),
            *tiny,
            "--set",
            "model.vocab_size=16777216",
            "--set",
            "model.n_embd=128",
        ),
        "attention past memory": ("train", "--run-dir", str(tmp_path / "r7"), *tiny, "--set", "model.block_size=65536"),
    }
    for name, argv in cases.items():
        code, out, err = _cli(*argv)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "error:" in err, (name, code, err, out)
    assert "train.global_batch=1000000000" in _cli(*cases["a step past the corpus"])[2]
    assert "model.n_layer=1000000" in _cli(*cases["a model past memory"])[2]
    assert "(vocabulary 16,777,216)" in _cli(*cases["a vocabulary past memory"])[2]
    assert "model.block_size=65536 with train.micro_batch=2" in _cli(*cases["attention past memory"])[2]
    code, out, err = _cli("checkpoint", "verify", str(empty), "--json")
    assert code == 2 and json_line(out) == {
        "error": err.strip().removeprefix("samestep checkpoint verify: "),
        "exit_code": 2,
    }
    assert _cli("train", "--run-dir", str(tmp_path / "ok"), *tiny)[0] == 0


def json_line(text: str) -> dict:
    import json

    return json.loads(text.strip().splitlines()[-1])


def test_a_non_finite_loss_stops_the_run_before_its_update(tmp_path):
    """train.lr=1e30: the first step whose loss or gradient norm is not finite stops the run before its
    update, with a checkpoint of the step before it, one line and exit 5. Control: with
    train.nonfinite=continue the same run trains on to NaN and exits 0. A learning rate past what float32
    holds (1e308) is refused at the start."""
    from samestep.checkpoint import committed_steps

    tiny = [x for s in TINY for x in ("--set", s)]
    run = tmp_path / "run"
    code, _, err = _cli("train", "--run-dir", str(tmp_path / "huge"), *tiny, "--set", "train.lr=1e308")
    assert code == 2 and "train.lr=1e+308 overflows float32" in err, err
    code, _, err = _cli("train", "--run-dir", str(run), *tiny, "--set", "train.lr=1e30")
    assert code == 5 and "the run stopped before that step's update" in err, err
    step = int(err.split("train: step ", 1)[1].split(":", 1)[0])
    assert [s for s, _ in committed_steps(run / "checkpoints")][0] == step - 1
    code, _, _ = _cli(
        "train", "--run-dir", str(tmp_path / "on"), *tiny, "--set", "train.lr=1e30", "--set", "train.nonfinite=continue"
    )
    assert code == 0

"""The command line: exit codes, --json, and the demo end to end (small settings)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import TINY, cli_here, train_here


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The command in a fresh process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "samestep", *args], capture_output=True, text=True, timeout=600)


def test_env_json_is_the_fingerprint():
    """`samestep env --json` prints the fingerprint as JSON (exit 0)."""
    proc = cli_here("env", "--json")
    assert proc.returncode == 0 and "torch.version" in json.loads(proc.stdout)


def test_usage_errors_exit_2_without_traceback(tmp_path):
    """A bad --set, a missing path and a bad --nproc are usage errors: exit 2, a message, no traceback."""
    for args, needle in (
        (("train", "--run-dir", str(tmp_path / "r"), "--set", "train.steps=x"), "train.steps='x'"),
        (("checkpoint", "verify", str(tmp_path / "nope")), "does not exist"),
        (("train", "--run-dir", str(tmp_path / "r"), "--nproc", "0"), "--nproc=0"),
    ):
        proc = cli_here(*args)
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, args


def test_an_unexpected_error_exits_3_in_one_line_and_debug_shows_the_traceback(tmp_path, monkeypatch, capsys):
    """A crash is not a verdict: exit 3 (not 1, "diverged"), one line naming the error and where it was
    raised; --debug prints the traceback. Negative control: a real verdict still exits 1."""
    import samestep.analysis
    from samestep.cli import main

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(samestep.analysis, "diff_runs", broken)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("samestep diff: unexpected error: KeyError: 'boom' (at ")
    assert "Traceback" not in err and "--debug" in err
    assert main(["--debug", "diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 3
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.undo()
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps({"format": "samestep.run", "version": 1, "config": {}}))
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss_hex": name}) + "\n")
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1


def test_checkpoint_verify_takes_a_run_directory(tmp_path):
    """`samestep checkpoint verify RUN` checks RUN/checkpoints (it is not reported corrupt). Negative
    control: a damaged checkpoint there is still caught (exit 1)."""
    run = tmp_path / "run"
    train_here(run, *TINY, "train.steps=2", "train.checkpoint_every=1")
    proc = cli_here("checkpoint", "verify", str(run))
    assert proc.returncode == 0 and proc.stdout.startswith(f"intact: {run / 'checkpoints' / 'step_000002'}")
    blob = run / "checkpoints" / "step_000002" / "model.safetensors"
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1
    blob.write_bytes(bytes(data))
    proc = cli_here("checkpoint", "verify", str(run))
    assert proc.returncode == 1 and proc.stdout.startswith("CORRUPT")


def test_unsupported_layout_is_refused_at_start(tmp_path):
    """3 processes over 4 microbatches is refused before any process starts (one line, exit 2), naming
    supported process counts."""
    proc = cli_here("train", "--run-dir", str(tmp_path / "r"), "--nproc", "3", *[x for s in TINY for x in ("--set", s)])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "do not split over 3 processes" in proc.stderr
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.smoke
def test_demo_reports_bit_identical_resume(tmp_path):
    """`samestep demo --json` on a small config: killed and resumed run B equals run A (exit 0)."""
    settings = [x for s in TINY if not s.startswith("train.steps") for x in ("--set", s)]
    proc = _cli("demo", "--workdir", str(tmp_path), "--json", "--race-pairs", "1", "--set", "train.steps=10", *settings)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["identical"] and result["metrics_identical"]
    assert result["state_digest_a"] == result["state_digest_b"] and 0 < result["resumed_from_step"] < 10
    assert "summary" in result["nondeterministic_pair"]


def test_a_closed_output_pipe_does_not_change_the_verdict(tiny_run, tmp_path):
    """`samestep diff A B | head -0`: the reader closed stdout before a line was written; the exit code is still
    the verdict (0 identical, 1 diverged, 2 refused, with --json too), with no traceback. Negative control: the
    same commands into an open pipe give the same codes."""
    import shutil

    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(tiny_run, same)
    shutil.copytree(tiny_run, other)
    rows = [json.loads(line) for line in (other / "metrics.jsonl").read_text().splitlines()]
    rows[1]["loss_hex"] = float.fromhex(rows[1]["loss_hex"]).__add__(1.0).hex()
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cases = [
        ["diff", str(tiny_run), str(same)],
        ["diff", str(tiny_run), str(other)],
        ["diff", str(tiny_run), str(other), "--json"],
        ["diff", str(tiny_run), str(tmp_path / "none"), "--json"],
        ["receipts", "verify", str(same)],
    ]
    script = (
        "import os, sys, json\nfrom samestep.cli import main\ncodes = []\n"
        f"for argv in {cases!r}:\n"
        "    if sys.argv[1] == 'closed':\n"
        "        r, w = os.pipe(); os.close(r); os.dup2(w, 1); os.close(w)\n"
        "    codes.append(main(argv))\n"
        "print(json.dumps(codes), file=sys.stderr)\n"
    )
    got = {}
    for how in ("open", "closed"):
        proc = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, timeout=300)
        got[how] = json.loads(proc.stderr.splitlines()[-1])
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert got["closed"] == got["open"] == [0, 1, 1, 2, 0], got

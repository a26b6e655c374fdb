"""The reference run end to end: repeats in fresh processes, SIGKILL + resume, crash mid-save, two nodes; what
needs no fresh process (resumes, refusals, verification) runs in the test's own."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.support import TINY, Forked, cli_here, metrics_bytes, run_train, side_by_side, train_cmd, train_here

pytestmark = pytest.mark.slow

# With deterministic mode off, the token-embedding lookup by indexing races in its backward
# (index_put_ accumulate, 2 threads, >= 32768 elements): real nondeterminism on this CPU (CUDA's sorts).
RACY = (
    "train.device=cpu",
    "train.steps=3",
    "train.global_batch=16",
    "train.micro_batch=8",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=64",
    "model.block_size=64",
    "model.embedding=index",
)


@pytest.fixture(scope="module")
def reference(tiny_run) -> Path:
    """One uninterrupted TINY run in a fresh process that the other tests compare against."""
    return tiny_run


def test_two_fresh_runs_are_bit_identical(reference, tmp_path):
    """Two runs in fresh processes: identical final state digest and identical per-step metric bits."""
    final = run_train(tmp_path / "b", *TINY)
    assert final["state_digest"] == json.loads((reference / "final.json").read_text())["state_digest"]
    assert metrics_bytes(tmp_path / "b") == metrics_bytes(reference)
    lines = metrics_bytes(reference).decode().splitlines()
    assert len(lines) == 8 and float.fromhex(json.loads(lines[-1])["loss_hex"]) > 0


def test_nondeterministic_op_diverges_without_deterministic_mode(tmp_path):
    """Negative control: determinism off, a racy index_put_ backward makes two runs differ; on, they agree
    (on 2 threads either way; the runs need no fresh process)."""
    torch.set_num_threads(2)  # determinism off leaves the thread count as it finds it
    off = [train_here(tmp_path / f"off{i}", *RACY, "determinism.enabled=false")["state_digest"] for i in range(3)]
    assert len(set(off)) > 1, "three runs with a racing index_put_ all agreed"
    on = [train_here(tmp_path / f"on{i}", *RACY, "determinism.threads=2")["state_digest"] for i in range(2)]
    assert on[0] == on[1]


def _wait_for_step(proc, metrics: Path, step: int) -> None:
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and sum(1 for ln in metrics.read_text().splitlines() if ln.endswith("}")) >= step:
            return
        time.sleep(0.01)
    raise AssertionError(f"run ended (exit {proc.poll()}) or timed out before step {step}")


def test_sigkill_at_a_random_step_then_resume_is_identical(reference, tmp_path, rng):
    """SIGKILL after a random step (the seed printed), --resume: the final digest and every metric line match
    the reference."""
    kill_after = rng.randrange(1, 8)
    d = tmp_path / "killed"
    proc = Forked(train_cmd(d, *TINY)[3:])
    _wait_for_step(proc, d / "metrics.jsonl", kill_after)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, proc.stderr[-2000:]
    final = train_here(d, *TINY, resume=True)
    ref = json.loads((reference / "final.json").read_text())
    assert final["state_digest"] == ref["state_digest"], f"killed after step {kill_after}"
    assert metrics_bytes(d) == metrics_bytes(reference), f"killed after step {kill_after}"
    resumes = json.loads((d / "run.json").read_text())["resumes"]
    assert len(resumes) == 1 and resumes[0]["step"] % 2 == 0


def _run_python(code: str) -> Forked:
    """``python -c code`` in a process of its own (``Forked``), ended."""
    proc = Forked([], code=textwrap.dedent(code))
    proc.wait()
    return proc


def test_resume_without_data_cursor_restore_diverges(reference, tmp_path, monkeypatch):
    """Negative control: the same stop and resume, but with the checkpoint's data cursor left unrestored
    (load_checkpoint patched), is refused by the run's receipts (the restored state is not the one its
    receipt of step 4 records) and, with receipts off, ends elsewhere than the reference."""
    import samestep.train.resume as resume
    from samestep.records.receipts import ReceiptError

    d = tmp_path / "run"
    assert train_here(d, *TINY, stop_after=4) is None
    d2 = tmp_path / "run2"
    shutil.copytree(d, d2)
    real = resume.load_checkpoint
    with monkeypatch.context() as m:
        m.setattr(resume, "load_checkpoint", lambda *a, **kw: real(*a, **{**kw, "data_cursor": None}))
        with pytest.raises(ReceiptError, match="the checkpoint of step 4 restores state"):
            train_here(d, *TINY, resume=True)
        train_here(d, *TINY, "train.receipts=false", resume=True)
    ref = json.loads((reference / "final.json").read_text())
    assert json.loads((d / "final.json").read_text())["state_digest"] != ref["state_digest"]
    # ...while the same resume with everything restored matches (the positive twin of this control).
    assert train_here(d2, *TINY, resume=True)["state_digest"] == ref["state_digest"]


# Each crash point SIGKILLs the process inside save_checkpoint of step 4.
CRASH_POINTS = {
    "torn-tensor-file": """
        real = files_mod.write_durable
        def write_durable(path, data):
            if path.name == "model.safetensors" and ".step_000004" in str(path):
                with open(path, "wb") as f:
                    f.write(data[: len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            return real(path, data)
        files_mod.write_durable = write_durable
    """,
    "before-commit-rename": """
        real = os.replace
        def replace(src, dst):
            if str(dst).endswith("step_000004"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(src, dst)
        os.replace = replace
    """,
    "before-latest": """
        real = save_mod.replace_atomic
        def replace_atomic(path, data):
            if b"step_000004" in data:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(path, data)
        save_mod.replace_atomic = replace_atomic
    """,
}


@pytest.mark.parametrize("point", sorted(CRASH_POINTS))
def test_sigkill_during_checkpoint_write_then_resume_is_identical(reference, tmp_path, point):
    """A SIGKILL inside a checkpoint write leaves the previous one loadable; the resume matches the reference."""
    d = tmp_path / "run"
    args = ["train", "--run-dir", str(d)] + [x for s in TINY for x in ("--set", s)]
    proc = _run_python(f"""
        import os, signal
        import samestep.checkpoint.files as files_mod
        import samestep.checkpoint.save as save_mod
        {textwrap.indent(textwrap.dedent(CRASH_POINTS[point]), "        ").strip()}
        from samestep.cli import main
        main({args!r})
    """)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    latest = (d / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_000002"
    ok = cli_here("checkpoint", "verify", str(d / "checkpoints"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    final = train_here(d, *TINY, resume=True)
    assert final["state_digest"] == json.loads((reference / "final.json").read_text())["state_digest"]
    assert metrics_bytes(d) == metrics_bytes(reference)


def test_corrupt_newest_checkpoint_falls_back_on_resume(reference, tmp_path):
    """--resume skips a bit-flipped newest checkpoint, says so, and still ends bit-identical."""
    d = tmp_path / "run"
    train_here(d, *TINY, stop_after=6)
    model = d / "checkpoints" / "step_000006" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-5] ^= 0x10
    model.write_bytes(bytes(data))
    verify = cli_here("checkpoint", "verify", str(d / "checkpoints"))
    assert verify.returncode == 1 and "model.safetensors" in verify.stdout
    proc = cli_here(*train_cmd(d, *TINY, resume=True)[3:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped corrupt checkpoint step_000006" in proc.stdout
    assert (
        json.loads((d / "final.json").read_text())["state_digest"]
        == json.loads((reference / "final.json").read_text())["state_digest"]
    )


def test_resume_with_no_step_left_writes_the_same_final_json(reference, tmp_path):
    """Killed after the last checkpoint but before final.json: --resume trains nothing and writes the
    uninterrupted run's final.json byte for byte (the loss bits come from metrics.jsonl, not NaN)."""
    d = tmp_path / "run"
    shutil.copytree(reference, d)
    (d / "final.json").unlink()
    train_here(d, *TINY, resume=True)
    assert (d / "final.json").read_bytes() == (reference / "final.json").read_bytes()
    assert metrics_bytes(d) == metrics_bytes(reference)
    # Negative control: without the last step's loss bits in metrics.jsonl there are none to report, and
    # the same byte comparison sees the difference.
    e = tmp_path / "no_loss_bits"
    shutil.copytree(reference, e)
    (e / "final.json").unlink()
    lines = metrics_bytes(e).splitlines(keepends=True)
    (e / "metrics.jsonl").write_bytes(b"".join(lines[:-1]) + b'{"step": 8}\n')
    train_here(e, *TINY, resume=True)
    assert (e / "final.json").read_bytes() != (reference / "final.json").read_bytes()
    assert json.loads((e / "final.json").read_text())["loss_hex"] == "nan"
    # Without the last step's line at all, the metrics would stay incomplete: the resume refuses, naming it
    f = tmp_path / "no_last_line"
    shutil.copytree(reference, f)
    (f / "final.json").unlink()
    (f / "metrics.jsonl").write_bytes(b"".join(lines[:-1]))
    proc = cli_here(*train_cmd(f, *TINY, resume=True)[3:])
    assert proc.returncode == 2 and "are not 1..8 in order (missing: [8]" in proc.stderr
    assert not (f / "final.json").exists()


def two_nodes(
    run_dir: Path, *settings: str, node1_env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess]:
    """``samestep train`` as a job of two "nodes" on this machine: two torchrun agents, one process each,
    meeting through the c10d rendezvous on 127.0.0.1 (as two machines would through the first one's
    address). ``node1_env``: what the second node's environment has on top of this one's."""
    from samestep.cli.launch import free_port

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{port}",
        "--rdzv_id",
        f"samestep-{port}",
        *train_cmd(run_dir, *settings)[1:],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            cmd,
            env={**env, **((node1_env or {}) if n else {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        out.append(subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr))
    return out


def test_two_processes_on_one_node_and_on_two_nodes_match_one_process(reference, tmp_path):
    """A 2-process run launched on one machine, and the same run as two "nodes" (torchrun --nnodes 2, c10d
    rendezvous), give the 1-process run's final digest and metrics bytes: the reduction's order is the
    canonical one whatever carries the bytes."""
    one_node, nodes = side_by_side(
        lambda: run_train(tmp_path / "one", *TINY, nproc=2), lambda: two_nodes(tmp_path / "two", *TINY)
    )
    assert all(p.returncode == 0 for p in nodes), nodes[0].stderr[-3000:] + nodes[1].stderr[-3000:]
    want = json.loads((reference / "final.json").read_text())["state_digest"]
    assert one_node["state_digest"] == want
    assert json.loads((tmp_path / "two" / "final.json").read_text())["state_digest"] == want
    assert metrics_bytes(tmp_path / "one") == metrics_bytes(reference) == metrics_bytes(tmp_path / "two")
    for d in ("one", "two"):
        run = json.loads((tmp_path / d / "run.json").read_text())
        assert run["layout"] == {"world_size": 2, "microbatches_per_process": 2}
        assert "rank_env_diff" not in run  # the nodes' environments matched


def test_a_node_in_another_environment_is_refused_by_name_or_recorded_when_allowed(tmp_path):
    """A second node whose CPU kernels differ (ATEN_CPU_CAPABILITY=default) is refused before the first step:
    every process prints one line naming the rank, its host and the fields and exits 2, and nothing is
    written. With determinism.env_mismatch=warn (and the cross-rank check off) the run goes on and run.json
    records the differences by rank. (The matching nodes of the test above are the negative control: no refusal, no
    record.)"""
    skew = {"ATEN_CPU_CAPABILITY": "default"}
    refused, allowed = side_by_side(
        lambda: two_nodes(tmp_path / "refused", *TINY, node1_env=skew),
        # the cross-rank check off: replicas on other CPU kernels may drift apart in the update, which it stops
        lambda: two_nodes(
            tmp_path / "allowed",
            *TINY,
            "train.steps=2",
            "determinism.env_mismatch=warn",
            "train.cross_rank_check=false",
            node1_env=skew,
        ),
    )
    # The agent whose worker ended first reports its exit code 2. The other may instead lose the store its
    # rendezvous kept in that agent (torchrun's agents both listen on 127.0.0.1; the first to bind holds it)
    # before it sees its own worker's exit: its rank's line (which the input error's exit 2 prints) shows it.
    assert any("exitcode  : 2" in p.stderr for p in refused), refused[0].stderr[-3000:] + refused[1].stderr[-3000:]
    for p in refused:
        assert p.returncode != 0, p.stderr[-3000:]
        line = next(x for x in p.stderr.splitlines() if "samestep train: error:" in x)
        assert "the processes run in different environments" in line and "rank 1 (host " in line
        assert "env.ATEN_CPU_CAPABILITY" in line and "determinism.env_mismatch=warn" in line
    assert not (tmp_path / "refused" / "run.json").exists() and not (tmp_path / "refused" / "checkpoints").exists()
    assert all(p.returncode == 0 for p in allowed), allowed[0].stderr[-3000:] + allowed[1].stderr[-3000:]
    recorded = json.loads((tmp_path / "allowed" / "run.json").read_text())["rank_env_diff"]
    assert list(recorded) == ["1"] and "env.ATEN_CPU_CAPABILITY" in recorded["1"]["fields"]
    assert "different environments" in allowed[0].stderr + allowed[1].stderr


def test_existing_run_dir_is_not_overwritten(reference, tmp_path):
    """Training into a directory that holds a run without --resume is refused (exit 2); nothing changes."""
    before = metrics_bytes(reference)
    proc = cli_here(*train_cmd(reference, *TINY)[3:])
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert metrics_bytes(reference) == before


def test_resume_with_a_changed_config_is_refused(reference, tmp_path):
    """--resume under a config that would change the bits names the fields (exit 2)."""
    d = tmp_path / "run"
    train_here(d, *TINY, stop_after=2)
    proc = cli_here(*train_cmd(d, *TINY, "train.lr=0.5", resume=True)[3:])
    assert proc.returncode == 2 and "train.lr: 0.003 -> 0.5" in proc.stderr


def test_a_second_writer_is_refused_naming_the_holder_and_a_killed_one_blocks_nothing(tmp_path):
    """While a process holds a run directory (a live trainer), `samestep train --resume` on it is refused:
    exit 2, one line naming the holder's pid and host, nothing changed. Negative control: once the holder
    is killed (SIGKILL), the kernel has released its hold and the same resume runs."""
    import socket

    run, held = tmp_path / "run", tmp_path / "held"
    holder = Forked(
        [],
        code=f"import time; from samestep.records.lock import hold; hold({str(run)!r}); "
        f"open({str(held)!r}, 'w').close(); time.sleep(600)",
    )
    try:
        deadline = time.monotonic() + 300
        while not held.exists() and holder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held.exists(), holder.wait()
        proc = cli_here(*train_cmd(run, *TINY, resume=True)[3:])
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines() == [
            f"samestep train: error: {run} is in use by pid {holder.pid} on host {socket.gethostname()}, which is "
            "writing this run; wait for it to end (or stop it), or choose another run directory"
        ]
        assert sorted(p.name for p in run.iterdir()) == [".samestep.lock"]
    finally:
        holder.kill()
        holder.wait()
    assert train_here(run, *TINY, resume=True)["step"] == 8

"""The workloads people pretrain, on this CPU: the Llama-style decoder (RMSNorm, rotary positions, SwiGLU,
grouped-query attention through SDPA) and bf16 autocast, eager and compiled. For each: two runs give the
same bits, a run killed with SIGKILL and resumed gives the uninterrupted run's bits, and 1, 2 and 4
processes give the same bits (docs/design.md, "The contract")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from samestep.records.metrics import last_logged_step
from tests.support import TINY, Forked, metrics_bytes, run_train, side_by_side, train_cmd, train_here, train_ranks

pytestmark = pytest.mark.slow

BASE = (*[s for s in TINY if not s.startswith("train.steps")], "train.steps=6", "model.n_kv_head=1")
# `samestep *argv` with Inductor generating every kernel again instead of loading its graph from the caches (what
# TORCHINDUCTOR_FX_GRAPH_CACHE=0 and TORCHINDUCTOR_AUTOGRAD_CACHE=0 set in a fresh interpreter)
UNCACHED = """
import sys
import torch._functorch.config
import torch._inductor.config
from samestep.cli import main

torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False
sys.exit(main(sys.argv[1:]))
"""
CASES = {("llama", "fp32"): 2, ("llama", "bf16"): 4, ("gpt", "bf16"): 2}  # -> a process count besides 1


def _killed(run: Path, settings: tuple[str, ...], after: int) -> None:
    """A run SIGKILLed once it has logged step ``after``."""
    proc = Forked(train_cmd(run, *settings)[3:])
    deadline = time.monotonic() + 600
    while proc.poll() is None and last_logged_step(run) < after and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, proc.stderr[-3000:]


def _killed_then_resumed(run: Path, settings: tuple[str, ...], after: int, here: bool = False) -> dict:
    """``_killed``, then resumed to its end (in this process if ``here``); its final.json."""
    _killed(run, settings, after)
    return train_here(run, *settings, resume=True) if here else run_train(run, *settings, resume=True)


def test_llama_and_bf16_repeat_resume_and_match_across_process_counts(tmp_path):
    """{llama, gpt} x {fp32, bf16} (gpt fp32 is test_train's and test_layouts'): two runs identical to the
    bit; killed with SIGKILL after step 3 and resumed, identical; on 2 or 4 processes, identical. The two
    runs share this process; the killed run's process and the wider run's are fresh ones, compared with
    them to the bit. Negative control: the same check tells bf16 from fp32 (the Llama's final digests and
    loss bits differ)."""
    finals = {}
    for (arch, precision), nproc in CASES.items():
        settings = (*BASE, f"model.arch={arch}", f"train.precision={precision}")
        name = f"{arch}_{precision}"
        a, b = (train_here(tmp_path / f"{name}_{x}", *settings) for x in "ab")
        assert a["state_digest"] == b["state_digest"], name
        assert metrics_bytes(tmp_path / f"{name}_a") == metrics_bytes(tmp_path / f"{name}_b"), name
        resumed = _killed_then_resumed(tmp_path / f"{name}_k", settings, after=3, here=True)
        assert resumed["state_digest"] == a["state_digest"], name
        assert metrics_bytes(tmp_path / f"{name}_k") == metrics_bytes(tmp_path / f"{name}_a"), name
        wide = train_ranks(tmp_path / f"{name}_w", *settings, nproc=nproc)
        assert wide["state_digest"] == a["state_digest"] and wide["world_size"] == nproc, name
        assert metrics_bytes(tmp_path / f"{name}_w") == metrics_bytes(tmp_path / f"{name}_a"), name
        finals[name] = a["state_digest"]
        backend = json.loads((tmp_path / f"{name}_a" / "run.json").read_text()).get("attention_backend")
        assert (backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")) == (arch == "llama"), (name, backend)
    assert finals["llama_fp32"] != finals["llama_bf16"]
    assert metrics_bytes(tmp_path / "llama_fp32_a") != metrics_bytes(tmp_path / "llama_bf16_a")


# Each architecture and precision compiled once, on 1 process and on 2 (the suite's time: each process of a
# case compiles, or loads its compilation; the eager cases above and test_layouts' run on 4 and more)
@pytest.mark.parametrize("arch,precision,nproc", [("llama", "bf16", 2), ("gpt", "fp32", 2)])
def test_a_compiled_model_repeats_resumes_and_matches_across_process_counts(tmp_path, arch, precision, nproc):
    """train.compile=true (Inductor in deterministic mode, the forward and its loss compiled), each run in
    processes of its own that compile: a run killed with SIGKILL after step 3 and resumed in a new process is
    the run straight through to the bit (every loss line and the final state), and so is the run on 2
    processes. The first run fills Inductor's caches, which the others load as a resumed job does; the
    resume generates every kernel again with the graph caches off (a process that never compiled, FX graph
    and AOTAutograd caches disabled), so two independent compilations agree (its identical kernel sources find
    their compiled objects: gcc runs once). Negative control: the same comparison tells the same run eager
    (PyTorch's own kernels, no fusion) apart from the compiled one."""
    settings = (*BASE, f"model.arch={arch}", f"train.precision={precision}", "train.compile=true")
    a = run_train(tmp_path / "a", *settings)

    def killed_then_recompiled() -> dict:
        _killed(tmp_path / "r", settings, after=3)
        proc = Forked(train_cmd(tmp_path / "r", *settings, resume=True)[3:], code=UNCACHED)
        assert proc.wait() == 0, proc.stderr[-4000:]
        return json.loads((tmp_path / "r" / "final.json").read_text())

    resumed, wide = side_by_side(killed_then_recompiled, lambda: train_ranks(tmp_path / "w", *settings, nproc=nproc))
    assert resumed["state_digest"] == a["state_digest"] and metrics_bytes(tmp_path / "r") == metrics_bytes(
        tmp_path / "a"
    )
    assert wide["state_digest"] == a["state_digest"] and wide["world_size"] == nproc
    assert metrics_bytes(tmp_path / "w") == metrics_bytes(tmp_path / "a")
    eager = train_here(tmp_path / "e", *settings[:-1], "train.compile=false")
    assert eager["state_digest"] != a["state_digest"] and metrics_bytes(tmp_path / "e") != metrics_bytes(tmp_path / "a")


def test_a_compiled_run_with_autotuning_by_timing_is_refused(tmp_path):
    """max-autotune under train.compile: refused before anything runs, exit 2, one line naming the setting
    and the fix; nothing is written. Negative control: without it the same run starts (test above)."""
    proc = subprocess.run(
        train_cmd(tmp_path / "run", *BASE, "model.arch=llama", "train.compile=true"),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TORCHINDUCTOR_MAX_AUTOTUNE": "1"},
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch._inductor.config.max_autotune is on" in lines[0] and "Fix:" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

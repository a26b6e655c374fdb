"""samestep.enable(): sets, validates and records every knob; fails closed; reversible."""

from __future__ import annotations

import os

import pytest
import torch

import samestep
from samestep.determinism import mode, numerics


@pytest.fixture(autouse=True)
def cuda_not_started(monkeypatch):
    """These tests describe a process in which CUDA has not started (on a GPU machine another test in
    the same process may have started it, and then enable() rightly refuses to set cuBLAS's workspace)."""
    monkeypatch.setattr(mode, "_cuda_initialized", lambda: False)


def test_enable_refuses_a_cublas_workspace_it_can_no_longer_set(monkeypatch):
    """Once CUDA has started, setting CUBLAS_WORKSPACE_CONFIG may not reach cuBLAS: enable() refuses and
    says to export it first; with it exported, enable() accepts."""
    monkeypatch.setattr(mode, "_cuda_initialized", lambda: True)
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    with pytest.raises(
        ValueError,
        match=r"CUBLAS_WORKSPACE_CONFIG is not set and CUDA is already initialised.*"
        r"export CUBLAS_WORKSPACE_CONFIG=:4096:8",
    ):
        samestep.enable()
    assert not torch.are_deterministic_algorithms_enabled()  # failed closed: nothing half-set
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    samestep.enable()
    assert torch.are_deterministic_algorithms_enabled()


def test_enable_sets_every_knob_and_disable_restores():
    """enable() turns on deterministic algorithms and pins threads; disable() puts back what was there."""
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    os.environ.pop("NCCL_ALGO", None)
    torch.set_num_threads(2)
    report = samestep.enable(threads=1)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert torch.utils.deterministic.fill_uninitialized_memory is False
    assert torch.get_num_threads() == 1
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["NCCL_ALGO"] == "Ring"
    names = {k.name for k in report.knobs}
    assert {
        "torch.use_deterministic_algorithms",
        "torch.num_threads",
        "env.NCCL_ALGO",
        "env.CUBLAS_WORKSPACE_CONFIG",
        "torch.utils.deterministic.fill_uninitialized_memory",
    } <= names
    assert report.to_dict()["threads"] == 1 and "NCCL_ALGO" in str(report)
    samestep.disable()
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_num_threads() == 2
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ and "NCCL_ALGO" not in os.environ
    assert torch.utils.deterministic.fill_uninitialized_memory is True


def test_context_manager_disables_on_exit():
    """Leaving the with-block restores the previous settings."""
    with samestep.enable(threads=1):
        assert samestep.is_enabled()
    assert not samestep.is_enabled() and not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize(
    "name,value,needle",
    [
        ("NCCL_ALGO", "Tree", "NCCL_ALGO='Tree'"),
        ("NCCL_ALGO", "NVLS", "NCCL_ALGO='NVLS'"),
        ("CUBLAS_WORKSPACE_CONFIG", ":0:0", "CUBLAS_WORKSPACE_CONFIG=':0:0'"),
    ],
)
def test_enable_fails_closed_on_bad_knob(name, value, needle):
    """A setting that breaks determinism raises ValueError naming the variable, its value and the fix."""
    os.environ[name] = value
    with pytest.raises(ValueError) as err:
        samestep.enable(threads=1)
    assert needle in str(err.value) and "Fix:" in str(err.value)
    assert not samestep.is_enabled() and not torch.are_deterministic_algorithms_enabled()


def test_warn_only_turns_refusal_into_warning():
    """warn_only=True enables the rest and reports the bad knob as a warning."""
    os.environ["NCCL_ALGO"] = "Tree"
    with pytest.warns(RuntimeWarning, match="NCCL_ALGO='Tree'"):
        report = samestep.enable(threads=1, warn_only=True)
    assert report.warnings and torch.are_deterministic_algorithms_enabled()


def test_ring_and_valid_workspace_accepted():
    """User values that are already deterministic are kept as they are."""
    os.environ["NCCL_ALGO"] = "ring"
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    samestep.enable(threads=1)
    assert os.environ["NCCL_ALGO"] == "ring" and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_bad_thread_count_refused(threads):
    """The thread count must be a positive integer."""
    with pytest.raises(ValueError, match="threads"):
        samestep.enable(threads=threads)


def _layer_norm_grad_and_sum(threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, 512, generator=g, requires_grad=True)
    ln = torch.nn.LayerNorm(512)
    ln(x).pow(2).sum().backward()
    return ln.weight.grad.clone(), x.detach().sum()


def test_pinned_thread_count_is_what_makes_sums_repeat():
    """Same pinned thread count: identical bits. Negative control: 1 vs 2 threads differ (real, unplanted)."""
    with samestep.enable(threads=2):
        a = _layer_norm_grad_and_sum(torch.get_num_threads())
        b = _layer_norm_grad_and_sum(torch.get_num_threads())
    assert torch.equal(a[0].view(torch.int32), b[0].view(torch.int32))
    assert torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))
    one = _layer_norm_grad_and_sum(1)
    assert not torch.equal(one[0].view(torch.int32), a[0].view(torch.int32))
    assert not torch.equal(one[1].view(torch.int32), a[1].view(torch.int32))


def test_matmul_precision_reductions_attention_and_compiler_are_pinned_recorded_and_restored(monkeypatch):
    """enable() pins the knobs of bf16, TF32, fused attention and torch.compile (determinism/numerics.py): each
    reported with its value before, in environment(), watched for drift; disable() puts back every value
    a loop had, including the ones that are not PyTorch's defaults."""
    torch.set_float32_matmul_precision("high")  # sets allow_tf32 too
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.enable_cudnn_sdp(True)
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    before = numerics.values()
    try:
        report = samestep.enable(threads=1)
        knobs = {k.name: k for k in report.knobs}
        for knob in numerics.KNOBS:
            assert knobs[knob.name].before == before[knob.name] and knobs[knob.name].after == knob.value
            assert knob.get() == knob.value and samestep.environment()[f"numerics.{knob.name}"] == knob.value
        torch.backends.cuda.matmul.allow_tf32 = True  # a loop changing a knob behind enable()'s back
        assert mode.drifted(report) == {
            "torch.backends.cuda.matmul.allow_tf32": (False, True),
            "torch.float32_matmul_precision": ("highest", "high"),
        }
        samestep.disable()
        assert numerics.values() == before
    finally:
        samestep.disable()
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.enable_cudnn_sdp(True)
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)


def test_pinned_matmul_precision_gives_the_fp32_bits_on_this_cpu():
    """A loop that set float32 matmul precision to "medium" (bf16 inputs where the CPU has them) gets, under
    enable(), the bits of full fp32 matmuls. Negative control: under "medium" itself the bits differ on
    this machine (a CPU without a bf16 path would make them equal; then this control is skipped)."""
    torch.manual_seed(0)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    torch.set_float32_matmul_precision("highest")
    full = (a @ b).view(torch.int32)
    torch.set_float32_matmul_precision("medium")
    try:
        medium = (a @ b).view(torch.int32)
        with samestep.enable(threads=torch.get_num_threads()):
            assert torch.equal((a @ b).view(torch.int32), full)
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision("highest")
    if torch.equal(medium, full):
        pytest.skip("this CPU has no bf16 path for fp32 matmuls: the negative control cannot show a difference")
    assert not torch.equal(medium, full)


def test_compiler_settings_that_time_kernels_are_refused():
    """max-autotune picks compiled kernels by timing them: enable() refuses it, naming the setting and the
    fix; warn_only warns instead. Negative control: with it off, enable() accepts and pins Inductor's
    deterministic mode, and disable() puts back what was there."""
    import torch._inductor.config as config

    # Inductor's own patch: monkeypatch would delete the setting on undo (it finds no module __dict__ entry),
    # which hides it from every later test in the process
    with config.patch(max_autotune=True):
        with pytest.raises(
            ValueError,
            match=r"torch._inductor.config.max_autotune is on \(TORCHINDUCTOR_MAX_AUTOTUNE\)"
            r".*Fix: turn it off",
        ):
            samestep.enable(threads=1)
        assert not torch.are_deterministic_algorithms_enabled()
        with pytest.warns(RuntimeWarning, match="max_autotune"):
            samestep.enable(threads=1, warn_only=True)
        samestep.disable()
    with config.patch(max_autotune=False, deterministic=False):
        with samestep.enable(threads=1):
            assert config.deterministic is True
        assert config.deterministic is False
    assert config.max_autotune is False  # still there for whatever runs next


def test_the_knob_probe_moves_with_every_knob_enable_sets():
    """The recorder checks the knobs at each step through knob_probe(), a cheap change detector, and asks
    drifted() which knob moved only when it changed: every knob current_knobs() reads must move the probe
    (a knob added without a probe reader fails here). Negative control: the probe is unchanged while no
    knob moves."""
    others = {  # the knobs outside numerics.KNOBS, each with a way to move it
        "torch.use_deterministic_algorithms": lambda v: torch.use_deterministic_algorithms(v, warn_only=True),
        "torch.backends.cudnn.deterministic": lambda v: setattr(torch.backends.cudnn, "deterministic", v),
        "torch.backends.cudnn.benchmark": lambda v: setattr(torch.backends.cudnn, "benchmark", v),
        "torch.utils.deterministic.fill_uninitialized_memory": lambda v: setattr(
            torch.utils.deterministic, "fill_uninitialized_memory", v
        ),
        "torch.num_threads": torch.set_num_threads,
    }
    setters = {**others, **{k.name: k.set for k in numerics.KNOBS}}
    unmovable = {"samestep.kernels"}  # samestep's own: only enable() and disable() change it
    assert set(mode.current_knobs()) == set(setters) | unmovable
    with samestep.enable(threads=1) as report:
        probe = mode.knob_probe()
        assert mode.knob_probe() == probe
        for knob in report.knobs:
            if knob.name not in setters:
                continue
            other = (
                {"highest": "high"}[knob.after]
                if isinstance(knob.after, str)
                else not knob.after
                if isinstance(knob.after, bool)
                else knob.after + 1
            )
            setters[knob.name](other)
            try:
                assert mode.knob_probe() != probe, knob.name
                assert mode.drifted(report)[knob.name] == (knob.after, other)
            finally:
                setters[knob.name](knob.after)
            assert mode.knob_probe() == probe

"""torchtitan's own trainer under ``--module samestep.integrations.torchtitan`` (its Llama 3 debug model, its
FSDP2 helper, its DCP checkpoint), run through torchtitan's entry point on 1 and 2 gloo processes: the same
loss and grad-norm bits and the same checkpointed model and optimizer bytes on both, and after a kill and a
resume through torchtitan's checkpoint; with torchtitan's own accumulation and reduction instead, other
bytes on 2 processes; a resume that restores another optimizer state is refused by its receipts, and one on
another layout while receipts are on (2 -> 1 without them: the one process's bytes).

What torchtitan needs CUDA for is stood in for in each trainer process, never in the shipped module
(tests/programs/titan_on_cpu.py). Every run starts from one seed checkpoint (torchtitan's way to the same
initial weights on any layout)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from samestep.analysis.receipt_diff import by_rank, first_receipt_difference
from samestep.records.receipts import read_run_receipts
from tests.forgery import rewrite_receipts
from tests.programs.titan_on_cpu import on_cpu
from tests.support import cli_here, spawn

PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "titan_on_cpu.py"

pytestmark = pytest.mark.slow

ARGS = (
    "--module",
    "samestep.integrations.torchtitan",
    "--config",
    "llama3_debugmodel",
    "--training.seq_len",
    "16",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "8",
    "--training.steps",
    "4",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--training.disable_cuda_graphs",
    "--parallelism.spmd_backend",
    "partial_dtensor",
    "--metrics.log_freq",
    "1",
)


def _trainer(rank: int, world: int, port: int, argv: list[str], kill_at: int | None) -> None:
    """One process of torchtitan's entry point (``python -m torchtitan.train ARGV``), as torchrun starts it."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    sys.stdout = open(os.devnull, "w")
    on_cpu()
    if kill_at is not None:
        from samestep.integrations.torchtitan import SamestepTrainer

        step = SamestepTrainer.train_step

        def dying(self, data_iterator):
            if self.step == kill_at and rank == world - 1:
                os._exit(9)  # killed as the step starts
            return step(self, data_iterator)

        SamestepTrainer.train_step = dying
    from torchtitan.train import main

    sys.argv = ["torchtitan.train", *argv]
    main()


def titan(dump: Path, *extra: str, nproc: int = 1, kill_at: int | None = None, seed: Path | None = None) -> None:
    """torchtitan's trainer with ``ARGS`` and ``extra`` into ``dump`` on ``nproc`` processes, from the seed
    checkpoint ``seed`` (copied in as step 0) where given."""
    from samestep.cli.launch import free_port

    if seed is not None and not (dump / "checkpoint").exists():
        shutil.copytree(seed, dump / "checkpoint" / "step-0")
    spawn(
        _trainer,
        (nproc, free_port(), [*ARGS, "--dump_folder", str(dump), *extra], kill_at),
        nproc,
        None if kill_at is None else 9,
    )


def receipt_bits(dump: Path) -> list[tuple[int, str, str]]:
    """(step, loss bits, grad-norm bits) of rank 0's receipts."""
    lines = (dump / "receipts" / "rank_00000.jsonl").read_text().splitlines()[1:]
    return [(r["step"], r["loss_hex"], r["grad_norm_hex"]) for r in map(json.loads, lines)]


def checkpointed(dump: Path, step: int = 4) -> dict[str, bytes]:
    """The model and optimizer tensors of torchtitan's checkpoint of ``step``, whole, as bytes by name (the
    data position and the trainer's own state, each rank's RNG, left out)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(dump / "checkpoint" / f"step-{step}", Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", weights_only=True)

    def tensors(tree: dict, prefix: str = "") -> dict[str, bytes]:
        out = {}
        for name, value in tree.items():
            if isinstance(value, dict):
                out |= tensors(value, f"{prefix}{name}/")
            elif isinstance(value, torch.Tensor):
                out[prefix + name] = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return out

    return tensors({k: v for k, v in state.items() if k not in ("dataloader", "train_state")})


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Path:
    """torchtitan's seed checkpoint, made on one process."""
    dump = tmp_path_factory.mktemp("seed")
    titan(dump, "--checkpoint.create_seed_checkpoint")
    return dump / "checkpoint" / "step-0"


@pytest.fixture(scope="module")
def one(seed, tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("one")
    titan(dump, seed=seed)
    return dump


@pytest.fixture(scope="module")
def killed(seed, tmp_path_factory) -> Path:
    """2 processes, the last killed as step 4 starts: torchtitan's checkpoints of steps 0 and 2."""
    dump = tmp_path_factory.mktemp("killed") / "run"
    titan(dump, nproc=2, kill_at=4, seed=seed)
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-0", "step-2"]
    return dump


def _torchrun(where: Path, dump: str, nproc: int, seed: Path) -> None:
    """tests/programs/titan_on_cpu.py under torchrun in ``where``, as a user runs torchtitan, into ``where/dump``
    from the seed checkpoint."""
    shutil.copy(PROGRAM, where)
    shutil.copytree(seed, where / dump / "checkpoint" / "step-0")
    env = {k: v for k, v in os.environ.items() if k != "SAMESTEP_REPLAY"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            "titan_on_cpu.py",
            *ARGS,
            "--dump_folder",
            dump,
        ],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_one_and_two_processes_and_a_kill_and_resume_give_the_same_bits(seed, one, killed, tmp_path):
    """On 2 processes (FSDP2, torchtitan run under torchrun), and on 2 killed in step 4 and resumed from
    torchtitan's checkpoint of step 2, the loss and grad-norm bits of every step and the model and optimizer
    bytes of the checkpoint of step 4 are the one process's; every rank's receipts hold. `samestep verify`
    of steps 3-4 of the torchrun job runs it again under torchrun on 2 processes from a copy of torchtitan's
    checkpoint of step 2, and every rank's receipts reproduce. Negative control: a loss edited in the receipts
    of step 4 (the chain rehashed) differs from the replay's by the same comparison."""
    two, resumed = tmp_path / "two", tmp_path / "resumed"
    _torchrun(tmp_path, "two", 2, seed)
    shutil.copytree(killed, resumed)
    titan(resumed, nproc=2)
    reference = checkpointed(one)
    assert len(receipt_bits(one)) == 4 and any(name.startswith("optimizer/") for name in reference)
    for dump in (two, resumed):
        assert receipt_bits(dump) == receipt_bits(one)
        assert checkpointed(dump) == reference, dump.name
    verify = cli_here("receipts", "verify", str(resumed))
    assert verify.returncode == 0 and "rank 1: steps 1-4" in verify.stdout, verify.stdout + verify.stderr

    program = json.loads((two / "run.json").read_text())["programs"][0]
    assert program["launcher"] == {"name": "torchrun", "nproc_per_node": 2, "nnodes": 1}
    assert program["resumes"] == {"by": "torchtitan", "checkpoints": "checkpoint", "folder": "checkpoint"}
    report = json.loads(
        cli_here("verify", "--yes", str(two), "--steps", "3-4", "--json", "--keep", str(tmp_path / "replay")).stdout
    )
    assert report["reproduced"] and report["replayed_from"] == 2 and report["compared"] == 4, report
    rewrite_receipts(two / "receipts" / "rank_00000.jsonl", lambda rs: rs[3].update(loss_hex=(0.5).hex()))
    mismatch, _, _ = first_receipt_difference(
        by_rank(read_run_receipts(two)), by_rank(read_run_receipts(tmp_path / "replay")), range(3, 5)
    )
    assert mismatch is not None and (mismatch["step"], mismatch["fields"]) == (4, ["loss_hex"]), mismatch


def test_a_resume_on_another_layout_is_refused_by_its_receipts_and_exact_without_them(one, killed, tmp_path):
    """The checkpoint of 2 sharded processes resumed on 1: its receipts are of the 2 ranks' shards, which cannot
    check the whole state torchtitan restored, so the resume is refused, naming both layouts; without receipts
    it goes on to the one process's checkpointed bytes."""
    dump = tmp_path / "run"
    shutil.copytree(killed, dump)
    with pytest.raises(Exception, match="written by 2 process.*their shards.*1 process.*no-receipts"):
        titan(dump)
    titan(dump, "--samestep.no-receipts")
    assert checkpointed(dump) == checkpointed(one)


def _reporting(rank: int, world: int, port: int, argv: list[str], kill_at: int | None, errors: str) -> None:
    """``_trainer``, leaving the error a training step raises in ``errors``/rank<N>.txt as it is raised (before
    torchtitan closes its trainer)."""
    from samestep.integrations.torchtitan import SamestepTrainer

    step = SamestepTrainer.train_step

    def reporting(self, data_iterator):
        try:
            return step(self, data_iterator)
        except BaseException as e:
            (Path(errors) / f"rank{rank}.txt").write_text(f"{type(e).__name__}: {e}")
            raise

    SamestepTrainer.train_step = reporting
    _trainer(rank, world, port, argv, kill_at)


def test_a_refusal_on_one_rank_stops_every_rank_before_anything_is_written(killed, tmp_path):
    """The checkpoint of 2 sharded processes resumed on 2, rank 1's receipt of step 2 recording another state
    (its chain rehashed): rank 1 refuses, naming its file, and rank 0, whose own check passed, learns it before
    starting its files (``agree``) and stops too, saying another rank refused; no file of the run changes.
    Negative control (by hand, the agreement left out): rank 0 goes on into the step and dies of its peer's
    exit, a gloo error ("Connection closed by peer") where this says why."""
    from samestep.cli.launch import free_port

    dump, errors = tmp_path / "run", tmp_path / "errors"
    shutil.copytree(killed, dump)
    errors.mkdir()
    rewrite_receipts(dump / "receipts" / "rank_00001.jsonl", lambda rs: rs[1].update(state="0" * 32))

    def files() -> dict[Path, bytes]:
        """The run's records and checkpoints (not the lock's holder, nor torchtitan's own logs)."""
        return {
            p: p.read_bytes()
            for p in sorted(dump.rglob("*"))
            if p.is_file() and p.name != ".samestep.lock" and "structured_logs" not in p.parts
        }

    before = files()
    with pytest.raises(Exception, match="refused|restores state"):  # whichever rank's error is found first
        spawn(_reporting, (2, free_port(), [*ARGS, "--dump_folder", str(dump)], None, str(errors)), 2)
    said = {p.name: p.read_text() for p in errors.iterdir()}
    assert said["rank1.txt"].startswith("ReceiptError: the checkpoint of step 2 restores state"), said
    assert "rank_00001.jsonl" in said["rank1.txt"]
    assert said["rank0.txt"].startswith("RefusedElsewhere: ") and "another rank refused" in said["rank0.txt"], said
    assert files() == before


def test_torchtitans_own_accumulation_gives_other_bytes_on_two_processes(seed, tmp_path):
    """Negative control: with torchtitan's own order (gradients added as microbatches arrive, FSDP2's
    reduce-scatter, its norm: ``--samestep.no-canonical``), 2 processes end on other bytes than 1."""
    one, two = tmp_path / "one", tmp_path / "two"
    titan(one, "--samestep.no-canonical", seed=seed)
    titan(two, "--samestep.no-canonical", nproc=2, seed=seed)
    assert checkpointed(one) != checkpointed(two)


def test_a_resume_that_restores_another_optimizer_state_is_refused(one, tmp_path):
    """torchtitan told to leave the optimizer out of its load builds a fresh one: the restored state is not
    rank 0's receipt of step 2, so the resume stops before its first step, naming it, and cuts nothing."""
    dump = tmp_path / "run"
    shutil.copytree(one, dump)
    shutil.rmtree(dump / "checkpoint" / "step-4")  # torchtitan resumes from step 2
    with pytest.raises(Exception, match="the checkpoint of step 2 restores state"):
        titan(dump, "--checkpoint.exclude_from_loading", "optimizer")
    assert receipt_bits(dump) == receipt_bits(one)

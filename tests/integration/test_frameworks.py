"""The framework callbacks, with the real libraries, through the frameworks' own checkpoints: two runs and a
run killed (SIGKILL) and resumed give the same bits, and a resume that would leave the run's numerical
path (an RNG file gone, a loader that restarts the epoch's data) is refused. The runs are the examples
(examples/hf_trainer.py, examples/lightning_fit.py), each in its own process."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

from tests.support import Forked, cli_here

ROOT = Path(__file__).resolve().parents[2]


def _together(*runs: tuple) -> list[Forked]:
    """Runs the examples side by side (independent runs; the machine's cores are shared), each as
    ``python examples/<example> ...`` runs it, in a process of its own (``Forked``); the ended processes."""
    procs = [Forked([str(out), *args], script=ROOT / "examples" / example) for example, out, *args in runs]
    for p in procs:
        p.wait()
    return procs


def _digest(proc: Forked) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def _diff(a: Path, b: Path) -> int:
    return cli_here("diff", str(a), str(b)).returncode


def _same_receipts(straight: Path, resumed: Path) -> None:
    """The resumed run's receipts are the straight run's byte for byte, and `samestep receipts verify` holds."""
    mine, theirs = (d / "receipts" / "rank_00000.jsonl" for d in (resumed, straight))
    assert mine.read_bytes() == theirs.read_bytes() and mine.read_bytes().count(b"\n") > 1
    verified = cli_here("receipts", "verify", str(resumed))
    assert verified.returncode == 0, verified.stdout + verified.stderr


def _refused_by_config(proc: Forked, change: str) -> None:
    """A resume under another declared config: one line naming the change, exit 2, no traceback."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert change in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_hf_trainer_killed_and_resumed_is_the_run_straight_through(tmp_path):
    """A GPT-2 (dropout on) under transformers.Trainer with SamestepCallback: killed once checkpoint-3 is
    saved and resumed through the Trainer's own resume_from_checkpoint, it ends on the straight run's
    digest, and `samestep diff` compares the traces of all 6 steps, the first 3 from two independent runs,
    identical (exit 0); its receipts are the straight run's byte for byte, and verify. Negative controls: the same
    killed run, its rng_state.pth removed (the Trainer
    only warns, and goes on elsewhere), is refused before its first step, naming the RNG; resumed with another
    seed (the data order's, which no checkpoint holds), it is refused in one line naming the argument."""
    straight, killed = _together(
        ("hf_trainer.py", tmp_path / "straight"), ("hf_trainer.py", tmp_path / "cut", "--kill-after", "3")
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    shutil.copytree(tmp_path / "cut", tmp_path / "norng")
    shutil.copytree(tmp_path / "cut", tmp_path / "reseeded")
    (tmp_path / "norng" / "checkpoint-3" / "rng_state.pth").unlink()
    resumed, refused, reseeded = _together(
        ("hf_trainer.py", tmp_path / "cut", "--resume"),
        ("hf_trainer.py", tmp_path / "norng", "--resume"),
        ("hf_trainer.py", tmp_path / "reseeded", "--resume", "--seed", "1"),
    )
    _refused_by_config(reseeded, "config.TrainingArguments.seed: 0 -> 1")
    assert _digest(resumed) == _digest(straight)
    assert _diff(tmp_path / "straight", tmp_path / "cut") == 0
    _same_receipts(tmp_path / "straight", tmp_path / "cut")
    assert refused.returncode != 0 and "ResumeMismatch" in refused.stderr and "rng differs" in refused.stderr


def test_lightning_killed_and_resumed_mid_epoch_is_the_run_straight_through(tmp_path):
    """A Lightning module (dropout, a per-step LR schedule, 2 batches per step) with SamestepCallback and a
    KeyedSampler: killed after checkpoint 3 (6 batches into an 8-batch epoch) and resumed with
    fit(ckpt_path=...), it ends on the straight run's digest, the traces are identical (exit 0), and its
    receipts are the straight run's byte for byte, and verify.
    Lightning saves no RNG state and restarts a plain loader's epoch: negative control, the same resume
    with torch's RandomSampler is refused, naming the fix; and one under another seed (the data is made from
    it, declared as the callback's config) is refused in one line naming it."""
    straight, killed, plain = _together(
        ("lightning_fit.py", tmp_path / "straight"),
        ("lightning_fit.py", tmp_path / "cut", "--kill-after", "3"),
        ("lightning_fit.py", tmp_path / "plain", "--kill-after", "3", "--plain-sampler"),
    )
    assert killed.returncode == plain.returncode == -signal.SIGKILL, killed.stderr[-2000:] + plain.stderr[-2000:]
    shutil.copytree(tmp_path / "cut", tmp_path / "reseeded")
    resumed, refused, reseeded = _together(
        ("lightning_fit.py", tmp_path / "cut", "--resume"),
        ("lightning_fit.py", tmp_path / "plain", "--resume", "--plain-sampler"),
        ("lightning_fit.py", tmp_path / "reseeded", "--resume", "--seed", "1"),
    )
    _refused_by_config(reseeded, "config.seed: 0 -> 1")
    assert _digest(resumed) == _digest(straight)
    assert _diff(tmp_path / "straight", tmp_path / "cut") == 0
    _same_receipts(tmp_path / "straight", tmp_path / "cut")
    assert refused.returncode != 0 and "ResumeMismatch" in refused.stderr and "KeyedSampler" in refused.stderr


def test_a_callback_that_changes_the_model_after_samesteps_receipt_is_named_at_the_save(tmp_path):
    """The example's PlantAt (one ULP added to a weight in on_step_end) listed after SamestepCallback, at the
    step the Trainer saves: the state saved is not the one samestep's receipt of that step records (so no resume
    from it could pass its check, and verify would call the checkpoint not the run's); the save says so at once,
    naming the checkpoint, what happened and the fix. Control: listed before it, as the example lists it, the
    receipt holds the change and the save passes."""
    code = (
        "import sys, torch\n"
        "from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments\n"
        f"sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "from hf_trainer import PlantAt, Tokens\n"
        "from samestep.integrations.huggingface import SamestepCallback\n"
        "out = sys.argv[1]\n"
        "plant, samestep_cb = PlantAt(3), SamestepCallback()\n"
        "callbacks = [samestep_cb, plant] if sys.argv[2] == 'after' else [plant, samestep_cb]\n"
        "args = TrainingArguments(output_dir=out, max_steps=3, save_steps=3, per_device_train_batch_size=4,\n"
        "                         use_cpu=True, report_to=[], logging_steps=100, dataloader_num_workers=0)\n"
        "torch.manual_seed(0)\n"
        "config = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2)\n"
        "Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(), callbacks=callbacks).train()\n"
    )
    after, before = (Forked([str(tmp_path / order), order], code=code) for order in ("after", "before"))
    after.wait(), before.wait()
    assert after.returncode != 0, after.stderr[-3000:]
    assert "checkpoint-3: the Trainer saved another state than samestep's receipt of step 3" in after.stderr
    assert "list SamestepCallback after that callback" in after.stderr
    assert before.returncode == 0, before.stderr[-3000:]
    assert (tmp_path / "before" / "checkpoint-3" / "samestep.json").is_file()

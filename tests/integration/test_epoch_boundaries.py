"""Framework resumes at an epoch's end, in this process with the real libraries: a checkpoint written after an
epoch's last step resumes to the bits of the run straight through (Lightning's and the HF Trainer's), a
resume that lost its RNG file is still refused, and Lightning's warning about a loader it cannot resume
stays quiet where samestep's KeyedSampler resumes it."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

import samestep


def _params(module: torch.nn.Module) -> str:
    return samestep.digest(torch.cat([p.detach().reshape(-1) for p in module.parameters()]))


# -- Lightning ------------------------------------------------------------------------------------------
def _lightning(run: Path, ckpt: Path | None = None, samestep_callback: bool = True, seed: int = 0) -> str:
    import lightning.pytorch as pl

    from samestep.integrations.lightning import KeyedSampler, SamestepCallback

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    x = torch.randn(20, 8, generator=samestep.rng.generator(0, 0, 0, "dataset"))
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    # 5 batches of 4 an epoch, one per step: the checkpoint of step 15 ends epoch 2
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=KeyedSampler(len(data), seed))
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=run / "checkpoints", every_n_train_steps=3, save_top_k=-1)
    callbacks = [checkpoints] + ([SamestepCallback(run)] if samestep_callback else [])
    pl.seed_everything(seed, verbose=False)
    module = Regression()
    trainer = pl.Trainer(
        max_steps=20,
        callbacks=callbacks,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=run,
    )
    trainer.fit(module, loader, ckpt_path=str(ckpt) if ckpt else None)
    return _params(module)


def test_lightning_resumed_at_an_epochs_end_is_the_run_straight_through(tmp_path):
    """Resumed from epoch=2-step=15.ckpt (written after epoch 2's last step), the run trains epoch 3 from its
    first batch and ends on the straight run's weights; resumed mid-epoch (step 12) likewise, without
    Lightning's "dataloader is not resumable" warning. Controls: another data seed gives other weights (the
    comparison can fail), and Lightning alone, resumed mid-epoch, does warn."""
    straight = _lightning(tmp_path / "straight")
    ckpts = tmp_path / "straight" / "checkpoints"
    assert (ckpts / "epoch=2-step=15.ckpt").exists()
    for name in ("epoch=2-step=15.ckpt", "epoch=2-step=12.ckpt"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert _lightning(tmp_path / name, ckpts / name) == straight, name
        assert not [w for w in seen if "not resumable" in str(w.message)], name
    assert _lightning(tmp_path / "other", seed=1) != straight
    _lightning(tmp_path / "plain", samestep_callback=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _lightning(
            tmp_path / "plain_resumed",
            tmp_path / "plain" / "checkpoints" / "epoch=2-step=12.ckpt",
            samestep_callback=False,
        )
    assert [w for w in seen if "not resumable" in str(w.message)]


# -- the Hugging Face Trainer ---------------------------------------------------------------------------
class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 96, (16,), generator=samestep.rng.generator(0, 0, i, "tokens"))
        return {"input_ids": ids, "labels": ids}


def _hf(out: Path, resume: Path | None = None) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from samestep.integrations.huggingface import SamestepCallback

    # 48 samples, 4 a batch, 2 batches a step: 6 steps an epoch; checkpoint-6 ends epoch 0
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=12,
        save_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        seed=0,
        use_cpu=True,
        report_to=[],
        logging_steps=100,
        dataloader_num_workers=0,
    )
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    callback = SamestepCallback()
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=_Tokens(), callbacks=[callback])
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    finally:
        callback.close()
    return _params(trainer.model)


def test_hf_trainer_resumed_at_an_epochs_end_is_the_run_straight_through(tmp_path):
    """Resumed from checkpoint-6 (the end of epoch 0), the Trainer's run is accepted and ends on the straight
    run's weights (the next epoch's sampler draws its order from the restored RNG before the first step, as
    it did straight through). Control: the same checkpoint without its rng_state.pth is refused, naming the
    RNG."""
    from samestep.integrations.huggingface import ResumeMismatch

    straight = _hf(tmp_path / "straight")
    for name, keep_rng in (("resumed", True), ("norng", False)):
        shutil.copytree(tmp_path / "straight" / "checkpoint-6", tmp_path / name / "checkpoint-6")
        if not keep_rng:
            (tmp_path / name / "checkpoint-6" / "rng_state.pth").unlink()
    assert _hf(tmp_path / "resumed", tmp_path / "resumed" / "checkpoint-6") == straight
    with pytest.raises(ResumeMismatch, match="rng"):
        _hf(tmp_path / "norng", tmp_path / "norng" / "checkpoint-6")

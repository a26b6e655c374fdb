"""PyTorch Lightning with samestep: one callback, a sampler that can resume mid-epoch, exact resumes.

python examples/lightning_fit.py runs/pl                     # 6 steps, a checkpoint every 3
python examples/lightning_fit.py runs/plcut --kill-after 3   # killed (SIGKILL) after checkpoint 3 ...
python examples/lightning_fit.py runs/plcut --resume         # ... resumed: the same bits as runs/pl
samestep diff runs/pl runs/plcut                             # exit 0: identical
python examples/lightning_fit.py runs/plp --plant-step 5     # one ULP added to a weight after step 5 ...
samestep bisect runs/pl runs/plp                             # ... found: diverged at step 5
"""

import argparse
import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import torch

import samestep
from samestep.integrations.lightning import KeyedSampler, SamestepCallback


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), "interval": "step"},
        }


class KillAfter(pl.Callback):
    """Kills the process, as a node failure would, once the checkpoint of step ``step`` is on disk."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class PlantAt(pl.Callback):
    """Adds one ULP to a weight after step ``step``'s update (a difference for samestep bisect to find); before
    SamestepCallback in the list, so that step's receipt holds it."""

    def __init__(self, step: int) -> None:
        self.step, self.done = step, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not self.done:  # the batch that ended the step's update
            self.done = True
            with torch.no_grad():
                w = pl_module.net[0].weight.view(-1)
                w[0] = torch.nextafter(w[0], torch.tensor(float("inf")))


def main(
    run: Path,
    kill_after: int | None,
    resume: bool,
    seed: int,
    plain: bool,
    without: bool,
    plant_step: int | None = None,
) -> str:
    g = samestep.rng.generator(seed, 0, 0, "dataset")
    x = torch.randn(32, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    # 8 batches of 4 an epoch, 2 per step: step 3 ends mid-epoch, and 6 steps reach the second epoch
    sampler = torch.utils.data.RandomSampler(data) if plain else KeyedSampler(len(data), seed)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=run / "checkpoints", every_n_train_steps=3, save_top_k=-1)
    callbacks = (
        [checkpoints]
        + ([PlantAt(plant_step)] if plant_step else [])
        + ([] if without else [SamestepCallback(run, config={"seed": seed})])
        + ([KillAfter(kill_after)] if kill_after else [])
    )
    pl.seed_everything(seed, verbose=False)
    module = Regression()
    trainer = pl.Trainer(
        max_steps=6,
        accumulate_grad_batches=2,
        callbacks=callbacks,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=run,
    )
    last = sorted(checkpoints.dirpath and Path(checkpoints.dirpath).glob("*.ckpt"), key=os.path.getmtime)
    trainer.fit(module, loader, ckpt_path=str(last[-1]) if resume else None)
    return samestep.digest(torch.cat([p.detach().reshape(-1) for p in module.parameters()]))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--kill-after", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plain-sampler", action="store_true", help="torch's RandomSampler, which cannot resume")
    ap.add_argument("--without-samestep", action="store_true", help="Lightning alone, for comparison")
    ap.add_argument("--plant-step", type=int, default=None, help="one ULP added to a weight after this step")
    a = ap.parse_args()
    print(main(a.run, a.kill_after, a.resume, a.seed, a.plain_sampler, a.without_samestep, a.plant_step))

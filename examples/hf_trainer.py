"""The Hugging Face Trainer with samestep: one callback; its resume checked to the bit.

python examples/hf_trainer.py runs/hf                     # 6 steps, a checkpoint every 3
python examples/hf_trainer.py runs/hfcut --kill-after 3   # killed (SIGKILL) once checkpoint-3 is saved ...
python examples/hf_trainer.py runs/hfcut --resume         # ... resumed: the same bits as runs/hf
samestep diff runs/hf runs/hfcut                          # exit 0: identical
samestep verify runs/hf --steps 4-6                       # replayed from checkpoint-3: reproduced
python examples/hf_trainer.py runs/hfp --plant-step 5     # one ULP added to a weight after step 5 ...
samestep bisect runs/hf runs/hfp                          # ... found: diverged at step 5
"""

import argparse
import os
import signal
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import samestep
from samestep.integrations.huggingface import SamestepCallback


class Tokens(torch.utils.data.Dataset):
    """64 sequences of random tokens, each a pure function of its index."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 96, (16,), generator=samestep.rng.generator(0, 0, i, "tokens"))
        return {"input_ids": ids, "labels": ids}


class KillAfter(TrainerCallback):
    """Kills the process, as a node failure would, once the checkpoint of step ``step`` is saved."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class PlantAt(TrainerCallback):
    """Adds one ULP to a weight after step ``step``'s update (a difference for samestep bisect to find); before
    SamestepCallback in the list, so that step's receipt holds it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                w = model.transformer.wte.weight.view(-1)
                w[0] = torch.nextafter(w[0], torch.tensor(float("inf")))


def main(
    out: Path, kill_after: int | None, resume: bool, seed: int, without: bool = False, plant_step: int | None = None
) -> str:
    callbacks = (
        ([PlantAt(plant_step)] if plant_step else [])
        + ([] if without else [SamestepCallback()])
        + ([KillAfter(kill_after)] if kill_after else [])
    )
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=6,
        save_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        seed=seed,
        use_cpu=True,
        report_to=[],
        logging_steps=100,
        dataloader_num_workers=0,
    )
    torch.manual_seed(seed)  # the model's initial weights (the Trainer reseeds with args.seed for training)
    config = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2)  # dropout 0.1 on
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=True if resume else None)
    return samestep.digest(torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--kill-after", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--without-samestep", action="store_true", help="the Trainer alone, for comparison")
    ap.add_argument("--plant-step", type=int, default=None, help="one ULP added to a weight after this step")
    a = ap.parse_args()
    print(main(a.out, a.kill_after, a.resume, a.seed, a.without_samestep, a.plant_step))

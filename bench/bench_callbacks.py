"""What the framework callbacks cost a Trainer as users run it, side by side with the same Trainer without them:
transformers' Trainer on a tiny GPT-2 with ``SamestepCallback()``, and Lightning's Trainer on its demo
Transformer (``lightning.pytorch.demos.LightningTransformer``) with ``SamestepCallback(run_dir)``.

    .venv/bin/python bench/bench_callbacks.py [--pairs 3] [--steps 60] [--frameworks hf,lightning] [--json]

Each pair trains a fresh model ``--steps`` optimizer steps without the callback, then with it (the callback's
defaults: a trace at step level and a receipt of every step), each into a fresh directory, one intra-op thread
on both sides; only ``train()`` / ``fit()`` is timed. The first pair warms up, untimed; reported: each side's
median seconds and the median of the per-pair ratios. The frameworks' own checkpoints are off on both sides
(a user's ``save_steps`` prices the same on both).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import samestep

VOCAB, SEQ = 256, 64


class Tokens(torch.utils.data.Dataset):
    """Sequences of random tokens, each a pure function of its index."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.randint(0, VOCAB, (SEQ,), generator=samestep.rng.generator(0, 0, i, "tokens"))


def hf_side(root: Path, steps: int, callback: bool) -> float:
    """A transformers Trainer on a 2-layer GPT-2 (dropout on), 2 accumulated batches of 4 a step."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from samestep.integrations.huggingface import SamestepCallback

    class Ids(Tokens):
        def __getitem__(self, i: int) -> dict:
            ids = super().__getitem__(i)
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=96, n_layer=2, n_head=4))
    args = TrainingArguments(
        output_dir=str(root),
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        save_strategy="no",
        report_to=[],
        logging_steps=10_000,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=Ids(8 * steps), callbacks=[SamestepCallback()] if callback else []
    )
    torch.set_num_threads(1)  # the callback pins one thread; the plain side runs on as many
    t0 = time.perf_counter()
    trainer.train()
    return time.perf_counter() - t0


def lightning_side(root: Path, steps: int, callback: bool) -> float:
    """Lightning's demo Transformer (dropout 0.2, SGD) on batches of 4 x 64 tokens, one batch a step."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos import LightningTransformer

    from samestep.integrations.lightning import KeyedSampler, SamestepCallback

    class Pairs(Tokens):
        def __getitem__(self, i: int):
            ids = super().__getitem__(i)
            return ids, ids.roll(-1)

    class Demo(LightningTransformer):
        def prepare_data(self) -> None:  # the demo downloads WikiText-2 here; these batches are random tokens
            pass

    torch.manual_seed(0)
    module = Demo(vocab_size=VOCAB)
    data = Pairs(4 * steps)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=KeyedSampler(len(data), 0))
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        callbacks=[SamestepCallback(root)] if callback else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    trainer.fit(module, loader)
    return time.perf_counter() - t0


SIDES = {"hf": hf_side, "lightning": lightning_side}


def cost(framework: str, pairs: int, steps: int, root: Path) -> dict:
    side = SIDES[framework]
    ratios, plain, with_cb = [], [], []
    for p in range(pairs + 1):
        with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its metrics: stdout is the report's
            a = side(root / f"{framework}_plain_{p}", steps, False)
            b = side(root / f"{framework}_samestep_{p}", steps, True)
        if p:  # the first pair warms up
            ratios.append(b / a)
            plain.append(a)
            with_cb.append(b)
    return {
        "ratio_median": round(statistics.median(ratios), 3),
        "s_plain": round(statistics.median(plain), 3),
        "s_callback": round(statistics.median(with_cb), 3),
        "steps": steps,
        "pairs": pairs,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--frameworks", default="hf,lightning")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")  # the frameworks' own notices, on both sides alike
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as d:
        out = {name: cost(name, a.pairs, a.steps, Path(d)) for name in a.frameworks.split(",")}
    if a.json:
        print(json.dumps(out))
    else:
        for name, r in out.items():
            print(f"{name:10s} {r['ratio_median']:.3f}x of the Trainer alone ({r['s_plain']} -> {r['s_callback']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

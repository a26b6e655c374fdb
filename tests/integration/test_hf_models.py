"""Real models that samestep did not write: GPT-2 and Llama from `transformers`, built from their config
classes (no download), trained in a loop of the user's own with samestep's public API. Two runs are
identical, a run stopped and resumed from `samestep.save_checkpoint` is identical, tracing changes no
bit, and a really nondeterministic pair is diffed down to its origin op and module."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

import samestep
from samestep.analysis import diff_runs

pytestmark = pytest.mark.slow

STEPS, EVERY = 4, 2


class IndexEmbedding(torch.nn.Embedding):
    """A user's own token lookup, ``weight[ids]`` (as soft-prompt code writes it): its backward is
    ``index_put_(accumulate=True)``, which races between CPU threads with deterministic mode off."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


def _model(kind: str, race: bool = False) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # seconds: not at collection

    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=2))
    else:
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=128,
            )
        )
    if race:
        lookup = IndexEmbedding(256, 64)
        lookup.weight = model.get_input_embeddings().weight
        model.set_input_embeddings(lookup)
    return model


def _batch(step: int, microbatch: int) -> torch.Tensor:
    """Tokens keyed by (step, microbatch): a pure function, so a resume needs no data state."""
    # 6 x 128 tokens x 64 wide: a lookup gradient past PyTorch's 32,768-element grain, so CPU threads share it
    return torch.randint(0, 256, (6, 128), generator=samestep.rng.generator(0, step, microbatch, "data"))


def _train(
    run: Path,
    kind: str,
    *,
    stop_after: int | None = None,
    level: str | None = None,
    restore_optimizer: bool = True,
    race: bool = False,
) -> str:
    """The user's loop: AdamW, 2 microbatches a step, a checkpoint every 2 steps; resumes from ``run`` if it
    holds one. Returns the digest of the parameters at the end."""
    model = _model(kind, race)
    model.train()  # dropout on (GPT-2): it draws from the global RNG, which checkpoints save and restore
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpts, start = run / "checkpoints", 0
    if ckpts.is_dir():
        start = samestep.load_checkpoint(ckpts, model=model, optimizer=opt if restore_optimizer else None).step
    rec = samestep.trace(run, level=level, steps=None if race else "1-2", resume=start > 0) if level else None
    if rec is not None:
        rec.attach(model)
    end = STEPS if stop_after is None else start + stop_after
    for step in range(start, end):
        with rec.step(step + 1) if rec else contextlib.nullcontext():
            for mb in range(2):
                with rec.microbatch(mb) if rec else contextlib.nullcontext():
                    x = _batch(step, mb)
                    (model(input_ids=x, labels=x).loss / 2).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if (step + 1) % EVERY == 0:
            if rec is not None:
                rec.sync()
            samestep.save_checkpoint(ckpts, step + 1, model=model, optimizer=opt)
    if rec is not None:
        rec.close()
    return samestep.digest(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_transformers_model_repeats_resumes_and_traces_without_changing_a_bit(tmp_path, kind):
    """Deterministic mode on: two runs identical; stopped after 3 steps (a checkpoint at 2) and resumed in
    fresh objects (the optimizer's moments, and GPT-2's dropout RNG, from the checkpoint), identical;
    traced at op level on steps 1-2, identical, and that trace certifies. Negative control: the same
    resume without the optimizer's state differs."""
    from samestep.analysis import certify_trace

    with samestep.enable(threads=1):
        a = _train(tmp_path / "a", kind)
        assert _train(tmp_path / "b", kind) == a
        _train(tmp_path / "r", kind, stop_after=3)
        assert _train(tmp_path / "r", kind) == a
        assert _train(tmp_path / "t", kind, level="op") == a
        _train(tmp_path / "n", kind, stop_after=3)
        assert _train(tmp_path / "n", kind, restore_optimizer=False) != a
    cert = certify_trace(tmp_path / "t")
    assert cert["complete"], cert["problems"]


def test_a_racing_pair_of_gpt2_runs_is_diffed_to_its_origin(tmp_path):
    """GPT-2 with the user's own ``weight[ids]`` lookup, deterministic mode off, 2 threads: two runs traced
    at op level differ, and diff names ``aten.index_put`` in ``transformer.wte`` backward, all inputs
    matched. Negative control: the same pair with deterministic mode on is identical."""
    torch.set_num_threads(2)
    _train(tmp_path / "off0", "gpt2", level="op", race=True)
    for i in range(1, 7):  # the race fires only when both threads add into a row at once: a few tries
        _train(tmp_path / f"off{i}", "gpt2", level="op", race=True)
        report = diff_runs(tmp_path / "off0", tmp_path / f"off{i}")
        if not report["identical"]:
            break
    assert not report["identical"], report["summary"]
    origin = report["origin"]
    assert origin is not None and origin["op"].startswith("aten.index_put") and origin["inputs_matched"]
    assert origin["scope"] == "transformer.wte" and origin["phase"] == "backward"
    with samestep.enable(threads=2):
        for name in ("on0", "on1"):
            _train(tmp_path / name, "gpt2", level="op", race=True)
    assert diff_runs(tmp_path / "on0", tmp_path / "on1")["identical"]

"""What a configuration asks of the machine, estimated before anything is allocated: a model that cannot
fit in memory, or a step that would read its corpus many times over, is refused at the start with the
numbers, not after minutes of allocation or a step that never ends."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from samestep.train.config import Config

__all__ = ["activation_floor", "available_memory", "check_capacity", "parameter_floor"]

# Bytes a parameter costs in training at least: fp32 weight, gradient and AdamW's two moments, and a
# checkpoint's serialised copy of the weight and the moments while it is written.
_BYTES_PER_PARAMETER = 4 * 4 + 3 * 4


def parameter_floor(cfg: Config, vocab: int) -> int:
    """A lower bound on the model's parameter count (its matrices; norms and biases left out)."""
    m = cfg.model
    d = m.n_embd
    if m.arch == "llama":
        kv = d // m.n_head * m.kv_heads
        attention, mlp = 2 * d * d + 2 * d * kv, 3 * d * m.mlp_width
    else:
        attention, mlp = 4 * d * d, 8 * d * d
    experts = max(m.moe_experts, 1)
    return m.n_layer * (attention + experts * mlp) + vocab * d


def activation_floor(cfg: Config, vocab: int) -> int:
    """A lower bound on the bytes one microbatch's forward keeps for its backward on a process: its logits and
    their gradient (micro_batch x T x this rank's vocabulary, fp32 each), and the GPT's attention, per layer,
    its scores and their softmax (micro_batch x its heads x T x T, fp32 each) and its causal mask (T x T
    bools). (The Llama's SDPA need not hold T x T.)"""
    m, tp, b = cfg.model, max(cfg.parallel.tp, 1), cfg.train.micro_batch
    logits = b * m.block_size * (vocab // tp) * 4 * 2
    if m.arch != "gpt":
        return logits
    heads = max(m.n_head // tp, 1)
    return logits + m.n_layer * (b * heads * m.block_size**2 * 4 * 2 + m.block_size**2)


def available_memory(device: torch.device) -> int | None:
    """Bytes this process may allocate on ``device`` now (None where that cannot be told)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_capacity(cfg: Config, vocab: int, corpus_tokens: int, device: torch.device, world: int) -> None:
    """Refuses a run that cannot fit in this process's memory, or whose step reads more tokens than its
    corpus holds.

    Raises:
        ValueError: names the config fields, the estimate and what is there.
    """
    t, m = cfg.train, cfg.model
    step_tokens = t.global_batch * m.block_size
    if step_tokens > corpus_tokens:
        raise ValueError(
            f"train.global_batch={t.global_batch} x model.block_size={m.block_size} = {step_tokens:,} "
            f"tokens a step, but the corpus holds {corpus_tokens:,}: one step would read it "
            f"{step_tokens / max(corpus_tokens, 1):,.1f} times over; lower train.global_batch"
        )
    params = parameter_floor(cfg, vocab)
    shards = world if cfg.parallel.fsdp and world > 1 else 1
    # the canonical tree keeps a gradient per level of its binary counter (distributed/tree.py)
    levels = max(1, math.ceil(math.log2(max(t.microbatches // world, 1))) + 1)
    need = params * (_BYTES_PER_PARAMETER + 4 * levels) // shards
    have = available_memory(device)
    if have is not None and need > have:
        raise ValueError(
            f"model.n_layer={m.n_layer}, model.n_embd={m.n_embd} (vocabulary {vocab:,}) is at least "
            f"{params:,} parameters: {need / 2**30:,.1f} GiB for weights, gradients, optimizer state "
            f"and a checkpoint's copy on each process, and {have / 2**30:,.1f} GiB is available on "
            f"{device}; choose a smaller model"
        )
    activations = activation_floor(cfg, vocab)
    if have is not None and need + activations > have:
        raise ValueError(
            f"model.block_size={m.block_size} with train.micro_batch={t.micro_batch}, model.n_head="
            f"{m.n_head}, model.n_layer={m.n_layer} and a vocabulary of {vocab:,}: one microbatch's "
            f"logits and attention hold at least {activations / 2**30:,.1f} GiB, with "
            f"{need / 2**30:,.2f} GiB for the model's state, and {have / 2**30:,.1f} GiB is available "
            f"on {device}; lower model.block_size, train.micro_batch or model.vocab_size"
        )

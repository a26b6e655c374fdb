"""The reference GPT: a nanoGPT-class decoder whose every random draw is counter-keyed.

Run it through the trainer (``samestep train --run-dir runs/a``); this file reads top to bottom:
config (``ModelConfig`` in config.py), dropout, attention, MLP, block, the model.

Differences from nanoGPT, all for determinism:
- dropout draws its masks from an explicit ``torch.Generator`` that the trainer seeds per microbatch
  from (seed, step, global microbatch index), never from the global RNG;
- attention is written out (no fused SDPA, whose dropout uses the global RNG);
- initialisation draws from a generator keyed by (seed, "init");
- ``embedding="index"`` looks tokens up as ``weight[idx]``, whose backward is
  ``index_put_(accumulate=True)``: a real op that races on CPU when deterministic mode is off;
- ``moe_experts > 0`` replaces each MLP by top-k routed experts whose combine is
  ``samestep.ops.moe_combine`` in deterministic mode and a racing ``index_put_`` otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from samestep import ops
from samestep.determinism import rng as _rng
from samestep.distributed.chunk_products import elementwise_whole
from samestep.distributed.sequence_parallel import SequenceShard, gather_sequence, scatter_sequence
from samestep.distributed.vocab_parallel import vocab_parallel_cross_entropy
from samestep.train.model_config import ModelConfig

__all__ = ["GPT", "Decoder", "MoE", "chunkwise", "dropout"]


def dropout(
    x: torch.Tensor, p: float, gen: torch.Generator | None, training: bool, sequence: SequenceShard | None = None
) -> torch.Tensor:
    """Inverted dropout with a mask drawn from ``gen`` (identity when not training or p == 0). ``sequence``:
    ``x`` (batch, positions, features) is this rank's block of a sequence split over ``sequence.degree``
    ranks, and each element is kept by its position in the whole tensor under one key drawn from ``gen`` (the
    same draw on every rank), so the ranks draw their blocks of the one mask."""
    if not training or p == 0.0:
        return x
    if gen is None:
        raise RuntimeError("GPT.forward(training) with dropout > 0 needs a counter-keyed generator")
    if sequence is not None:
        key = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device))
        B, L, C = x.shape
        keep = _rng.positional_keep(key, (B, L * sequence.degree, C), (0, L * sequence.rank, 0), (B, L, C), p, x.device)
        return x * keep / (1.0 - p)
    keep = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - p, generator=gen)
    return x * keep / (1.0 - p)


def head_dropout(
    att: torch.Tensor, p: float, gen: torch.Generator | None, training: bool, n_head: int, first_head: int
) -> torch.Tensor:
    """Dropout on attention weights (B, local heads, T, T), heads ``first_head`` on of ``n_head``: each element
    kept by its position in the whole (B, n_head, T, T) tensor under one key drawn from ``gen``, so the heads
    a tensor-parallel rank holds draw their part of the one mask, and ``gen`` advances alike on every rank."""
    if not training or p == 0.0:
        return att
    if gen is None:
        raise RuntimeError("GPT.forward(training) with dropout > 0 needs a counter-keyed generator")
    key = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device))
    B, h, T, S = att.shape
    keep = _rng.positional_keep(key, (B, n_head, T, S), (0, first_head, 0, 0), (B, h, T, S), p, att.device)
    return att * keep / (1.0 - p)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.p, self.head_size = cfg.n_head, cfg.dropout, cfg.n_embd // cfg.n_head
        # set by parallel.tp_chunks: this rank's first head (the dropout mask keyed by head position)
        self.first_head: int | None = None
        self.sequence: SequenceShard | None = None  # set by parallel.sp: the output's block of the sequence
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3 x this rank's heads' width): all heads but under tensor parallelism
        B, T = qkv.shape[:2]  # the whole sequence (x is a block of it under sequence parallelism)
        q, k, v = qkv.split(qkv.size(-1) // 3, dim=2)
        q, k, v = (t.view(B, T, -1, self.head_size).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if self.first_head is not None:  # one head's strided operand takes another GEMM path (other bits) on CPU
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf")).softmax(dim=-1)
        if self.first_head is None:
            att = dropout(att, self.p, gen, self.training)
        else:
            att = head_dropout(att, self.p, gen, self.training, self.n_head, self.first_head)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, C)
        return dropout(self.c_proj(y), self.p, gen, self.training, self.sequence)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.p = cfg.dropout
        self.sequence: SequenceShard | None = None  # set by parallel.sp: the output's block of the sequence
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.chunk_width: int | None = None  # set by parallel.tp_chunks: the activation runs chunk by chunk

    def forward(self, x: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        h = chunkwise(F.gelu, self.c_fc(x), self.chunk_width)
        return dropout(self.c_proj(h), self.p, gen, self.training, self.sequence)  # (B, T, C)


def chunkwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, width: int | None) -> torch.Tensor:
    """``fn`` (an activation) on each ``width``-wide chunk of ``x``'s last dimension, each made contiguous
    (``width`` None: on ``x`` whole). A vectorized kernel computes its last elements in a scalar tail, whose
    transcendental functions round otherwise; chunk by chunk the tail falls on the same elements at every
    tensor-parallel degree (a rank's part of a layer is a run of whole chunks), whatever the row count. Where no
    element falls in a tail either way (``chunk_products.elementwise_whole``) it runs on ``x`` whole: the same
    bits without the chunks' copies and concatenation."""
    if width is None or elementwise_whole(x, width):
        return fn(x)
    return torch.cat([fn(c.contiguous()) for c in x.split(width, -1)], -1)


class Decoder(nn.Module):
    """A decoder's forward, in the parts a pipeline stage runs (train/pipeline.py): a subclass (the GPT, the Llama)
    defines ``embed_tokens`` (tokens to the residual stream), ``trunk`` (its blocks), ``head`` (the logits) and
    ``loss``, and holds ``sequence`` (its rank's block of positions under sequence parallelism, or None)."""

    sequence: SequenceShard | None

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        gen: torch.Generator | None = None,
        part: tuple[bool, bool] | None = None,
    ) -> Any:
        """Logits (B, T, vocab; this rank's slice under vocab_parallel) and, with targets, the *summed* token
        cross-entropy (normalise outside). ``part``: a pipeline stage's part alone (whether it embeds, whether
        it runs the head): tokens or the stream in, the stream or the logits out; under sequence parallelism the
        stream is a rank's block of positions, and the trunk is told the whole sequence's length."""
        first, last = part or (True, True)
        length = idx.shape[1] * (1 if first or self.sequence is None else self.sequence.degree)
        x = self.embed_tokens(idx, gen) if first else idx  # type: ignore[operator]
        x = self.trunk(x, gen, length)  # type: ignore[operator]
        if not last:
            return x
        logits = self.head(x)  # type: ignore[operator]
        if part is not None:
            return logits
        return logits, None if targets is None else self.loss(logits, targets)  # type: ignore[operator]


class MoE(nn.Module):
    """Top-k routed experts, each an MLP. Routing gathers each token's rows for its experts; the
    combine weights the expert outputs and sums them back into token order: the scatter-type op that
    races in plain PyTorch (index_put_ accumulate on CPU, atomics on GPU) and that samestep.ops.moe_combine
    makes deterministic."""

    def __init__(self, cfg: ModelConfig, deterministic: bool, expert: Callable[[ModelConfig], nn.Module] = MLP) -> None:
        super().__init__()
        self.k, self.p, self.deterministic = cfg.moe_top_k, cfg.dropout, deterministic
        self.sequence: SequenceShard | None = None  # set by parallel.sp: input gathered, output cut to the block
        self.router = nn.Linear(cfg.n_embd, cfg.moe_experts, bias=False)
        # each expert is called as expert(rows, gen): the GPT's MLP, or the Llama's SwiGLU
        self.experts = nn.ModuleList(expert(cfg) for _ in range(cfg.moe_experts))
        # set by parallel.ep: the experts spread over ranks, each run where it lies (train/expert_parallel.py)
        self.exchange: Any = None

    def forward(self, x: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        if self.sequence is not None:  # the router and the experts see every token
            x = gather_sequence(x, self.sequence)
        B, T, C = x.shape
        xt = x.reshape(-1, C)  # (N, C)
        n = xt.shape[0]
        weight, expert = self.router(xt).softmax(-1).topk(self.k, dim=-1)  # (N, k) each
        weight = weight / weight.sum(-1, keepdim=True)
        flat_expert = expert.reshape(-1)  # (N*k,) routed rows in token order
        order = torch.argsort(flat_expert, stable=True)  # grouped by expert, token order inside
        token = torch.arange(n, device=x.device).repeat_interleave(self.k)[order]  # (N*k,)
        counts = torch.bincount(flat_expert, minlength=len(self.experts)).tolist()
        # Gather: index_select's backward is an ordered index_add; x[token]'s would be index_put_ accumulate.
        rows = xt.index_select(0, token) if self.deterministic else xt[token]  # (N*k, C)
        if self.exchange is not None:  # each expert's rows to its rank, run there as here, and back
            expert_out = self.exchange.run(
                rows, counts, lambda e, params, r: torch.func.functional_call(self.experts[e], params, (r, gen))
            )
        else:
            outs, start = [], 0
            for e, count in enumerate(counts):
                outs.append(self.experts[e](rows[start : start + count], gen))
                start += count
            expert_out = torch.cat(outs)  # (N*k, C)
        w = weight.reshape(-1)[order]
        if self.deterministic:
            y = ops.moe_combine(expert_out, token, w, n)
        else:  # what MoE code writes; on CPU this index_put_ accumulate races between threads
            y = xt.new_zeros(n, C).index_put_((token,), expert_out * w.unsqueeze(-1), accumulate=True)
        y = y.view(B, T, C)  # whole: the experts saw every token
        return y if self.sequence is None else scatter_sequence(y, self.sequence)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, deterministic: bool = True) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MoE(cfg, deterministic) if cfg.moe_experts else MLP(cfg)

    def forward(self, x: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), gen)
        return x + self.mlp(self.ln_2(x), gen)


class IndexEmbedding(nn.Embedding):
    """``weight[idx]``: the same lookup as nn.Embedding, whose backward is index_put_(accumulate=True)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.weight[idx]


class GPT(Decoder):
    """Token and position embeddings, ``n_layer`` blocks, a final norm, a tied language-model head."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, seed: int, deterministic: bool = True) -> None:
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.transformer = nn.ModuleDict(
            {
                "wte": (IndexEmbedding if cfg.embedding == "index" else nn.Embedding)(vocab_size, cfg.n_embd),
                "wpe": nn.Embedding(cfg.block_size, cfg.n_embd),
                "h": nn.ModuleList(Block(cfg, deterministic) for _ in range(cfg.n_layer)),
                "ln_f": nn.LayerNorm(cfg.n_embd),
            }
        )
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        # set by parallel.tp_chunks: (chunks, tensor group) of the vocabulary-parallel loss
        self.vocab_parallel: tuple[int, Any] | None = None
        # set by parallel.sp: this rank's block of the sequence, between the embedding and the final norm
        self.sequence: SequenceShard | None = None
        self._init_weights(_rng.generator(seed, 0, 0, "init"))

    @torch.no_grad()
    def _init_weights(self, gen: torch.Generator) -> None:
        # Parameters are visited in registration order, so the draws are a pure function of the seed.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
                p.normal_(0.0, std, generator=gen)

    # The parts of the forward (Decoder): the first stage embeds, each runs its blocks, the last the head and loss.
    def embed_tokens(self, idx: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        """The residual stream's start (B, T, C): token and position embeddings, then dropout."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds model.block_size={self.cfg.block_size}")
        tok = self.transformer.wte(idx)  # (B, T, C)
        pos = self.transformer.wpe(torch.arange(T, device=idx.device))  # (T, C)
        x = tok + pos
        if self.sequence is not None:
            x = scatter_sequence(x, self.sequence)
        return dropout(x, self.cfg.dropout, gen, self.training, self.sequence)

    def trunk(self, x: torch.Tensor, gen: torch.Generator | None, length: int) -> torch.Tensor:
        """The decoder blocks in order (``length``: the sequence's, unused here)."""
        for block in self.transformer.h:
            x = block(x, gen)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab; this rank's slice under vocab_parallel)."""
        return self.lm_head(self.transformer.ln_f(x))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The *summed* token cross-entropy of ``logits`` against ``targets``."""
        if self.vocab_parallel is not None:
            return vocab_parallel_cross_entropy(logits, targets, *self.vocab_parallel).sum()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="sum")

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

"""The reference Llama-style decoder (``model.arch=llama``): RMSNorm, rotary position embeddings, a SwiGLU
MLP (with ``model.moe_experts``, top-k routed SwiGLU experts: model.py's MoE layer), grouped-query
attention through ``torch.nn.functional.scaled_dot_product_attention``, no biases, an untied output head.
Same interface as the GPT (model.py): ``forward(idx, targets, gen)``.

Randomness, all counter-keyed: initialisation draws from a generator keyed by (seed, "init"); residual
dropout (``model.dropout``) draws its masks from the trainer's per-microbatch generator, as the GPT's
does. Attention dropout is 0: SDPA would draw its mask from the global RNG.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from samestep.determinism import rng as _rng
from samestep.distributed.sequence_parallel import SequenceShard, scatter_sequence
from samestep.distributed.vocab_parallel import vocab_parallel_cross_entropy
from samestep.train.model import Decoder, MoE, chunkwise, dropout
from samestep.train.model_config import ModelConfig

__all__ = ["Llama"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # normalised in fp32 under autocast too
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x) * self.weight


def rotary_tables(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angles, (length, head_dim / 2), in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (B, heads, T, head_dim) by position: pairs (even, odd) rotated, in fp32."""
    x32 = x.float()
    even, odd = x32[..., 0::2], x32[..., 1::2]
    out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    """Grouped-query attention: ``n_kv_head`` key/value heads, each shared by n_head / n_kv_head queries."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv = cfg.n_head, cfg.kv_heads
        self.head_dim = cfg.n_embd // cfg.n_head
        self.first_head: int | None = None  # set by parallel.tp_chunks: this rank's first head
        self.q = nn.Linear(cfg.n_embd, self.n_head * self.head_dim, bias=False)
        self.kv = nn.Linear(cfg.n_embd, 2 * self.n_kv * self.head_dim, bias=False)
        self.o = nn.Linear(self.n_head * self.head_dim, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        B, T = q.shape[:2]  # the whole sequence (x is a block of it under sequence parallelism)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k, v = self.kv(x).view(B, T, 2, -1, self.head_dim).permute(2, 0, 3, 1, 4)  # 2 x (B, nkv, T, hd)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        group = self.n_head // self.n_kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, nh, T, hd)
        if self.first_head is not None:  # one head's strided operand may take another kernel path on CPU
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.0)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.mlp_width, bias=False)
        self.up = nn.Linear(cfg.n_embd, cfg.mlp_width, bias=False)
        self.down = nn.Linear(cfg.mlp_width, cfg.n_embd, bias=False)
        self.chunk_width: int | None = None  # set by parallel.tp_chunks: the activation runs chunk by chunk

    def forward(self, x: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        # dropout is the block's, on the whole output
        return self.down(chunkwise(F.silu, self.gate(x), self.chunk_width) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, deterministic: bool = True) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.n_embd), Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd)
        self.mlp = MoE(cfg, deterministic, SwiGLU) if cfg.moe_experts else SwiGLU(cfg)
        self.sequence: SequenceShard | None = None  # set by parallel.sp: the residual stream's block of the sequence

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, p: float, gen: torch.Generator | None
    ) -> torch.Tensor:
        x = x + dropout(self.attn(self.attn_norm(x), cos, sin), p, gen, self.training, self.sequence)
        return x + dropout(self.mlp(self.mlp_norm(x), gen), p, gen, self.training, self.sequence)


class Llama(Decoder):
    """Token embedding, ``n_layer`` blocks, a final RMSNorm, an output head of its own."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, seed: int, deterministic: bool = True) -> None:
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.embed = nn.Embedding(vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg, deterministic) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd)
        self.output = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        # set by parallel.tp_chunks: (chunks, tensor group) of the vocabulary-parallel loss
        self.vocab_parallel: tuple[int, Any] | None = None
        # set by parallel.sp: this rank's block of the sequence, between the embedding and the final norm
        self.sequence: SequenceShard | None = None
        cos, sin = rotary_tables(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._init_weights(_rng.generator(seed, 0, 0, "init"))

    @torch.no_grad()
    def _init_weights(self, gen: torch.Generator) -> None:
        # Parameters in registration order: the draws are a pure function of the seed.
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                out_proj = name.endswith(("attn.o.weight", "down.weight"))  # an expert's too
                p.normal_(0.0, 0.02 / math.sqrt(2 * self.cfg.n_layer) if out_proj else 0.02, generator=gen)

    # The parts of the forward (Decoder), as the GPT's; the loss in fp32.
    def embed_tokens(self, idx: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        """The residual stream's start (B, T, C): the token embedding, then dropout."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds model.block_size={self.cfg.block_size}")
        x = self.embed(idx)
        if self.sequence is not None:
            x = scatter_sequence(x, self.sequence)
        return dropout(x, self.cfg.dropout, gen, self.training, self.sequence)

    def trunk(self, x: torch.Tensor, gen: torch.Generator | None, length: int) -> torch.Tensor:
        """The decoder blocks in order, rotated for a sequence of ``length`` positions."""
        cos, sin = self.cos[:length], self.sin[:length]
        for block in self.layers:
            x = block(x, cos, sin, self.cfg.dropout, gen)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab; this rank's slice of the vocabulary under vocab_parallel)."""
        return self.output(self.norm(x))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The *summed* token cross-entropy of ``logits`` against ``targets``, in fp32."""
        if self.vocab_parallel is not None:
            return vocab_parallel_cross_entropy(logits.float(), targets, *self.vocab_parallel).sum()
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), reduction="sum")

    def attention_backend(self, micro_batch: int, device: torch.device, precision: str) -> str:
        """The SDPA backend PyTorch's dispatcher picks for this model's attention in training (eager; a
        compiled model's attention is Inductor's lowering of the same op)."""
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        q = torch.zeros(
            micro_batch,
            self.cfg.n_head,
            self.cfg.block_size,
            self.cfg.n_embd // self.cfg.n_head,
            dtype=dtype,
            device=device,
            requires_grad=True,
        )
        from torch.nn.attention import SDPBackend

        return SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

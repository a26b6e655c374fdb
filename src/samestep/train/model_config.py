"""The model section of the reference run's config ([model]): GPT or the Llama-style decoder, its sizes, each
checked when it is set."""

from __future__ import annotations

from dataclasses import dataclass

from samestep.train.config_values import at_most, finite, positive

__all__ = ["ARCHS", "ModelConfig"]


ARCHS = ("gpt", "llama")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The model: the GPT (model.py) or the Llama-style decoder (llama.py)."""

    arch: str = "gpt"
    """'gpt' (LayerNorm, learned positions, GELU MLP, biases, tied head) or 'llama' (RMSNorm, rotary
    positions, SwiGLU, grouped-query attention through SDPA, no biases)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 128
    """Embedding width."""
    block_size: int = 64
    """Context length in tokens."""
    dropout: float = 0.1
    """Dropout probability (counter-keyed masks)."""
    vocab_size: int = 0
    """Vocabulary size; 0 takes it from the data source (256 for bytes)."""
    embedding: str = "module"
    """Token-embedding lookup: 'module' (nn.Embedding) or 'index' (weight[idx], backward index_put_)."""
    moe_experts: int = 0
    """Experts per MoE layer (the GPT's each an MLP, the Llama's each a SwiGLU); 0 keeps the dense MLP."""
    moe_top_k: int = 2
    """Experts each token is routed to."""
    n_kv_head: int = 0
    """llama: key/value heads (grouped-query attention); 0 is n_head."""
    mlp_hidden: int = 0
    """llama: SwiGLU width; 0 is 8/3 n_embd rounded up to a multiple of 32."""
    rope_theta: float = 10000.0
    """llama: base of the rotary embedding's frequencies."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def mlp_width(self) -> int:
        return self.mlp_hidden or -(-8 * self.n_embd // 3 // 32) * 32

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch={self.arch!r} must be one of {', '.join(ARCHS)}")
        finite("model", self, "rope_theta")
        positive("model", self, "n_layer", "n_head", "n_embd", "block_size", "rope_theta")
        at_most("model", self, 1 << 16, "n_kv_head", "mlp_hidden")
        if self.n_kv_head < 0 or self.mlp_hidden < 0:
            raise ValueError("model.n_kv_head and model.mlp_hidden must not be negative (0 takes the default)")
        if self.n_head % self.kv_heads:
            raise ValueError(f"model.n_head={self.n_head} is not a multiple of model.n_kv_head={self.n_kv_head}")
        if self.arch == "llama" and (self.n_embd // max(self.n_head, 1)) % 2:
            raise ValueError(
                f"model.arch=llama needs an even head size for rotary embeddings; n_embd/n_head = "
                f"{self.n_embd // max(self.n_head, 1)}"
            )
        if self.arch == "llama" and self.embedding != "module":
            raise ValueError(
                f"model.embedding={self.embedding!r} is for model.arch=gpt; the llama model looks its "
                "tokens up with an nn.Embedding. Fix: --set model.embedding=module"
            )
        at_most("model", self, 1 << 16, "n_layer", "n_head", "n_embd", "block_size", "moe_experts")
        at_most("model", self, 1 << 24, "vocab_size")
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout!r} must be in [0, 1)")
        if self.vocab_size < 0:
            raise ValueError(f"model.vocab_size={self.vocab_size} must be 0 (from data) or positive")
        if self.moe_experts < 0 or (self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts):
            raise ValueError(
                f"model.moe_top_k={self.moe_top_k} must be between 1 and model.moe_experts="
                f"{self.moe_experts} (or set model.moe_experts=0 for a dense MLP)"
            )
        if self.embedding not in ("module", "index"):
            raise ValueError(f"model.embedding={self.embedding!r} must be 'module' or 'index'")

"""Layout-invariant parallelism: the canonical gradient reduction (on its own, as DDP's communication hook,
or as FSDP2's reduce-scatter, or after each microbatch of a pipeline stage), the canonical gradient norm,
tensor-parallel linears, embedding, loss and sequence-parallel norms whose sums do not depend on the degree,
and layout validation."""

from samestep.distributed.agree import any_rank
from samestep.distributed.ddp import CanonicalDdpState, canonical_ddp_hook
from samestep.distributed.fsdp import FsdpGradients, ShardedModel, ShardedOptimizer, full_state, shard_model
from samestep.distributed.norm import canonical_grad_norm, clip_grad_norm_
from samestep.distributed.pipeline import broadcast_from, canonical_stage, canonical_stage_of
from samestep.distributed.reduce import CanonicalGradients
from samestep.distributed.sequence_parallel import (
    gather_sequence,
    parallelize_norm,
    scatter_sequence,
    sequence_affine,
    tree_to_block,
)
from samestep.distributed.stacked_experts import parallelize_experts, transformers_expert
from samestep.distributed.tree import validate_layout
from samestep.distributed.vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_embedding

__all__ = [
    "CanonicalColwiseParallel",
    "CanonicalDdpState",
    "CanonicalGradients",
    "CanonicalRowwiseParallel",
    "CanonicalVocabEmbedding",
    "FsdpGradients",
    "ShardedModel",
    "ShardedOptimizer",
    "any_rank",
    "broadcast_from",
    "canonical_ddp_hook",
    "canonical_grad_norm",
    "canonical_stage",
    "canonical_stage_of",
    "clip_grad_norm_",
    "full_state",
    "gather_sequence",
    "parallelize_experts",
    "parallelize_norm",
    "scatter_sequence",
    "sequence_affine",
    "sequence_shard",
    "shard_model",
    "transformers_expert",
    "tree_to_block",
    "validate_layout",
    "validate_tp",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]

# tensor_parallel and tp_styles are loaded when one of their names is first used: the styles import DTensor's
# parallel styles (most of a second of start-up), which a run without tensor parallelism never needs.
_LAZY = {
    "CanonicalColwiseParallel": "tp_styles",
    "CanonicalRowwiseParallel": "tp_styles",
    "CanonicalVocabEmbedding": "tp_styles",
    "sequence_shard": "tensor_parallel",
    "validate_tp": "tensor_parallel",
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'samestep.distributed' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"samestep.distributed.{_LAZY[name]}"), name)

"""Layout-invariant data parallelism: the canonical gradient reduction and layout validation."""

from samestep.distributed.agree import any_rank
from samestep.distributed.buckets import GradientBuckets
from samestep.distributed.norm import canonical_grad_norm, clip_grad_norm_
from samestep.distributed.reduce import AllReduceGradients, CanonicalGradients, combine_across_ranks, ring_allreduce_bytes
from samestep.distributed.tree import BinaryCounter, canonical_sum, validate_layout

__all__ = ["AllReduceGradients", "BinaryCounter", "CanonicalGradients", "GradientBuckets", "any_rank",
           "canonical_grad_norm", "canonical_sum", "clip_grad_norm_", "combine_across_ranks", "ring_allreduce_bytes",
           "validate_layout"]

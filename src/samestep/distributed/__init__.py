"""Layout-invariant data parallelism: the canonical gradient reduction and layout validation."""

from samestep.distributed.agree import any_rank
from samestep.distributed.reduce import (
    AllReduceGradients,
    BinaryCounter,
    CanonicalGradients,
    canonical_sum,
    combine_across_ranks,
    ring_allreduce_bytes,
    validate_layout,
)

__all__ = ["AllReduceGradients", "BinaryCounter", "CanonicalGradients", "any_rank", "canonical_sum",
           "combine_across_ranks", "ring_allreduce_bytes", "validate_layout"]

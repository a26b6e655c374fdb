"""Hashes of a training state (docs/design.md, "Words"): the state digest, SHA-256 over a state tree's
tensors' digests (``state``, which also walks the tree), and the state checksum, XXH3 over a step's
tensors' bytes, which the receipts chain (``checksums``). The tensor digest itself is ``samestep.digests``."""

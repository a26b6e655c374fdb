"""State checksums: the per-step fingerprint of a state tree that receipts and the cross-rank check share.

A step's receipt and the cross-rank check both read the state after the update (and the check also the
reduced gradients); ``Checksums`` hashes each tensor's bytes at most once a step and both take their values
from it. The hash is named (docs/formats.md, receipts):

- ``xxh3-128`` (the default where the state lies in host memory): XXH3-128 over each tensor's dtype, shape
  and bytes, at memory speed (about 20-30x SHA-256's throughput here, interpreter lock released);
- ``samestep-digest-1`` (where it lies on an accelerator): samestep's tensor digest (``samestep.digests``),
  computed on the device with one copy of 16 bytes a tensor to the host, not of the state;
- ``sha256``: receipts version 1's state digest (``_state.state_digest``), still read and verified.

A per-step checksum need not be cryptographic (docs/design.md, invariant 6): no claim rests on one alone.
A verifier recomputes the checksum of every state it compares, from a checkpoint whose files are SHA-256
digested; the chain that links the receipts, the genesis and final.json's state digest stay SHA-256.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from samestep._state import sha256_tensor, tensor_bytes, tensor_header, tree_digest

__all__ = ["DEVICE_STATE_HASH", "STATE_HASH", "STATE_HASHES", "Checksums", "state_checksum", "state_hash_for"]

STATE_HASH = "xxh3-128"
DEVICE_STATE_HASH = "samestep-digest-1"
STATE_HASHES = (STATE_HASH, DEVICE_STATE_HASH, "sha256")


def state_hash_for(device: torch.device | str) -> str:
    """The state hash of a run whose state lies on ``device``: hashed where it lies."""
    return STATE_HASH if torch.device(device).type == "cpu" else DEVICE_STATE_HASH


def _xxh3(t: torch.Tensor, key: tuple) -> str:
    """XXH3-128 over a tensor's dtype, shape and bytes, as ``_state.sha256_tensor`` takes them (``key``: its
    ``_key``, which holds the dtype and shape already read)."""
    import xxhash

    h = xxhash.xxh3_128(tensor_header(key[2], key[3]))
    h.update(tensor_bytes(t))  # the interpreter lock is released while it reads the bytes
    return h.hexdigest()


def _key(t: torch.Tensor) -> tuple:
    """What makes two tensor objects the same bytes for this step: one storage, place and view."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


class Checksums:
    """Tensor checksums by ``hash``, each tensor hashed at most once (an instance lives one step: the tensors
    it has seen must stay unchanged while it lives). ``hashed`` counts the tensors hashed."""

    def __init__(self, hash: str = STATE_HASH) -> None:
        if hash not in STATE_HASHES:
            raise ValueError(f"state hash {hash!r} is not one of {', '.join(STATE_HASHES)}")
        self.hash = hash
        self.hashed = 0
        self._memo: dict[tuple, str] = {}

    def of(self, tensors: Sequence[torch.Tensor]) -> list[str]:
        """Each tensor's checksum (hex), in order."""
        keys = [_key(t) for t in tensors]
        todo: dict[tuple, torch.Tensor] = {}
        for k, t in zip(keys, tensors):
            if k not in self._memo and k not in todo:
                todo[k] = t
        if todo:
            self.hashed += len(todo)
            if self.hash == DEVICE_STATE_HASH:  # batched on each device: one copy of the digests to the host
                from samestep.digests import digest_many

                self._memo.update(zip(todo, digest_many([t.detach() for t in todo.values()])))
            elif self.hash == STATE_HASH:
                self._memo.update((k, _xxh3(t, k)) for k, t in todo.items())
            else:
                self._memo.update((k, sha256_tensor(t)) for k, t in todo.items())
        return [self._memo[k] for k in keys]

    def named(self, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, str]:
        """``{name: checksum}`` of named tensors, in order."""
        return dict(zip((n for n, _ in named), self.of([t for _, t in named])))


def state_checksum(tree: Any, hash: str = STATE_HASH, memo: Checksums | None = None) -> str:
    """The checksum of a state tree by ``hash``: its JSON structure and every tensor's checksum, by name.
    ``sha256`` is ``_state.state_digest`` exactly. ``memo``: the step's ``Checksums`` (of this hash), whose
    tensors are not hashed again."""
    memo = memo if memo is not None else Checksums(hash)
    if memo.hash != hash:
        raise ValueError(f"a {memo.hash} memo cannot make a {hash} state checksum")
    if hash == "sha256":
        return tree_digest(tree, memo.of, hashlib.sha256)
    import xxhash

    return tree_digest(tree, memo.of, xxhash.xxh3_128)

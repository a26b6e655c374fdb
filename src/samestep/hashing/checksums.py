"""State checksums: the per-step hash of a state tree that receipts and the cross-rank check share.

A step's receipt, the cross-rank check and the step-level trace's state records all read the state after the
update (the check also the reduced gradients); ``Checksums`` hashes each tensor's bytes at most once a step
and all three take their values from it: ``StepChecksums`` hands the step's one to the receipt thread and to
the trace worker, whichever asks first hashing. The hash is named (docs/formats.md, receipts):

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
import threading
from collections.abc import Sequence
from typing import Any

import torch

from samestep.hashing.state import sha256_tensor, tensor_bytes, tensor_header, tree_digest

__all__ = [
    "DEVICE_STATE_HASH",
    "STATE_HASH",
    "STATE_HASHES",
    "Checksums",
    "StepChecksums",
    "state_checksum",
    "state_hash_for",
    "xxh3_tensor",
]

STATE_HASH = "xxh3-128"
DEVICE_STATE_HASH = "samestep-digest-1"
STATE_HASHES = (STATE_HASH, DEVICE_STATE_HASH, "sha256")


def state_hash_for(device: torch.device | str) -> str:
    """The state hash of a run whose state lies on ``device``: hashed where it lies."""
    return STATE_HASH if torch.device(device).type == "cpu" else DEVICE_STATE_HASH


def xxh3_tensor(header: bytes, data: Any) -> bytes:
    """XXH3-128 over a tensor's header (``_state.tensor_header``: its dtype and shape) and its row-major bytes
    ``data``: the ``xxh3-128`` checksum of one tensor, raw (16 bytes)."""
    import xxhash

    h = xxhash.xxh3_128(header)
    h.update(data)  # the interpreter lock is released while it reads the bytes
    return h.digest()


def _xxh3(t: torch.Tensor, key: tuple) -> str:
    """``xxh3_tensor`` of a tensor (``key``: its ``_key``, which holds the dtype and shape already read)."""
    return xxh3_tensor(tensor_header(key[2], key[3]), tensor_bytes(t)).hex()


def _key(t: torch.Tensor) -> tuple:
    """What makes two tensor objects the same bytes for this step: one storage, place and view."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


class Checksums:
    """Tensor checksums by ``hash``, each tensor hashed at most once (an instance lives one step: the tensors
    it has seen must stay unchanged while it lives, and those its readers hold stay alive, so no other
    tensor takes one's place in memory: it holds none itself, which would keep a step's gradients through
    the next). Threads may share one: a tensor two of them ask for is hashed by the first, the other waits
    for its value. ``hashed`` counts the tensors hashed."""

    def __init__(self, hash: str = STATE_HASH) -> None:
        if hash not in STATE_HASHES:
            raise ValueError(f"state hash {hash!r} is not one of {', '.join(STATE_HASHES)}")
        self.hash = hash
        self.hashed = 0
        self._memo: dict[tuple, str] = {}
        self._lock = threading.Lock()

    def of(self, tensors: Sequence[torch.Tensor]) -> list[str]:
        """Each tensor's checksum (hex), in order."""
        keys = [_key(t) for t in tensors]
        with self._lock:
            memo = self._memo
            todo: dict[tuple, torch.Tensor] = {}
            for k, t in zip(keys, tensors):
                if k not in memo and k not in todo:
                    todo[k] = t
            if todo:
                self.hashed += len(todo)
                if self.hash == DEVICE_STATE_HASH:  # batched on each device: one copy of the digests to the host
                    from samestep.digests import digest_many

                    sums = digest_many([t.detach() for t in todo.values()])
                elif self.hash == STATE_HASH:
                    sums = [_xxh3(t, k) for k, t in todo.items()]
                else:
                    sums = [sha256_tensor(t) for t in todo.values()]
                memo.update(zip(todo, sums))
            return [memo[k] for k in keys]

    def named(self, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, str]:
        """``{name: checksum}`` of named tensors, in order."""
        return dict(zip((n for n, _ in named), self.of([t for _, t in named])))


class StepChecksums:
    """The step's ``Checksums`` for each hash, shared by whoever reads that step's state: the receipt thread
    (the receipt and the cross-rank check's sums) and the trace worker (the state records). A step's pass is
    dropped once a later step's is asked for: by then the earlier step's readers are done (the optimizer's
    next update waits for both). Every tensor a pass sees was alive at the step's end and is held by its
    reader until that reader is done, so one key is one tensor's bytes. A reader that came late would get a
    fresh pass: the same values, hashed again."""

    def __init__(self) -> None:
        self._step: int | None = None
        self._passes: dict[str, Checksums] = {}
        self._lock = threading.Lock()

    def of_step(self, step: int, hash: str) -> Checksums:
        """Step ``step``'s pass by ``hash``."""
        with self._lock:
            if step != self._step:
                self._step, self._passes = step, {}
            memo = self._passes.get(hash)
            if memo is None:
                memo = self._passes[hash] = Checksums(hash)
            return memo


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

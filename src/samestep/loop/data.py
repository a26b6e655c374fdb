"""Token sources and the data cursor: which tokens a global sample index reads, and where a run stands.

Three sources, all byte-exact and fingerprinted:
- ``stdlib`` (the embedded default): the running interpreter's standard-library ``.py`` files, sorted
  by relative path and concatenated, read as bytes (vocabulary 256). No network, no download.
- ``text``: every file under a directory (sorted relative paths), read as bytes.
- ``bin``: a pre-tokenised file of little-endian uint16 tokens (nanoGPT's ``train.bin``).

Sample order is counter-keyed: the corpus is cut into windows of ``block_size + 1`` tokens; epoch
``e`` visits them in the permutation drawn from ``rng.key(seed, e, 0, "data-order")``. A global sample
index therefore maps to the same window whatever the number of processes, and the cursor (samples
consumed so far) is all a resume needs.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from samestep.determinism import rng
from samestep.records.durable import read_file

__all__ = ["Corpus", "DataCursor", "load_corpus", "stdlib_files"]

SOURCES = ("stdlib", "text", "bin")
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


@dataclass(slots=True)
class Corpus:
    """A token sequence with its content fingerprint."""

    tokens: np.ndarray  # (N,) uint8 or uint16
    vocab_size: int
    fingerprint: str  # SHA-256 of the token bytes
    description: str


def stdlib_files() -> list[Path]:
    """The standard-library source files of this interpreter, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for top, dirs, names in os.walk(root):  # a skipped directory is never entered (site-packages is large)
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files += [Path(top, n) for n in names if n.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _concat(files: list[Path], root: Path) -> bytes:
    # The path header makes the corpus depend on the file set, not only the concatenated bytes.
    return b"".join(b"# file: " + p.relative_to(root).as_posix().encode() + b"\n" + read_file(p) for p in files)


def load_corpus(source: str = "stdlib", path: str | os.PathLike[str] | None = None) -> Corpus:
    """Loads a token source.

    Args:
        source: ``"stdlib"``, ``"text"`` or ``"bin"``.
        path: the directory (``text``) or file (``bin``); unused for ``stdlib``.

    Raises:
        ValueError: an unknown source, a missing path, or an empty corpus (names the source and path).
    """
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        tokens = np.frombuffer(_concat(stdlib_files(), root), dtype=np.uint8)
        desc, vocab = f"stdlib:{root}", 256
    elif source == "text":
        if not path or not Path(path).is_dir():
            raise ValueError(
                f"data.path={path!r} is not a directory; data.source='text' reads every file under a directory"
            )
        root = Path(path)
        files = sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.relative_to(root).as_posix())
        tokens = np.frombuffer(_concat(files, root), dtype=np.uint8)
        desc, vocab = f"text:{root}", 256
    elif source == "bin":
        if not path or not Path(path).is_file():
            raise ValueError(f"data.path={path!r} is not a file; data.source='bin' reads uint16 tokens from one")
        size = Path(path).stat().st_size
        if size % 2:
            raise ValueError(f"data.path={path!r} has {size} bytes, not a whole number of uint16 tokens")
        tokens = np.fromfile(path, dtype="<u2")
        desc, vocab = f"bin:{path}", int(tokens.max()) + 1 if tokens.size else 0
    else:
        raise ValueError(f"data.source={source!r} is unknown; use one of {', '.join(SOURCES)}")
    if tokens.size < 2:
        raise ValueError(f"data source {desc} holds {tokens.size} token(s); it needs at least one block")
    return Corpus(
        tokens=tokens, vocab_size=vocab, fingerprint=hashlib.sha256(tokens.tobytes()).hexdigest(), description=desc
    )


class DataCursor:
    """Maps global sample indices to token windows and remembers how many samples were consumed."""

    def __init__(self, corpus: Corpus, block_size: int, seed: int) -> None:
        self.corpus = corpus
        self.block_size = block_size
        self.seed = seed
        self.n_windows = (corpus.tokens.size - 1) // block_size
        if self.n_windows < 1:
            raise ValueError(
                f"data source {corpus.description} has {corpus.tokens.size} tokens, fewer than "
                f"model.block_size + 1 = {block_size + 1}; use a larger corpus or block"
            )
        self.position = 0  # samples consumed by completed steps
        self._tokens = torch.from_numpy(corpus.tokens.astype(np.int64))
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.pop(min(self._orders))
            g = rng.generator(self.seed, epoch, 0, "data-order")
            self._orders[epoch] = torch.randperm(self.n_windows, generator=g)
        return self._orders[epoch]

    def samples(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets for global samples ``start .. start+count-1``: two (count, T) int64 tensors."""
        rows = []
        for g in range(start, start + count):
            window = int(self._order(g // self.n_windows)[g % self.n_windows])
            rows.append(self._tokens[window * self.block_size : window * self.block_size + self.block_size + 1])
        chunk = torch.stack(rows)  # (count, T+1)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def advance(self, count: int) -> None:
        self.position += count

    def state_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "epoch": self.position // self.n_windows,
            "fingerprint": self.corpus.fingerprint,
            "block_size": self.block_size,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = {"fingerprint": self.corpus.fingerprint, "block_size": self.block_size, "seed": self.seed}
        for name, value in mine.items():
            if state.get(name) != value:
                raise ValueError(
                    f"data cursor: saved {name}={state.get(name)!r} but this run has {value!r}; "
                    "resume with the same data source and config"
                )
        self.position = int(state["position"])

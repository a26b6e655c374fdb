"""torchtitan's data loader and tokenizer interfaces over samestep's token sources (``samestep.loop.data``).

A step's global batch is the same samples on any number of data ranks: the trainer's microbatch ``i`` of
step ``s`` on data rank ``r`` of ``D`` is global microbatch ``r k + i`` (``k`` = the rank's gradient
accumulation steps), as the canonical reduction's tree takes them (each rank's microbatches a run), and
global microbatch ``j`` holds samples ``s B + j b`` onwards (``B`` the global batch, ``b`` the local one). Its
position in a checkpoint is the samples consumed by completed steps, a tensor (torchtitan's own loaders
store pickled bytes), so a checkpoint resumes on any number of data ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer

from samestep.loop.data import DataCursor, load_corpus

__all__ = ["ByteTokenizer", "CorpusLoader"]


class ByteTokenizer(BaseTokenizer):
    """Bytes as tokens (vocabulary 256), the tokens of samestep's ``stdlib`` and ``text`` sources; it reads
    no file (``hf_assets_path`` is not used)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, tokenizer_path: str | None = None, **kwargs: Any) -> None:
        super().__init__()

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        return list(text.encode())

    def decode(self, tokens: list[int], *args: Any, **kwargs: Any) -> str:
        return bytes(tokens).decode(errors="replace")

    def get_vocab_size(self) -> int:
        return 256


class CorpusLoader(BaseDataLoader):
    """Batches of ``local_batch_size`` windows of ``seq_len + 1`` tokens from a samestep token source
    (``dataset``: ``stdlib``, the interpreter's standard library, or ``text`` / ``bin`` with
    ``dataset_path``), in the counter-keyed order of ``samestep.loop.data``; yields ``({"input": x}, labels)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "stdlib"
        seed: int = 0
        """The sample order's key (``samestep.loop.data``)."""
        global_batch_size: int = 0
        """Samples a step takes over all data ranks; the trainer sets it from ``training.global_batch_size``."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int = 1,
        dp_rank: int = 0,
        tokenizer: Any = None,
        seq_len: int = 2048,
        local_batch_size: int = 1,
        **kwargs: Any,
    ) -> None:
        per_rank = local_batch_size * dp_world_size
        if config.global_batch_size <= 0 or config.global_batch_size % per_rank:
            raise ValueError(
                f"dataloader.global_batch_size={config.global_batch_size} must be a positive multiple of "
                f"local_batch_size x data ranks = {per_rank}; set training.global_batch_size"
            )
        self.cursor = DataCursor(load_corpus(config.dataset, config.dataset_path), seq_len, config.seed)
        self.global_batch, self.local_batch = config.global_batch_size, local_batch_size
        self.per_step = config.global_batch_size // per_rank  # the rank's microbatches of a step
        self.rank = dp_rank
        self._taken = 0  # batches this rank took since the position

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            step, i = divmod(self._taken, self.per_step)
            start = self.cursor.position + step * self.global_batch + (self.rank * self.per_step + i) * self.local_batch
            x, y = self.cursor.samples(start, self.local_batch)
            self._taken += 1
            yield {"input": x}, y

    def state_dict(self) -> dict[str, Any]:
        """The samples that the steps completed so far consumed (a batch taken for a step under way is not)."""
        done = self.cursor.position + self._taken // self.per_step * self.global_batch
        return {
            "samples": torch.tensor(done, dtype=torch.int64),
            "fingerprint": torch.frombuffer(bytearray.fromhex(self.cursor.corpus.fingerprint), dtype=torch.uint8),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = bytes(state["fingerprint"].tolist()).hex() if "fingerprint" in state else None
        if saved != self.cursor.corpus.fingerprint:
            raise ValueError(
                f"dataloader: the checkpoint's corpus fingerprint {str(saved)[:16]} is not this run's "
                f"{self.cursor.corpus.fingerprint[:16]} ({self.cursor.corpus.description}); resume with "
                "the same dataloader.dataset and dataset_path"
            )
        self.cursor.position, self._taken = int(state["samples"]), 0

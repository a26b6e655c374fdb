"""A job's layout: how it splits the work and the tensors over its processes (run.json's "layout", each resume
entry's), and the layout that wrote a checkpoint."""

from __future__ import annotations

from typing import Any

from samestep.train.config import Config
from samestep.train.config_file import build
from samestep.train.tensor_parallel import data_ranks

__all__ = ["job_layout", "written_layout"]


def job_layout(cfg: Config, world: int) -> dict[str, Any]:
    """The processes, the microbatches of each data rank, FSDP2 over more than one data rank, and the
    tensor-, pipeline- and expert-parallel degrees of a job of ``world`` processes under ``cfg``."""
    par, data = cfg.parallel, data_ranks(cfg, world)
    return {
        "world_size": world,
        "microbatches_per_process": cfg.train.microbatches // data,
        **({"sharded": "fsdp2"} if par.fsdp and data > 1 else {}),
        **({"tensor_parallel": par.tp} if par.tp_chunks else {}),
        **({"pipeline_parallel": par.pp} if par.pp > 1 else {}),
        **({"expert_parallel": par.ep} if par.ep > 1 else {}),
    }


def written_layout(loaded: Any) -> dict[str, Any]:
    """The layout of the job that wrote a checkpoint (a ``LoadedCheckpoint``), from its config: as many shards
    may be cut otherwise (TP 4, and FSDP2 over 2 data x 2 tensor ranks), which its receipts tell apart."""
    return job_layout(build(loaded.config or {}), loaded.world_size)

"""The processes of a run: one, or the ranks torchrun started (WORLD_SIZE > 1), with their process group
and device, and the device a config asks for."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from samestep.determinism.env import describe_rank_differences, environment, rank_differences
from samestep.distributed import any_rank
from samestep.train.config import Config

__all__ = ["Processes", "device_kind"]


class Processes:
    """torch.distributed set-up when launched by torchrun (WORLD_SIZE > 1), else a single process."""

    def __init__(self, device_kind: str, group_of_one: bool = False) -> None:
        """``group_of_one``: a process group even for a single process (a tensor-parallel mesh of one)."""
        import torch.distributed as dist

        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device(f"cuda:{local}" if device_kind == "cuda" else "cpu")
        if self.device.type == "cuda" and local >= torch.cuda.device_count():
            raise ValueError(
                f"train.device=cuda: local rank {local} needs GPU {local}, but this machine has "
                f"{torch.cuda.device_count()} GPU(s). Fix: --nproc at most {torch.cuda.device_count()} "
                f"per machine, or train.device=cpu (gloo) for more processes than GPUs."
            )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.owned = False
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
            self.owned = True
        elif group_of_one and self.world == 1 and not dist.is_initialized():
            dist.init_process_group(
                "nccl" if self.device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
            )
            self.owned = True

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.world > 1:
            dist.barrier()

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (every rank gets the same answer)."""
        return flag if self.world == 1 else any_rank(flag, self.device)

    def compare_environments(self, mismatch: str) -> dict[str, Any]:
        """Every rank's environment fingerprint against rank 0's, before the first step (see
        ``env.rank_differences``): a difference stops the run on every rank (``mismatch="refuse"``), or with
        ``"warn"`` (determinism.env_mismatch) is returned for run.json, with a warning from rank 0."""
        diffs = rank_differences(environment(), self.device) if self.world > 1 else {}
        if not diffs:
            return {}
        what = describe_rank_differences(diffs)
        if mismatch == "refuse":
            raise ValueError(
                f"the processes run in different environments, so their bits would depend on the node: "
                f"{what}. Fix: run every node on the same software and hardware, or set "
                "determinism.env_mismatch=warn to run anyway (run.json records the differences)"
            )
        if self.rank == 0:
            warnings.warn(
                f"the processes run in different environments (determinism.env_mismatch=warn; run.json "
                f"records it): {what}",
                RuntimeWarning,
                stacklevel=3,
            )
        return {
            str(r): {"host": d["host"], "fields": {k: list(v) for k, v in d["fields"].items()}}
            for r, d in diffs.items()
        }

    def close(self) -> None:
        import torch.distributed as dist

        if self.owned and dist.is_initialized():
            dist.destroy_process_group()


def device_kind(cfg: Config) -> str:
    """The device a config's train.device names: "cuda" or "cpu" ("auto": CUDA if there is a GPU)."""
    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device='cuda' but no CUDA device is available; use train.device=cpu")
    return cfg.train.device

"""torchtitan's pipeline parallelism on samestep's path: the stages, the schedule and the model split are
torchtitan's own (its model's ``pipelining_fn``); samestep hands each microbatch's gradients of a stage to its
``CanonicalGradients`` as that microbatch's backward ends (``canonical_stage_of``), numbered by the global
microbatch as one process numbers them, takes the step's loss from the last stage's tree sum, and clips by the
norm whose rows the stages gather in stage order (docs/layouts.md, "Pipeline parallelism")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["SCHEDULES", "Pipelined"]

SCHEDULES = ("1F1B", "GPipe")  # one full backward per microbatch, in microbatch order (CanonicalStage)


class Pipelined:
    """This rank's stage of the trainer's pipeline (``trainer.pp_schedule``): a step runs
    ``gradient_accumulation_steps`` schedule calls of ``num_pipeline_parallel_microbatches`` microbatches each,
    the global microbatch ``call x n + chunk``. ``canonical``: the microbatch gradients summed along the canonical
    tree (one process's order), else pipelining's own (added into ``p.grad`` as they come, torchtitan's). ``scope(i)``:
    a context around microbatch i's forward and backward (the trace's)."""

    def __init__(self, trainer: Any, *, canonical: bool, scope: Callable[[int], Any]) -> None:
        import torch.distributed as dist

        from samestep.distributed import CanonicalGradients, canonical_stage_of

        self.n, self.calls = trainer.num_pipeline_parallel_microbatches, trainer.gradient_accumulation_steps
        mesh = trainer.parallel_dims.get_mesh("pp")
        self.group, self.first, self.last = mesh.get_group(), trainer.pp_has_first_stage, trainer.pp_has_last_stage
        self.schedule = trainer.pp_schedule
        self.last_rank = dist.get_global_rank(self.group, mesh.size() - 1)
        self._call = 0
        stage = getattr(self.schedule, "_stage", None)  # a single-stage schedule's (GPipe, 1F1B)
        if stage is None:
            raise ValueError(
                f"SamestepTrainer: the pipeline schedule {type(self.schedule).__name__} holds "
                "more than one stage a rank. Fix: --parallelism.pipeline_parallel_schedule 1F1B"
            )
        self.grads = None  # canonical: the stage's tree; else pipelining's own sums
        if canonical:
            self.grads = CanonicalGradients(
                trainer.model_parts[0].parameters(), microbatches_per_process=self.calls * self.n
            )
            canonical_stage_of(stage, grads=self.grads, microbatch=self._microbatch, scope=scope)

    def _microbatch(self, chunk: int) -> int:
        return self._call * self.n + chunk

    @property
    def microbatches(self) -> int:
        """The loader batches a step takes."""
        return self.calls * self.n

    def step(
        self, trainer: Any, batches: list[tuple[dict[str, Any], torch.Tensor]], tokens: torch.Tensor
    ) -> torch.Tensor:
        """The step's forwards and backwards over ``batches`` (``microbatches`` of them, in order), through the
        schedule's public ``step`` (the whole batch of a call, which it splits back into the same microbatches);
        the step's loss on every rank of the pipeline (the last stage's, sent to the others)."""
        from samestep.distributed import broadcast_from

        device, sums = trainer.device, []
        for call in range(self.calls):
            self._call = call
            part = [
                trainer.post_dataloading_process(
                    {key: v.to(device) if isinstance(v, torch.Tensor) else v for key, v in input_dict.items()},
                    labels.to(device),
                )
                for input_dict, labels in batches[call * self.n : (call + 1) * self.n]
            ]
            extras = sorted({key for _, _, extra in part for key in extra})
            if extras:
                raise ValueError(
                    f"SamestepTrainer: pipeline parallelism with model inputs besides the tokens "
                    f"({', '.join(extras)}) is not supported yet. Fix: pipeline_parallel_degree 1"
                )
            losses: list[torch.Tensor] | None = [] if self.last else None
            with trainer.train_context():
                self.schedule.step(
                    *((torch.cat([x for x, _, _ in part]),) if self.first else ()),
                    target=torch.cat([y for _, y, _ in part]) if self.last else None,
                    losses=losses,
                    return_outputs=False,
                    loss_kwargs={"global_valid_tokens": tokens},
                )
            if losses is not None:
                sums.append(torch.stack(losses).sum())
        if self.grads is not None:  # every stage's tree; the last stage's extra is the loss sum
            loss = self.grads.reduce()
        else:  # torchtitan's: each call's sum, added up
            loss = torch.stack(sums).sum() if sums else torch.zeros(())
        mine = loss.reshape(1).to(device) if self.last else torch.zeros(1, device=device)
        return broadcast_from(mine, self.last_rank, self.group).reshape(())

    def clip(self, trainer: Any, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """The norm of every stage's gradients together, this stage's clipped by it: the stages' rows gathered
        in stage order (canonical), or torchtitan's own (the stages' norms combined)."""
        if self.grads is not None:
            from samestep.distributed import clip_grad_norm_

            return clip_grad_norm_(params, max_norm, over=self.group)
        from torchtitan.distributed import utils as dist_utils

        return dist_utils.clip_grad_norm_(
            params, max_norm, foreach=True, pp_mesh=trainer.parallel_dims.get_optional_mesh("pp")
        )

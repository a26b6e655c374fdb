"""Fault detection while training: silent data corruption caught when it happens, not when it makes a NaN.

- **Cross-rank check** (``train.cross_rank_check``, data parallel on more than one process): after the
  reduction every rank holds the same reduced gradients, and after the update the same parameters (under
  tensor parallelism, the data ranks of one tensor rank hold the same shards, and they compare). Each
  rank's receipt thread checksums both (``receipt_writer.CrossRankSums``, the pass its receipt shares); at the next
  optimizer step the ranks compare them (one all-gather of a 32-byte digest of the sums; only a
  disagreement moves the sums, to name the first tensor).
- **Recompute check** (``train.sdc_check_every=N``): every N steps each rank runs one of its microbatches'
  forward and backward again, the first of a pair of the canonical tree (so ``p.grad`` holds its gradient
  alone), and compares loss and gradients bit for bit before the update.

A mismatch stops the run on every rank (``FaultDetected``; ``samestep train`` exits 4), naming the rank,
the step, the microbatch (recompute) and the first differing tensor, and the newest checkpoint before it;
with ``train.sdc_action=warn`` it warns and goes on.
"""

from __future__ import annotations

import json
import math
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from samestep import exit_codes
from samestep.checkpoint import committed_steps
from samestep.distributed.gather import gather_if_different
from samestep.distributed.shards import local_shard
from samestep.records.receipt_writer import ReceiptWriter
from samestep.records.rundir import checkpoints_dir

__all__ = [
    "EXIT_FAULT",
    "EXIT_NONFINITE",
    "CrossRankCheck",
    "FaultDetected",
    "NonFinite",
    "RecomputeCheck",
    "check_finite",
    "report_fault",
]

EXIT_FAULT = exit_codes.FAULT  # samestep train's exit code when a fault check stops the run
EXIT_NONFINITE = exit_codes.NONFINITE  # and when a step's loss or gradient norm is not finite


class FaultDetected(RuntimeError):
    """A fault check found a difference that deterministic training cannot make."""


class NonFinite(RuntimeError):
    """A step's loss or gradient norm is NaN or infinite; the step's update was not applied."""

    def __init__(self, step: int, loss: float, grad_norm: float) -> None:
        super().__init__(
            f"step {step}: the loss is {loss!r} and the gradient norm {grad_norm!r}; the run stopped "
            f"before that step's update, with a checkpoint of step {step - 1} (lower train.lr, or set "
            "train.nonfinite=continue to train on)"
        )
        self.step = step


def check_finite(step: int, loss: float, grad_norm: float, action: str) -> None:
    """Raises ``NonFinite`` for a non-finite loss or gradient norm at ``step`` (1-based), unless ``action`` is
    "continue"."""
    if action == "stop" and not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFinite(step, loss, grad_norm)


def report_fault(message: str, step: int, run_dir: Path, action: str) -> None:
    """Raises ``FaultDetected`` (``action="stop"``) or warns, naming the newest checkpoint before ``step``."""
    good = next((p.name for s, p in committed_steps(checkpoints_dir(run_dir)) if s < step), None)
    where = (
        f"the newest checkpoint before it is {good} (samestep train --resume takes the newest; set later ones aside)"
        if good
        else "no checkpoint precedes it (start the run again)"
    )
    text = f"fault detected: {message}; {where}"
    if action == "warn":
        warnings.warn(text + " (train.sdc_action=warn: training goes on)", RuntimeWarning, stacklevel=2)
        return
    raise FaultDetected(text)


def _first_difference(mine: dict[str, str], theirs: dict[str, str]) -> str | None:
    """The first tensor (in the model's parameter order) whose checksum differs."""
    return next((name for name, d in mine.items() if theirs.get(name) != d), None)


class CrossRankCheck:
    """The cross-rank check of the module docstring, over one ``ReceiptWriter``'s sums. ``check`` is a
    collective: every rank calls it at the same point (the optimizer's pre-hook, and ``final`` at the end).

    Each step's 32-byte digest of the sums (made on the receipt thread) is all-gathered asynchronously, started at
    the next update and
    read at the one after, so the collective's latency overlaps a step of training instead of adding to it;
    a fault is named one step later than it could be, with the same step, rank and tensor.

    ``peers``: the sets of ranks that hold the same tensors and compare them (None: every rank one set; under
    tensor parallelism each tensor rank's data ranks). Every rank gathers every digest, so a disagreement in
    any set stops every rank at the same step."""

    def __init__(
        self,
        writer: ReceiptWriter,
        device: torch.device,
        run_dir: Path,
        action: str,
        peers: list[list[int]] | None = None,
    ) -> None:
        self.writer, self.device, self.run_dir, self.action, self.peers = writer, device, run_dir, action, peers
        self.checked = 0
        self._pending: tuple | None = None  # (step, its sums, the all-gather's work, its output)
        self._hook = None

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Checks before each update (after the writer's own wait: hooks run in order)."""
        self._hook = optimizer.register_step_pre_hook(lambda *_: self.check())

    def check(self) -> None:
        """Reads the pending comparison, then starts the newest step's."""
        import torch.distributed as dist

        self._settle()
        self.writer.wait()
        d = self.writer.last
        if d is None or d.step == self.checked:
            return
        self.checked = d.step
        mine = torch.frombuffer(bytearray(d.digest), dtype=torch.int64).to(self.device)
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        self._pending = (d.step, d.sums, dist.all_gather(out, mine, async_op=True), out)

    def final(self) -> None:
        """Checks the last step: no update follows to check it before."""
        self.check()
        self._settle()

    def _settle(self) -> None:
        if self._pending is None:
            return
        step, sums, work, out = self._pending
        self._pending = None
        work.wait()
        digests = [bytes(o.cpu().numpy()) for o in out]
        sets = self.peers if self.peers is not None else [list(range(len(out)))]
        odd = [ranks for ranks in sets if len({digests[r] for r in ranks}) > 1]
        if odd:  # every rank sees the same: every rank goes on here
            doc = json.dumps(sums).encode()
            maps = [json.loads(x) for x in gather_if_different(doc, doc, self.device) or [doc] * len(out)]
            report_fault(self._describe(step, [maps[r] for r in odd[0]], odd[0]), step, self.run_dir, self.action)

    @staticmethod
    def _describe(step: int, maps: list[dict[str, dict[str, str]]], ranks: list[int] | None = None) -> str:
        keys = [json.dumps(m, sort_keys=True) for m in maps]
        common, count = Counter(keys).most_common(1)[0]
        majority = count > len(keys) // 2
        ref = keys.index(common) if majority else 0
        odd = [r for r, k in enumerate(keys) if k != keys[ref]]
        r = odd[0]
        name = (lambda i: ranks[i]) if ranks is not None else (lambda i: i)
        grad = _first_difference(maps[r]["grads"], maps[ref]["grads"])
        what = (
            f"the reduced gradient {grad!r} differs"
            if grad is not None
            else f"the parameter {_first_difference(maps[r]['params'], maps[ref]['params'])!r} differs after the update"
        )
        who = (
            f"rank {', '.join(str(name(i)) for i in odd)} disagree(s) with the other {len(keys) - len(odd)} rank(s)"
            if majority
            else f"rank {name(r)} and rank {name(ref)} disagree (no majority of {len(keys)} ranks tells which is wrong)"
        )
        return f"cross-rank check at step {step}: {who}: {what}"

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._pending = None


class RecomputeCheck:
    """The recompute check of the module docstring. ``forward(step, microbatch, x, y)`` is the loop's own
    forward (the loss the microbatch adds); ``firsts``: the rank's microbatches whose ``p.grad`` holds their
    gradient alone right after their backward; ``any_rank(flag)``: whether any rank's flag is set (every rank
    gets the same answer)."""

    def __init__(
        self,
        every: int,
        forward: Callable[..., torch.Tensor],
        named_params: list[tuple[str, torch.nn.Parameter]],
        firsts: list[int],
        rank: int,
        run_dir: Path,
        action: str,
        any_rank: Callable[[bool], bool],
    ) -> None:
        self.every, self.forward, self.firsts, self.rank, self.any_rank = every, forward, firsts, rank, any_rank
        self.named = [(n, p) for n, p in named_params if p.requires_grad]
        self.run_dir, self.action = run_dir, action
        self.found: str | None = None  # a mismatch of this step, on this rank

    def pick(self, step: int) -> int | None:
        """The microbatch this rank checks at ``step`` (0-based), or None: one of ``firsts``, by the step."""
        if (step + 1) % self.every:
            return None
        return self.firsts[(step // self.every) % len(self.firsts)]

    def compare(self, step: int, microbatch: int, x: torch.Tensor, y: torch.Tensor, loss: torch.Tensor) -> None:
        """Runs the microbatch again (nothing recorded, no ``p.grad`` touched) against its first run."""
        again = self.forward(step, microbatch, x, y)
        grads = torch.autograd.grad(again, [p for _, p in self.named], allow_unused=True)
        differ = [
            name
            for (name, p), g in zip(self.named, grads)
            if (p.grad is None) != (g is None) or (g is not None and not _same(g, p.grad))
        ]
        loss_differs = not _same(again.detach(), loss.detach())
        if differ or loss_differs:
            grads_text = (
                f"{len(differ)} of {len(self.named)} gradients differ, first {differ[0]!r}"
                if differ
                else "its gradients agree"
            )
            self.found = f"{'its loss differs; ' if loss_differs else ''}{grads_text}"

    def settle(self, step: int, microbatch: int | None) -> None:
        """After the microbatches: every rank learns whether any found a mismatch (a collective at check steps),
        and each reports what it found."""
        if (step + 1) % self.every:
            return
        found, self.found = self.found, None
        if self.any_rank(found is not None):
            message = (
                f"recompute check at step {step + 1}, microbatch {microbatch} on rank {self.rank}: {found}"
                if found is not None
                else f"recompute check at step {step + 1}: another rank found a mismatch"
            )
            report_fault(message, step + 1, self.run_dir, self.action)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: same dtype, shape and bytes (NaNs with the same payload are the same); of DTensors, this
    rank's shards (DTensor's own ``equal`` is a collective over their mesh)."""
    a, b = local_shard(a), local_shard(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))

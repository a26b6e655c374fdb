"""The mistakes a loop under ``samestep.Run`` makes first, caught where they are made, before they cost a step:
``LoopError`` (one line naming the fix; ``Run`` ends the program with it and exit 2, docs/api.md), and
``StaleGradients``, which finds a step's backward adding to the gradients of the step before (no
``zero_grad`` between the updates), ``GlobalDraws``, which finds a step drawing from torch's global generator
where no checkpoint carries the draw (a keyed run's step, or a draw after the update), and
``warn_loose_loaders``, a shuffled DataLoader iterated outside Run's data cursor."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

from samestep.exit_codes import Refusal

__all__ = [
    "GlobalDraws",
    "LoopError",
    "StaleGradients",
    "grads_changed_after_update",
    "left_inside_a_step",
    "second_loop",
    "warn_loose_loaders",
]


class LoopError(Refusal):
    """A loop's misuse of ``samestep.Run``: one line, the fix in it."""


class StaleGradients:
    """Watches ``params``' gradients between optimizer updates. After an update (``updated``) it keeps a weak
    reference to each gradient and its version; the first time a backward accumulates into a parameter after
    that, the gradient is stale where it is the same tensor and only that accumulation changed it (a
    ``zero_grad(set_to_none=True)`` leaves a new tensor, ``set_to_none=False`` one more version). ``check``
    raises ``LoopError`` at the next update, before it is taken. One Python call a parameter a backward;
    nothing is held alive (FSDP2's sharded gradients, set rather than accumulated, are not watched)."""

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        self._after: dict[int, tuple[weakref.ref, int]] = {}  # parameter index -> its gradient after the update
        self._stale: str | None = None
        self._step = 0
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(i, name))
            for i, (name, p) in enumerate(params)
            if p.requires_grad
        ]

    def _hook(self, index: int, name: str) -> Any:
        def accumulated(p: torch.Tensor) -> None:
            after = self._after.pop(index, None)
            if after is None or self._stale is not None:
                return
            ref, version = after
            if ref() is p.grad and p.grad._version == version + 1:
                self._stale = name

        return accumulated

    def updated(self, step: int, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        """The update of ``step`` is done: each gradient as it stands now."""
        self._step = step
        self._after = {
            i: (weakref.ref(p.grad), p.grad._version) for i, (_, p) in enumerate(params) if p.grad is not None
        }

    def check(self, step: int) -> None:
        """Raises ``LoopError`` where a backward of ``step`` added to the gradients of the update before."""
        if self._stale is not None:
            name, self._stale = self._stale, None
            raise LoopError(
                f"samestep.Run: step {step}'s backward added to the gradients of step {self._step} "
                f"(the first: {name}.grad), which nothing zeroed after that step's optimizer.step(). "
                "Fix: call optimizer.zero_grad() after optimizer.step() (or before the backward)"
            )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def grads_changed_after_update(step: int, name: str) -> LoopError:
    """A gradient the loop changed in place after ``optimizer.step()`` recorded it, before its digest was done."""
    return LoopError(
        f"samestep.Run: step {step}'s gradients changed in place after optimizer.step() recorded them "
        f"({name}.grad; zero_grad(set_to_none=False) does this) before their digest was done. Fix: "
        "optimizer.zero_grad() (set_to_none=True, PyTorch's default), or samestep.Run(..., copy=True) "
        "to digest copies of them"
    )


def left_inside_a_step(left: int, total: int | None, newest: int) -> str:
    """What ``samestep.Run`` says of a loop left inside step ``left`` without an error (a ``break``): the step
    unsaved, no final.json, and the checkpoint (``newest``, 0: none) a resume goes on from."""
    return (
        f"samestep.Run: the loop left step {left} of {total} before that step ended (a break or return inside "
        "`for step in run.steps(...)`): the step is recorded as failed and not saved, and no final.json is "
        "written; "
        + (
            f"the newest checkpoint is of step {newest}, which a resume goes on from"
            if newest
            else "no checkpoint was saved, so a resume starts from step 0"
        )
        + ". Fix: pass run.steps() the step count the loop means to run, and leave the loop only by finishing "
        "it"
    )


def second_loop(run_dir: Any) -> LoopError:
    """A second ``run.steps()`` on one Run: a run is one loop over its steps."""
    return LoopError(
        f"samestep.Run: steps() was called a second time on {run_dir}; a run is one loop over its steps "
        "(a resume continues it where its checkpoint left it). Fix: one `for step in run.steps(N)` a "
        "Run, or another samestep.Run (its own run directory) for another loop"
    )


def _global_states() -> list[torch.Tensor]:
    """torch's global generator states: the CPU's, and each CUDA device's where CUDA is in use."""
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return states


class GlobalDraws:
    """Draws from torch's global generator that a checkpoint cannot carry, warned once each, naming the first
    step; a copy of the generator states (a few kilobytes) a step until then.

    - ``rng="keyed"``: any draw in a step (a dropout, a ``torch.randn``, a sampler without ``generator=``): no
      resume restores it and each process holds its own, so such draws give other bits on another number of
      processes and after a resume.
    - ``rng="restore"``: a draw after the step's update (a batch fetched ahead at the end of the step, as
      nanoGPT's loop does): the step's checkpoint restores the generator after the draw but not what it made,
      so a resume from it trains on another batch; a stop on a signal leaves no receipt past that checkpoint
      to catch it (docs/api.md, "What stays yours")."""

    def __init__(self, rng: str) -> None:
        self.keyed = rng == "keyed"
        self._from: list[torch.Tensor] | None = None
        self.warned = False

    def before(self) -> None:
        """At a step's start."""
        if self.keyed and not self.warned:
            self._from = _global_states()

    def updated(self) -> None:
        """After the step's update."""
        if not self.keyed and not self.warned:
            self._from = _global_states()

    def after(self, step: int) -> None:
        """At the step's end, before its checkpoint."""
        then, self._from = self._from, None
        if then is None or all(torch.equal(a, b) for a, b in zip(then, _global_states())):
            return
        self.warned = True
        warnings.warn(
            f"samestep.Run(rng='keyed'): step {step} drew from torch's global generator (a dropout, a torch.randn "
            "or a sampler without generator=): no resume restores it and each process holds its own, so those "
            "draws give other bits on another number of processes and after a resume. Fix: draw from "
            "samestep.rng.generator(seed, step, microbatch, purpose), or rng='restore'"
            if self.keyed
            else f"samestep.Run: step {step} drew from torch's global generator after its update (a batch fetched "
            "ahead for the next step?): its checkpoint restores the generator after that draw but not what it "
            "made, so a resume from it trains on other data. Fix: fetch a step's batch inside that step, before "
            "optimizer.step()",
            UserWarning,
            stacklevel=3,  # the loop's own line: the generator's caller
        )


def warn_loose_loaders(data_cursor: Any, loop: Any) -> None:
    """Warns of a shuffled DataLoader (a ``RandomSampler``'s) that is not Run's ``data_cursor`` among the names
    of the loop's frame (``loop``: its locals and its module's globals), looked at once, after the first step:
    no checkpoint holds its place in the epoch or its order, so a resume would start the epoch over on other
    batches (and stop at the first step it computes again). A loader that does not shuffle (an evaluation's)
    is not named."""
    from torch.utils.data import DataLoader

    names = [] if loop is None else [*loop.f_locals.values(), *loop.f_globals.values()]
    loose = [
        o
        for o in names
        if isinstance(o, DataLoader)
        and o is not data_cursor
        and type(getattr(o, "sampler", None)).__name__ == "RandomSampler"
    ]
    if loose:
        warnings.warn(
            f"samestep.Run: a shuffled {type(loose[0]).__name__} of the loop's is not the data_cursor given to "
            "Run: no checkpoint holds its place in the epoch or its order, so a resume would start the epoch "
            "over on other batches. Fix: samestep.Run(..., data_cursor=loader), a torchdata StatefulDataLoader "
            "with generator=",
            UserWarning,
            stacklevel=3,
        )

"""What a receipt's state is of: the tree a loop driven by ``samestep.Run`` or a framework callback receipts at a
step's end (its model with the buffers as they were then, its optimizer and further parts), and the parts of a
checkpoint's state that a run's receipts digest (``samestep.records.receipts`` checksums them)."""

from __future__ import annotations

from typing import Any

__all__ = ["buffers_now", "model_state", "receipted_state", "state_tree"]


def receipted_state(tree: dict[str, Any], written_by: str | None) -> dict[str, Any]:
    """The parts of a run's state (a checkpoint's, ``checkpoint_state``) that its receipts digest: samestep
    train's leave out its schedule (a function of the step); ``samestep.Run``'s take every part it saves."""
    if written_by == "samestep.trace":
        return tree
    return {k: v for k, v in tree.items() if k != "scheduler"}


def buffers_now(buffers: list[tuple[str, Any]]) -> dict[str, Any]:
    """Copies of a model's persistent buffers (``_state.persistent_buffers``, as the loop keeps them), taken at
    a step's end: the next forward may change them in place (running statistics) while the receipt thread
    reads the state."""
    return {name: b.detach().clone() for name, b in buffers}


def model_state(model: Any, buffers: dict[str, Any]) -> dict[str, Any]:
    """``model.state_dict()`` with ``buffers`` (``buffers_now``'s, of the same step) in place of the live ones."""
    sd = model.state_dict()
    sd.update((k, v) for k, v in buffers.items() if k in sd)
    return sd


def state_tree(
    step: int, model: Any, optimizer: Any = None, *, buffers: list[tuple[str, Any]], **parts: Any
) -> dict[str, Any]:
    """The state after ``step`` as a loop driven by ``samestep.Run`` or a framework callback receipts it, taken
    at the step's end: the step, and the state dict of the model (its persistent ``buffers``, as the loop
    keeps them, copied: ``buffers_now``), of the optimizer and of each further part (a scheduler, a data
    cursor) that is not None."""
    others = {"optimizer": optimizer, **parts}
    return {
        "model": model_state(model, buffers_now(buffers)),
        "step": step,
        **{name: obj.state_dict() for name, obj in others.items() if obj is not None},
    }

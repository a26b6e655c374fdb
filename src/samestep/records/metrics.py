"""metrics.jsonl (docs/formats.md, "Run directory"): one line per step, the loss and gradient norm as exact
bits, written as each step ends and read back by resume, diff and the replays; a line torn by a kill is only
ever the last."""

from __future__ import annotations

import json
from typing import Any

from samestep.records.durable import read_file, replace_atomic
from samestep.records.rundir import PathLike, RunDirError, metrics_path

__all__ = ["last_logged_step", "logged_loss", "metrics_line", "read_metrics", "truncate_metrics"]


def metrics_line(step: int, loss: float, grad_norm: float, lr: float, tokens: int) -> str:
    """One step's line of metrics.jsonl: loss and grad norm also as their exact bits."""
    return (
        json.dumps(
            {
                "step": step,
                "loss": loss,
                "loss_hex": loss.hex(),
                "grad_norm": grad_norm,
                "grad_norm_hex": grad_norm.hex(),
                "lr": lr,
                "tokens": tokens,
            }
        )
        + "\n"
    )


def read_metrics(run_dir: PathLike) -> list[dict[str, Any]]:
    """metrics.jsonl's rows, up to a torn last line of a killed run (none if there is no file).

    Raises:
        RunDirError: a line that is no row of this format (not a table, or its step not an integer),
            naming the file and line.
    """
    path = metrics_path(run_dir)
    rows = []
    try:
        text = read_file(path).decode("utf-8")
    except FileNotFoundError:
        return rows
    except UnicodeDecodeError as e:
        raise RunDirError(f"{path}: not UTF-8 text ({e})") from None
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # a torn last line of a killed run
            raise RunDirError(f"{path}:{number}: not valid JSON; only the last line may be torn") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
            raise RunDirError(f"{path}:{number}: {line[:80]!r} is not a metrics row (a table with an integer step)")
        rows.append(row)
    return rows


def truncate_metrics(run_dir: PathLike, last_step: int, *, check_only: bool = False) -> None:
    """Keeps the metric lines of steps <= last_step (a killed run may have written more, or a torn line).
    ``check_only``: raise what it would raise, and change nothing (a resume checks every file before it
    writes any).

    Raises:
        RunDirError: a damaged line before the last, the file missing although steps were trained, or the
            lines kept are not steps 1..last_step in order (a gap): nothing is cut, and the message names
            the file and what is wrong.
    """
    path = metrics_path(run_dir)
    if not path.exists():
        if last_step:
            raise RunDirError(
                f"{path}: missing, though the run trained steps 1..{last_step}; resuming would leave "
                "the metrics incomplete: restore the file, or resume into a new run directory"
            )
        return
    lines = read_file(path).decode("utf-8").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()  # a torn last line of a killed run
    rows = read_metrics(run_dir)[: len(lines)]
    kept = [line for line, row in zip(lines, rows) if row["step"] <= last_step]
    steps = [row["step"] for row in rows if row["step"] <= last_step]
    if steps != list(range(1, last_step + 1)):
        missing = sorted(set(range(1, last_step + 1)) - set(steps))
        raise RunDirError(
            f"{path}: the steps up to {last_step} are not 1..{last_step} in order (missing: "
            f"{missing[:10] or 'none'}; found {len(steps)} lines); resuming would leave the metrics "
            "incomplete: restore the file, or resume into a new run directory"
        )
    if not check_only:
        replace_atomic(path, "".join(kept).encode("utf-8"))


def logged_loss(run_dir: PathLike, step: int) -> float:
    """The loss bits that metrics.jsonl holds for ``step`` (NaN if it holds none): what final.json reports
    when a resumed run has no step left to train."""
    try:
        lines = read_file(metrics_path(run_dir)).decode("utf-8").splitlines()
    except FileNotFoundError:
        return float("nan")
    for line in reversed(lines):
        try:
            entry = json.loads(line)
            if entry["step"] == step:
                return float.fromhex(entry["loss_hex"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return float("nan")


def last_logged_step(run_dir: PathLike) -> int:
    """The step of metrics.jsonl's last complete line (0 if none)."""
    try:
        lines = read_file(metrics_path(run_dir)).decode("utf-8").splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return 0

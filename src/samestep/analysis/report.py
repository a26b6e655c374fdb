"""``make_report``: pictures of runs and of where two of them diverged, as one self-contained HTML page.

    samestep report runs/a runs/b --out report.html

- ``curves.png``: each run's loss and grad norm per step (its metrics.jsonl, or for a loop of one's own
  the bits its receipts hold of ``run.metric("loss" | "grad_norm")``), overlaid; each run's relative
  difference in both from the first run (a one-ULP difference is invisible in the curves); and, from the
  receipts, at which steps each run's state after the update is the first run's (a race that has changed
  the weights shows there before any loss moves). The first step at which the first two runs differ is
  marked, and the title names it and the op and module it began in;
- ``ranks.png`` (two traced runs): per rank, the step at which its first difference lies, coloured by
  what it is (origin, first seen, receiver, structural; no mark where the rank matched);
- the page: the diff's summary, the origin op with its module path, a table per rank, and the pictures
  (embedded, and written beside the page as PNG files).
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any, NamedTuple

from samestep.analysis.diff import DiffError, diff_runs, load_metrics, load_run
from samestep.analysis.receipt_diff import by_rank, states_comparable
from samestep.records.receipts import read_run_receipts

__all__ = ["KIND_COLOURS", "make_report"]

KIND_COLOURS = {"origin": "#d62728", "first_seen": "#ff7f0e", "receiver": "#1f77b4", "structural": "#9467bd"}


def _figure_class() -> Any:
    """matplotlib's Figure: drawn to files without pyplot, so the user's backend and figures stay untouched."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise DiffError(
            "samestep report draws with matplotlib, which is not installed: "
            "pip install 'samestep[report]' (or pip install matplotlib)"
        ) from None
    return Figure


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


class _States(NamedTuple):
    """A run's receipted ranks, and rank 0's receipts by step (``receipt_diff.by_rank``'s)."""

    ranks: set[int]
    by_step: dict[int, dict[str, Any]]


def _rows(run: Path) -> tuple[list[dict[str, Any]], _States]:
    """A run's per-step loss and grad-norm bits (metrics.jsonl's rows, or rank 0's receipts for a loop of
    one's own, which writes no metrics.jsonl), and its receipts' states (none without)."""
    try:
        files = read_run_receipts(run)
    except ValueError as e:  # a damaged receipts file
        raise DiffError(str(e)) from None
    receipts = by_rank(files).get("0", [])
    rows = load_metrics(run) or [
        {"step": r["step"], "loss_hex": r["loss_hex"], "grad_norm_hex": r["grad_norm_hex"]} for r in receipts
    ]
    return rows, _States(set(files), {r["step"]: r for r in receipts})


def _same_and_other(mine: _States, first: _States) -> tuple[list[int], list[int]]:
    """The steps both runs receipted with states of one thing by one hash (``receipt_diff.states_comparable``):
    those where they are the same, and those where they differ."""
    same, other = [], []
    for step in sorted(set(mine.by_step) & set(first.by_step)):
        a, b = mine.by_step[step], first.by_step[step]
        if states_comparable(a, b, mine.ranks == first.ranks):
            (same if a["state"] == b["state"] else other).append(step)
    return same, other


def _title(divergent: int | None, diff: dict[str, Any] | None) -> str:
    """The figure's title: the first divergent step, and the op and module the difference began in."""
    if divergent is None:
        return "no divergent step"
    found = (diff or {}).get("origin") or (diff or {}).get("first_seen")
    if not found:
        return f"first divergent step: {divergent}"
    what = "origin" if diff.get("origin") else "first seen"
    return (
        f"first divergent step: {divergent}; {what}: {found['op']} in {found['scope'] or '<root>'} "
        f"({found['phase']}), rank {found['rank']}, step {found['step']}"
    )


def _curves(
    figure: Any,
    names: list[str],
    metrics: list[list[dict[str, Any]]],
    states: list[_States],
    divergent: int | None,
    title: str,
) -> bytes | None:
    """Loss and grad norm per step of each run, their relative difference from the first run, and where each
    run's state checksum is the first run's; the first divergent step marked. None if no run has metrics."""
    if not any(metrics):
        return None
    fig = figure(figsize=(8, 9.5))
    axes = fig.subplots(4, 1, sharex=True, gridspec_kw={"height_ratios": [3, 3, 3, 1.2]})
    first = {field: {r["step"]: float.fromhex(r[field]) for r in metrics[0]} for field in ("loss_hex", "grad_norm_hex")}
    for k, (name, rows) in enumerate(zip(names, metrics)):
        steps = [r["step"] for r in rows]
        for ax, field in zip(axes, ("loss_hex", "grad_norm_hex")):
            ax.plot(steps, [float.fromhex(r[field]) for r in rows], label=name, linewidth=1.2)
        if k:  # a difference too small to see in the curves (one ULP, say) shows here
            for field, style in (("loss_hex", "-"), ("grad_norm_hex", "--")):
                mine = {r["step"]: float.fromhex(r[field]) for r in rows}
                ref = first[field]
                both = [s for s in steps if s in ref]
                axes[2].plot(
                    both,
                    [abs(mine[s] - ref[s]) / max(abs(ref[s]), 1e-30) for s in both],
                    linestyle=style,
                    label=f"{name} vs {names[0]}: {field[:-4].replace('_', ' ')}",
                    linewidth=1.2,
                    color=f"C{k}",
                )
    axes[2].set_yscale("symlog", linthresh=1e-16)
    axes[2].set_yticks([0, 1e-16, 1e-12, 1e-8, 1e-4, 1])
    if len(metrics) > 1:
        axes[2].legend(loc="upper left", fontsize=7)
    _states(axes[3], names, states)
    for ax, label in zip(axes, ("loss", "grad norm", "relative difference", "state")):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if divergent is not None:
            ax.axvline(divergent, color=KIND_COLOURS["origin"], linestyle="--", linewidth=2)
    axes[0].legend(loc="upper right", fontsize=8)
    axes[3].set_xlabel("step")
    axes[3].xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_title(title, fontsize=9)
    return _png(fig)


def _states(ax: Any, names: list[str], states: list[_States]) -> None:
    """One row per run after the first: a mark at each step both receipted, grey where its state checksum is the
    first run's, red where it is not."""
    ax.set_yticks(range(1, len(names)))
    ax.set_yticklabels(
        [f"{n} vs {names[0]}" if len(n) < 24 else f"run {k} vs run 0" for k, n in enumerate(names[1:], 1)], fontsize=7
    )
    ax.set_ylim(0.5, max(len(names) - 0.5, 1.5))
    if not states or not states[0].by_step:
        ax.text(
            0.5,
            0.5,
            "no receipts: the state after each step is not known",
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=8,
            color="#7f7f7f",
        )
        return
    for k, mine in enumerate(states[1:], 1):
        same, differ = _same_and_other(mine, states[0])
        for steps, colour, label in ((same, "#bbbbbb", "same state"), (differ, KIND_COLOURS["origin"], "other state")):
            if steps:  # no legend entry (in red) for what is not there
                ax.scatter(steps, [k] * len(steps), marker="s", color=colour, s=18, label=label)
    if ax.get_legend_handles_labels()[0]:
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), loc="upper left", fontsize=7, ncol=2)


def _ranks(figure: Any, per_rank: dict[str, Any]) -> bytes | None:
    """Per rank, the step of its first difference, coloured by kind; None if no rank was compared."""
    if not per_rank:
        return None
    ranks = sorted(int(r) for r in per_rank)
    fig = figure(figsize=(max(4.0, min(12.0, 0.4 * len(ranks) + 2)), 3.2))
    ax = fig.subplots()
    seen = set()
    for r in ranks:
        d = per_rank[str(r)]["divergence"]
        if d is None:
            ax.scatter([r], [0], marker="_", color="#7f7f7f", s=120, label=None if "none" in seen else "matched")
            seen.add("none")
            continue
        kind = d["kind"]
        ax.scatter(
            [r],
            [d["step"]],
            color=KIND_COLOURS.get(kind, "black"),
            s=60,
            zorder=3,
            label=None if kind in seen else kind.replace("_", " "),
        )
        seen.add(kind)
    ax.set_xlabel("rank")
    ax.set_ylabel("step of first difference")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_xticks(ranks if len(ranks) <= 32 else ranks[:: max(1, len(ranks) // 16)])
    ax.set_xlim(min(ranks) - 0.5, max(ranks) + 0.5)  # whole ranks, even for one
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return _png(fig)


def _page(names: list[str], diff: dict[str, Any] | None, diff_error: str | None, images: dict[str, bytes]) -> str:
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>samestep report</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}code{background:#f4f4f4}</style>",
        "</head><body><h1>samestep report</h1>",
        "<p>runs: " + ", ".join(f"<code>{esc(n)}</code>" for n in names) + "</p>",
    ]
    if diff_error is not None:
        parts.append(f"<p><b>not compared:</b> {esc(diff_error)}</p>")
    if diff is not None:
        parts.append(f"<h2>verdict: {esc(diff['verdict'])}</h2><p>{esc(diff['summary'])}</p>")
        found = diff["origin"] or diff["first_seen"]
        if found is not None:
            what = "origin" if diff["origin"] else "first seen"
            parts.append(
                f"<p>{what}: <code>{esc(found['op'])}</code> in <code>{esc(found['scope'] or '<root>')}"
                f"</code> ({esc(found['phase'])}), rank {found['rank']}, step {found['step']}, "
                f"microbatch {found['microbatch']}</p>"
            )
        parts += [f"<p>note: {esc(n)}</p>" for n in diff["notes"]]
    for name, title in (("curves", "loss and grad norm"), ("ranks", "where each rank first differs")):
        if name in images:
            parts.append(
                f"<h2>{title}</h2><img alt='{name}' src='data:image/png;base64,"
                f"{base64.b64encode(images[name]).decode()}'>"
            )
    if diff is not None and diff["per_rank"]:
        parts.append(
            "<h2>per rank</h2><table><tr><th>rank</th><th>records compared</th><th>first difference</th>"
            "<th>step</th><th>microbatch</th><th>where</th><th>op</th></tr>"
        )
        for rank, r in sorted(diff["per_rank"].items(), key=lambda kv: int(kv[0])):
            d = r["divergence"]
            cells = [rank, str(r["records_compared"])] + (
                ["none", "", "", "", ""]
                if d is None
                else [
                    d["kind"].replace("_", " "),
                    str(d["step"]),
                    str(d["microbatch"]),
                    f"{d['scope'] or '<root>'} ({d['phase']})",
                    f"{d['op']} #{d['occurrence']}",
                ]
            )
            parts.append("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def make_report(runs: list[str | Path], out: str | Path, *, force: bool = False) -> dict[str, Any]:
    """Draws the runs (and, for two or more, where the first two diverged) into ``out`` (HTML) and PNG
    files beside it (``<stem>_curves.png``, ``<stem>_ranks.png``).

    Returns:
        ``{"html", "pngs", "first_divergent_step", "verdict", "title", "state_differs_at"}``: the verdict of
        the first two runs' diff (None for one run, or when they could not be compared: ``diff_error`` says
        why), the figure's title, and the first step at which their receipts' states differ (None: none).

    Raises:
        DiffError: a run directory is missing or malformed, or matplotlib is not installed.
    """
    paths = [Path(r) for r in runs]
    for p in paths:
        load_run(p)  # a run directory, or a clear error naming it
    figure = _figure_class()
    diff, diff_error = None, None
    if len(paths) >= 2:
        try:
            diff = diff_runs(paths[0], paths[1], force=force)
        except DiffError as e:
            diff_error = str(e)
    divergent = diff["first_divergent_step"] if diff is not None else None
    images = {}
    rows = [_rows(p) for p in paths]
    title = _title(divergent, diff)
    curves = _curves(figure, [str(p) for p in paths], [m for m, _ in rows], [s for _, s in rows], divergent, title)
    if curves is not None:
        images["curves"] = curves
    ranks = _ranks(figure, diff["per_rank"]) if diff is not None else None
    if ranks is not None:
        images["ranks"] = ranks
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pngs = []
    for name, data in images.items():
        png = out.with_name(f"{out.stem}_{name}.png")
        png.write_bytes(data)
        pngs.append(str(png))
    out.write_text(_page([str(p) for p in paths], diff, diff_error, images), encoding="utf-8")
    other_state = _same_and_other(rows[1][1], rows[0][1])[1] if len(rows) > 1 else []
    return {
        "html": str(out),
        "pngs": pngs,
        "first_divergent_step": divergent,
        "verdict": diff["verdict"] if diff is not None else None,
        "diff_error": diff_error,
        "title": title,
        "state_differs_at": other_state[0] if other_state else None,
    }

"""What is traced: the capture levels, the digest workers, and step or rank selections as text."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["LEVELS", "WORKERS", "format_selection", "parse_selection"]

LEVELS = ("off", "step", "module", "op")  # each level records what the ones before it do, and more
WORKERS = ("auto", "process", "thread")  # where digests are computed (see process_worker, thread_worker)
MAX_SELECTED = 10**6  # values a selection may name (it is a set: a typo must not fill the memory)


def parse_selection(text: str | None, what: str) -> set[int] | None:
    """``"all"``/``""`` -> None (everything); ``"1-5,8"`` -> {1, 2, 3, 4, 5, 8}.

    Raises:
        ValueError: names ``what`` and the bad text.
    """
    if text is None or text.strip() in ("", "all"):
        return None
    out: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            span = range(int(lo), int(hi or lo) + 1)
            if not span:  # "5-1": a range that selects nothing is a typo, not a choice
                raise ValueError
            if len(out) + len(span) > MAX_SELECTED:
                raise OverflowError
            out.update(span)
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected 'all' or numbers and ascending ranges like '1-5,8'") from None
    except OverflowError:
        raise ValueError(f"{what}={text!r} selects more than {MAX_SELECTED:,} values; select fewer, or 'all'") from None
    return out


def format_selection(values: Iterable[int]) -> str:
    """The inverse of ``parse_selection``: {1, 2, 3, 5} -> ``"1-3,5"`` (sorted; ``""`` for none)."""
    out: list[str] = []
    start = prev = None
    for v in sorted(values):
        if prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            out.append(f"{start}-{prev}" if start != prev else str(start))
        start = prev = v
    if start is not None:
        out.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(out)

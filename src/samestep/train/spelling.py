"""Near misses: the name a misspelt one was probably meant to be, for the line that refuses it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["did_you_mean"]


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """``" (did you mean PREFIX+CHOICE?)"`` for the choice closest to ``word``, or ``""`` when none is close."""
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""

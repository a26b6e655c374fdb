"""The verifier's word for ``samestep verify`` and ``samestep bisect`` (``replay.consent``): ``--yes``, else a
yes at the terminal's prompt, else nothing (a run's program is then refused, exit 2)."""

from __future__ import annotations

import argparse
import sys

from samestep.replay.consent import Consent

__all__ = ["consent_of"]


def _ask(text: str) -> bool:
    """Shows ``text`` on stderr and reads the answer from the terminal."""
    print(text, end="", file=sys.stderr, flush=True)
    try:
        return sys.stdin.readline().strip().lower() in ("y", "yes")
    except (OSError, EOFError):
        return False


def consent_of(args: argparse.Namespace) -> Consent:
    """``--yes``; else the prompt where stdin and stderr are a terminal; else no word (a program given after ``--``
    is its own word)."""
    try:
        interactive = sys.stdin is not None and sys.stdin.isatty() and sys.stderr.isatty()
    except (OSError, ValueError, AttributeError):  # a closed or stand-in stream (a test runner's)
        interactive = False
    return Consent(
        yes=args.yes, ask=_ask if interactive else None, show=lambda text: print(text, file=sys.stderr, flush=True)
    )

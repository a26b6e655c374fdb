"""The checks every config section makes of its numbers: positive, finite, and no larger than samestep accepts (a
typo must not make it allocate a billion steps); and of settings that cannot be on together (``not_with``)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["FLOAT32_MAX", "MAX_STEPS", "at_most", "finite", "not_with", "positive"]


# The longest run a config may name: bounds what a typo can make samestep allocate.
MAX_STEPS = 10**9


FLOAT32_MAX = 3.4028234663852886e38


def positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:  # NaN too
            raise ValueError(f"{section}.{name}={value!r} must be positive")


def finite(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not math.isfinite(value):
            raise ValueError(f"{section}.{name}={value!r} must be a finite number")


def at_most(section: str, obj: Any, limit: int, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value > limit:
            raise ValueError(
                f"{section}.{name}={value!r} is larger than samestep accepts ({limit:,}); choose a smaller value"
            )


def not_with(setting: str, others: dict[str, bool]) -> None:
    """Refuses ``setting`` (as the config spells it, with its value) together with the first of ``others`` that is
    on (each named as the config spells it): a combination samestep does not keep on one numerical path yet."""
    for other, on in others.items():
        if on:
            raise ValueError(f"{setting} with {other} is not supported yet; use one of them")

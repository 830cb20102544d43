"""Range checks for configuration numbers: finite first (NaN and inf slip through every
`x <= 0` test), then the bound; errors name the offending key."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def check_number(key: str, value: Any, minimum: float = 0.0, strict: bool = True) -> float:
    """`value` as a finite float > minimum (strict) or >= minimum; else a ValueError naming
    `key` (NaN and +-inf fail every comparison-based check, so test finiteness first)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{key} must be finite, got {value!r}")
    if x < minimum or (strict and x == minimum):
        raise ValueError(f"{key} must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return x


def check_trace(key: str, trace: Sequence[Sequence[float]]) -> None:
    """Bandwidth trace [[t_s, gbps], ...]: finite, t_s >= 0 non-decreasing, gbps > 0."""
    prev_t = 0.0
    for i, point in enumerate(trace):
        if not isinstance(point, Sequence) or isinstance(point, str) or len(point) != 2:
            raise ValueError(f"{key}[{i}] must be [t_s, gbps], got {list(point)!r}")
        t = check_number(f"{key}[{i}] t_s", point[0], strict=False)
        check_number(f"{key}[{i}] gbps", point[1])
        if t < prev_t:
            raise ValueError(f"{key}[{i}]: times must be non-decreasing, got {t} after {prev_t}")
        prev_t = t


def check_choice(key: str, value: Any, choices: Sequence[Any]) -> None:
    """`value` must be one of `choices`; else a ValueError naming `key` and the choices."""
    if value not in choices:
        raise ValueError(f"{key} must be one of {tuple(choices)}, got {value!r}")

"""The value checks of the run configuration's sections: an error names the dotted key.

Owns: `check`, `check_number`. Must not import: anything of ours (layer L1, below every section).
"""
from __future__ import annotations

import math


def check(condition: bool, key: str, message: str) -> None:
    """ValueError "`key`: `message`" unless `condition` (config.loader turns it into a ConfigError)."""
    if not condition:
        raise ValueError(f"{key}: {message}")


def check_number(value: float, key: str, low: float, high: float = math.inf, low_open: bool = False) -> None:
    """`key` must be a finite number in [low, high] ((low, high] when `low_open`)."""
    above = value > low if low_open else value >= low
    check(math.isfinite(value) and above and value <= high, key,
          f"must be a finite number {'>' if low_open else '>='} {low}"
          + (f" and <= {high}" if high != math.inf else "") + f", got {value}")

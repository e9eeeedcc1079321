"""Sizes in bytes: parsing a user's budget, printing a size a person can read."""

from __future__ import annotations

import math
import re

__all__ = ["BUDGET_FORMS", "format_size", "parse_budget"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip

# What a budget may be, for error messages (the CLI has its own wording: no Python types).
BUDGET_FORMS = (
    "a number of bytes (int), a fraction of the no-recompute peak (float, 0 < f <= 1), "
    'a percentage ("50%"), or a size string such as "800MB" or "6GiB" '
    "(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
)


def format_size(size: float) -> str:
    """``size`` bytes in the largest binary unit that keeps it at 1 or more: ``"512 B"``,
    ``"3.50 MiB"``, ``"56.13 GiB"``."""
    if abs(size) < 1024:
        return f"{size:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if abs(size) < 1024 or unit == "TiB":
            break
    return f"{size:.2f} {unit}"


def parse_budget(budget: object, baseline: int) -> int:
    """Bytes for a ``budget`` given as bytes, a fraction or percentage of ``baseline``, or a
    size string (see :data:`BUDGET_FORMS`).

    Raises:
        TypeError: a type other than int, float or str.
        ValueError: malformed, negative or zero; the message names the accepted forms.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TypeError(f"budget must be {BUDGET_FORMS}; got {type(budget).__name__}")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget must be positive bytes, got {budget}; use {BUDGET_FORMS}")
        return budget
    if isinstance(budget, float):
        if not (0.0 < budget <= 1.0):
            raise ValueError(
                f"a float budget is a fraction of the no-recompute peak, 0 < f <= 1; got "
                f"{budget}. Use {BUDGET_FORMS}"
            )
        return max(1, int(budget * baseline))
    return _parse_text(budget, baseline)


def _parse_text(budget: str, baseline: int) -> int:
    text = budget.strip()
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            percent = math.nan
        if not (0.0 < percent <= 100.0):
            raise ValueError(
                f"budget {budget!r}: a percentage must be in (0, 100]; use {BUDGET_FORMS}"
            )
        return max(1, int(percent / 100.0 * baseline))
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"budget {budget!r} is not understood; use {BUDGET_FORMS}")
    if not match.group(2) and "." in match.group(1):
        raise ValueError(
            f"budget {budget!r}: a size without a unit is whole bytes; use {BUDGET_FORMS}"
        )
    size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(size):
        raise ValueError(f"budget {budget!r} is too large to be a size; use {BUDGET_FORMS}")
    if size < 1:
        raise ValueError(f"budget {budget!r} is zero; use {BUDGET_FORMS}")
    return int(size)

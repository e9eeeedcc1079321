"""Sizes in bytes: parsing a user's budget, printing a size a person can read."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["BUDGET_FORMS", "Budget", "format_size", "parse_budget", "percent_hint"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip

# What a budget may be, in words that serve the Python API and the command line alike.
BUDGET_FORMS = (
    'whole bytes (25000000), a fraction of the peak without recompute (0.5, in (0, 1]), a '
    'percentage ("50%") or a size ("800MB", "2GiB"; units B, KB, MB, GB, TB, KiB, MiB, GiB, '
    "TiB)"
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


@dataclass(frozen=True)
class Budget:
    """A budget as the user gave it (``given``), checked: whole ``bytes``, or a ``fraction``
    of the peak without recompute (which is known only once the step is profiled)."""

    bytes: int | None = None
    fraction: float | None = None
    given: object = None  # as the user wrote it, for messages

    @classmethod
    def parse(cls, budget: object) -> Budget:
        """Check ``budget`` (bytes, a fraction or a percentage of the no-recompute peak, or a
        size string; see :data:`BUDGET_FORMS`) without knowing the peak.

        Raises:
            TypeError: a type other than int, float or str.
            ValueError: malformed, negative or zero; the message names the accepted forms.
        """
        if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
            raise TypeError(f"budget must be {BUDGET_FORMS}; got {type(budget).__name__}")
        if isinstance(budget, int):
            if budget <= 0:
                raise ValueError(f"budget must be positive bytes, got {budget}; use {BUDGET_FORMS}")
            return cls(bytes=budget, given=budget)
        if isinstance(budget, float):
            if not (0.0 < budget <= 1.0):
                raise ValueError(
                    f"a float budget is a fraction of the no-recompute peak, 0 < f <= 1; got "
                    f"{budget}. Use {BUDGET_FORMS}"
                )
            return cls(fraction=budget, given=budget)
        return _parse_text(budget)

    def resolve(self, baseline: int) -> int:
        """The budget in bytes, given the no-recompute peak ``baseline``."""
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None
        return max(1, int(self.fraction * baseline))


def parse_budget(budget: object, baseline: int) -> int:
    """Bytes for a ``budget`` given as bytes, a fraction or percentage of ``baseline``, or a
    size string: :meth:`Budget.parse` then :meth:`Budget.resolve`.

    Raises:
        TypeError: a type other than int, float or str.
        ValueError: malformed, negative or zero; the message names the accepted forms.
    """
    return Budget.parse(budget).resolve(baseline)


def _parse_text(budget: str) -> Budget:
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
        return Budget(fraction=percent / 100.0, given=budget)
    if text.startswith("-"):
        raise ValueError(f"budget {budget!r} is negative: a budget is above 0; use {BUDGET_FORMS}")
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
    return Budget(bytes=int(size), given=budget)


def percent_hint(given: object) -> str:
    """For a budget of a few bytes given as a bare whole number (``50``, ``"50"``), the
    percentage it may have meant, as a clause (``""`` otherwise)."""
    number = given.strip() if isinstance(given, str) else given
    if isinstance(number, str) and number.isdigit():
        number = int(number)
    if isinstance(number, int) and not isinstance(number, bool) and 1 <= number <= 100:
        return f"a bare whole number is bytes: for {number} percent, give '{number}%'"
    return ""

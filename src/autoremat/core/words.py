"""Lists in messages: the first few of many, and how many more."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["first_few"]


def first_few(items: Sequence[str], most: int, total: int | None = None, sep: str = ", ") -> str:
    """The first ``most`` of ``items`` joined by ``sep``, then ``" and N more"`` for the rest
    of ``total`` (by default ``len(items)``): ``"'a', 'b', 'c' and 4 more"``."""
    total = len(items) if total is None else total
    return sep.join(items[:most]) + (f" and {total - most} more" if total > most else "")

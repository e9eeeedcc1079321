"""What a budget plan chose: one :class:`Choice` per entry, and what it minimised."""

from __future__ import annotations

from dataclasses import dataclass

from autoremat.core.selective import FULL

__all__ = ["OBJECTIVES", "Choice"]

# What a budget plan minimises (``plan(objective=...)``, ``Plan.objective``).
OBJECTIVES = ("time", "flops")


@dataclass(frozen=True)
class Choice:
    """One chosen entry of a budget plan: bytes its recompute frees, FLOPs and seconds (as
    profiled) it adds, and its ``way``: ``"full"`` (recomputed whole), or a selective way (a
    key of :data:`autoremat.core.selective.WAYS`)."""

    path: str
    freed: int
    flops: int
    way: str = FULL
    seconds: float | None = None

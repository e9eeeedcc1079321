"""The proof that a plan's entries were recomputed: :class:`RecomputeCounter` counts, per
entry, the ops run inside its recompute (:func:`autoremat.wrap.replay.recomputing`). A wrap
that recomputes nothing counts none, so an exactness check that also checks this count cannot
pass on a no-op wrap."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from autoremat.wrap.replay import recomputing

__all__ = ["NotRecomputed", "RecomputeCounter"]


class NotRecomputed(AssertionError):
    """Entries that should have been recomputed ran no op in a recompute."""


class RecomputeCounter(TorchDispatchMode):
    """Counts, for each plan entry, the ops its recomputes run while the mode is active.
    Active around a training step (``with RecomputeCounter() as seen: step()``), it sees the
    backward too (the autograd engine carries the mode into it). ``ops[entry]``: the count."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        entry = recomputing()
        if entry is not None:
            self.ops[entry] += 1
        return func(*args, **(kwargs or {}))

    def missing(self, entries: Iterable[str]) -> list[str]:
        """The entries of ``entries`` that ran no op in a recompute."""
        return [e for e in entries if not self.ops[e]]

    def check(self, entries: Iterable[str]) -> None:
        """Raise :class:`NotRecomputed` unless each of ``entries`` (one at least) ran ops in a
        recompute."""
        entries = list(entries)
        if not entries:
            raise NotRecomputed("no entry is wrapped: nothing could be recomputed")
        missing = self.missing(entries)
        if missing:
            raise NotRecomputed(f"not recomputed: {missing} (recomputed: {dict(self.ops)})")

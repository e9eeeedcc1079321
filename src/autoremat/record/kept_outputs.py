"""The outputs of the ops a selective recompute keeps, as a recorded step makes them.

:class:`~autoremat.record.recording.OpCosts` notes each such output here, by its storage's
key: when it was made (the event clock), whether an op later wrote to it in place, and when
the step, recomputing nothing, freed it (a ``weakref.finalize`` on its storage).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from autoremat.core.nested import iter_tensors, storage_key

__all__ = ["KeptOutputs"]


class KeptOutputs:
    """Kept outputs by storage key (module docstring); ``clock()`` is the recording's event
    count."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock = clock
        self.born: dict[int, int] = {}  # key -> the clock when it was made
        self.freed: dict[int, int] = {}  # key -> the clock when the step freed it
        self.changed: set[int] = set()  # keys changed in place after
        self.watches: list[weakref.finalize] = []

    def made(self, new: dict[int, int]) -> None:
        """Note an op's new storages ``new`` (key -> bytes)."""
        self.born.update(dict.fromkeys(new, self.clock()))

    def watch(self, out: Any, keys: set[int]) -> None:
        """Note, in :attr:`freed`, when the storages of ``out`` with the keys ``keys`` are
        freed."""
        for _, t in iter_tensors(out):
            key = storage_key(t)
            if key in keys:
                keys.discard(key)
                watch = weakref.finalize(t.untyped_storage(), self._free, key)
                watch.atexit = False
                self.watches.append(watch)

    def _free(self, key: int) -> None:
        self.freed[key] = self.clock()

    def unwatch(self) -> None:
        """Stop watching the outputs still alive (the step is over: none outlives it holding
        the recording)."""
        for watch in self.watches:
            watch.detach()
        self.watches.clear()

    def changes(self, func: Any, args: Any, kwargs: Any) -> None:
        """Note the kept outputs that ``func`` writes to in place (``add_``, ``out=``)."""
        given = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs
        for a in func._schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write:
                written = {storage_key(t) for _, t in iter_tensors(given.get(a.name))}
                self.changed.update(self.born.keys() & written)

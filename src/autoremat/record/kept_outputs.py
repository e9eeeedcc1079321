"""The outputs of the ops a selective recompute keeps, as a recorded step makes them.

:class:`~autoremat.record.recording.OpCosts` notes each such output here, under an id of its
own (a storage's key, its address, can be taken by another storage once it is freed): when
it was made (the event clock), whether an op later wrote to it in place, and when the step,
recomputing nothing, freed it (a ``weakref.finalize`` on its storage).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

from autoremat.core.nested import iter_tensors, storage_key

__all__ = ["KeptOutputs"]


class KeptOutputs:
    """Kept outputs by id (module docstring); ``clock()`` is the recording's event count."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock = clock
        self.born: dict[int, int] = {}  # id -> the clock when it was made
        self.freed: dict[int, int] = {}  # id -> the clock when the step freed it
        self.changed: set[int] = set()  # ids changed in place after
        self.current: dict[int, int] = {}  # storage key -> the id of the output that has it
        self.ids = itertools.count()
        self.watches: list[weakref.finalize] = []

    def made(self, new: dict[int, int]) -> dict[int, int]:
        """Ids for an op's new storages ``new`` (key -> bytes), by key."""
        uids = {}
        for key in new:
            self.current[key] = uids[key] = uid = next(self.ids)
            self.born[uid] = self.clock()
        return uids

    def watch(self, out: Any, uids: dict[int, int]) -> None:
        """Note, in :attr:`freed`, when the storages of ``out`` with the ids ``uids`` (by key)
        are freed."""
        for _, t in iter_tensors(out):
            uid = uids.pop(storage_key(t), None)  # type: ignore[arg-type]
            if uid is not None:
                watch = weakref.finalize(t.untyped_storage(), self._free, uid)
                watch.atexit = False
                self.watches.append(watch)

    def _free(self, uid: int) -> None:
        self.freed[uid] = self.clock()

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
                for _, t in iter_tensors(given.get(a.name)):
                    uid = self.current.get(storage_key(t))  # type: ignore[arg-type]
                    if uid is not None:
                        self.changed.add(uid)

"""The garbage collector kept off the objects that existed before planning began.

Planning makes many objects (a step's records, the solver's states), so Python's collector
runs full collections meanwhile, and each scans every object of the process: the model, the
libraries, the user's data. On the Llama-70B shape on ``meta`` that was 4 full collections of
about 0.25 s each in a 6 s ``plan``. :func:`frozen` moves the objects that exist on entry to
the collector's permanent generation (:func:`gc.freeze`) and back on exit
(:func:`gc.unfreeze`): they are not garbage planning makes, and what planning makes is
collected as ever (a storage that a collection frees inside a measured step is counted freed
there, as before). A reference cycle among the frozen objects that becomes garbage meanwhile
is collected after the exit instead.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["frozen"]

# How many frozen() blocks are open (nested, or in other threads). Only the outermost asks
# gc.get_freeze_count(), which walks every frozen object (about 23 ms for 500,000).
_depth = 0


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Inside, the objects that existed on entry are frozen (module docstring). Only the
    outermost block freezes, and not when the program froze objects itself (those it never
    unfreezes)."""
    global _depth
    freeze = _depth == 0 and gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if freeze:
            gc.unfreeze()

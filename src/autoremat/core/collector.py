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


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Inside, the objects that existed on entry are frozen (module docstring). Does nothing
    when some objects are frozen already (by an outer :func:`frozen`, or by the program
    itself, whose frozen objects it then never unfreezes)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

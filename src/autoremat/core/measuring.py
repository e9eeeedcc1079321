"""Whether autoremat is running a step of the user's model to measure it.

Planning and measuring run the model's own step (its forward, loss and backward: the profile,
each plan's run, ``fit``'s steps, ``measure``), on the model itself or on a copy of it, so the
model's hooks run there too: a forward hook that changes an output must, or the step measured
would not be the step trained. A hook with side effects of its own (counting steps, logging,
gradient statistics) can ask :func:`is_measuring` and return early.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from autoremat.core.collector import frozen

__all__ = ["is_measuring", "measuring"]

# Not thread-local: on a GPU the backward (and so a backward hook) runs on autograd's own
# thread, which must see the flag too.
_depth = 0


def is_measuring() -> bool:
    """True while autoremat runs a step of the model for ``plan``, ``lowest_budget``,
    ``fit``, ``plan(device_memory=...)``, ``measure``, ``profile`` and their kin (module docstring);
    False in the user's own steps, recomputes included."""
    return _depth > 0


@contextlib.contextmanager
def measuring() -> Iterator[None]:
    """Inside, :func:`is_measuring` is True (nested: until the outermost exits), and the
    objects that existed on entry are frozen (:func:`autoremat.core.collector.frozen`)."""
    global _depth
    _depth += 1
    try:
        with frozen():
            yield
    finally:
        _depth -= 1

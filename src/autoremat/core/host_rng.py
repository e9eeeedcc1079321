"""The random generators outside torch that a forward may draw from: Python's ``random`` and
NumPy's global generator (when NumPy is imported). The recompute replays them
(:mod:`autoremat.wrap.replay`) and a failed call puts them back (:mod:`autoremat.record.snapshot`),
next to torch's own generators; :func:`generators_kept` puts back both."""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["HostRng", "generators_kept", "get_host_rng", "set_host_rng"]

# (Python's state, NumPy's state or None when NumPy was not imported)
HostRng = tuple[Any, Any]


def get_host_rng() -> HostRng:
    """Python's and (when imported) NumPy's global generator states."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), None if numpy is None else numpy.random.get_state()


def set_host_rng(states: HostRng) -> None:
    """Put back states from :func:`get_host_rng` (NumPy's only if it was imported then)."""
    python, numpy_state = states
    if python is not None:
        random.setstate(python)
    numpy = sys.modules.get("numpy")
    if numpy is not None and numpy_state is not None:
        numpy.random.set_state(numpy_state)


@contextlib.contextmanager
def generators_kept(cuda_devices: Iterable[int] = ()) -> Iterator[None]:
    """Run the block, then put back torch's CPU generator (and those of ``cuda_devices``),
    Python's and NumPy's, whatever the block drew or seeded, also when it raises."""
    host = get_host_rng()
    try:
        with torch.random.fork_rng(devices=list(cuda_devices)):
            yield
    finally:
        set_host_rng(host)

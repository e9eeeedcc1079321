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

__all__ = ["HostRng", "generators_kept", "get_host_rng", "passed_generators", "set_generators",
           "set_host_rng"]  # fmt: skip

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


def passed_generators(args: Iterable[Any], kwargs: dict[str, Any]) -> list[tuple[Any, Any]]:
    """``(generator, its state)`` for each random generator passed to a call, positionally or
    by keyword: torch's ``Generator``, Python's ``random.Random``, NumPy's ``Generator`` and
    ``RandomState`` (a forward that draws from one it is given: :mod:`autoremat.wrap.replay`)."""
    found = {id(v): v for v in (*args, *kwargs.values()) if _kind(v)}
    return [(g, _STATES[_kind(g)][0](g)) for g in found.values()]


def set_generators(states: Iterable[tuple[Any, Any]]) -> None:
    """Put each generator back in its state, as :func:`passed_generators` gave them."""
    for g, state in states:
        _STATES[_kind(g)][1](g, state)


# a generator's kind -> how its state is read and set
_STATES: dict[str, tuple[Any, Any]] = {
    "torch": (torch.Generator.get_state, torch.Generator.set_state),
    "python": (random.Random.getstate, random.Random.setstate),
    "numpy": (lambda g: g.bit_generator.state, lambda g, s: setattr(g.bit_generator, "state", s)),
    "numpy legacy": (lambda g: g.get_state(), lambda g, s: g.set_state(s)),
}


def _kind(value: Any) -> str:
    """Which of :data:`_STATES` ``value`` is, ``""`` for no generator."""
    if isinstance(value, torch.Generator):
        return "torch"
    if isinstance(value, random.Random):
        return "python"
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.random.Generator):
        return "numpy"
    legacy = numpy is not None and isinstance(value, numpy.random.RandomState)
    return "numpy legacy" if legacy else ""


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

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

__all__ = ["HostRng", "generator_state", "generators_kept", "get_host_rng", "passed_generators",
           "set_generators", "set_host_rng"]  # fmt: skip

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


def generator_state(value: Any) -> Any:
    """The state of a random generator (torch's ``Generator``, Python's ``random.Random``,
    NumPy's ``Generator``, ``RandomState`` or bit generator) as :func:`set_generators` takes
    it back; ``None`` for anything else."""
    if isinstance(value, torch.Generator):
        return value.get_state()
    if isinstance(value, random.Random):
        return value.getstate()
    if type(value).__module__.startswith("numpy.random"):
        if hasattr(value, "bit_generator"):
            return value.bit_generator.state
        if hasattr(value, "get_state"):
            return value.get_state(legacy=False)
        if hasattr(value, "random_raw"):  # (a bit generator; not a SeedSequence, which is fixed)
            return value.state
    return None


def passed_generators(args: Iterable[Any], kwargs: dict[str, Any]) -> list[tuple[Any, Any]]:
    """``(generator, its state)`` for each random generator (:func:`generator_state`) passed
    to a call, positionally or by keyword (a forward that draws from one it is given:
    :mod:`autoremat.wrap.replay`)."""
    found = {id(v): v for v in (*args, *kwargs.values())}
    return [(g, state) for g in found.values() if (state := generator_state(g)) is not None]


def set_generators(states: Iterable[tuple[Any, Any]]) -> None:
    """Put each generator back in its state, as :func:`passed_generators` gave them."""
    for g, state in states:
        if isinstance(g, torch.Generator):
            g.set_state(state)
        elif isinstance(g, random.Random):
            g.setstate(state)
        elif hasattr(g, "bit_generator"):
            g.bit_generator.state = state
        elif hasattr(g, "set_state"):
            g.set_state(state)
        else:
            g.state = state


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

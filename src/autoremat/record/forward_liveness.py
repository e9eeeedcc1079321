"""When each storage a forward makes would die if nothing were saved for backward.

A checkpointed forward keeps none of what its ops save: a tensor made inside it lives only as
long as the module's own code refers to it (a local variable rebound, the last op that reads
it, the call returning). The recorded step cannot show that, since autograd holds what it
saved. :func:`forward_deaths` runs the forward once more with every saved tensor dropped (a
``saved_tensors_hooks`` pair that keeps nothing, no backward) and notes, for each new storage
in the order the ops made it, after which module event (start or end) it adds to no moment's
peak: how many had happened when it died, or, when no op made a storage between the last end
and its death, that end (what was live then bounds every moment up to the death, and that end
sees it alive); and the event whose stretch is the first in which keeping it alive would
raise the most live bytes: the one it died in, or the next when no op made a storage between
its death and that event. The recorded step makes the same storages in the same order
(:func:`new_storages` names them alike), so the two line up by position.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autoremat.core.nested import iter_tensors, run_model, storage_key

__all__ = ["Death", "ForwardDeaths", "deaths_by_key", "forward_deaths", "new_storages"]

# (key, bytes) of each new storage in the order made; its position -> the index of the module
# event after which it adds to no moment's peak, and of the event whose stretch is the first
# in which keeping it alive raises the most live bytes (:class:`Death`)
ForwardDeaths = tuple[list[tuple[int, int]], dict[int, "Death"]]
Death = tuple[int, int]  # (gone after, costs from)


def new_storages(seen: set[int | None], out: Any) -> dict[int, int]:
    """The storages an op's outputs hold that its inputs (``seen``: their storage keys) did
    not: key -> bytes, in order."""
    new: dict[int, int] = {}
    for _, t in iter_tensors(out):
        key = storage_key(t)
        if key is not None and key not in seen and key not in new:
            new[key] = t.untyped_storage().nbytes()
    return new


class _Deaths(TorchDispatchMode):
    """Notes each new storage (its key, in order) and the event after which it adds to no
    moment's peak (module docstring); :meth:`tick` counts the events."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = 0
        self.order: list[tuple[int, int]] = []
        self.died: dict[int, Death] = {}
        self.watching = True
        self._refs: list[weakref.ref[Any]] = []
        self._last_end: tuple[int, int] | None = None  # (its event index, storages made by then)
        self._pending: list[tuple[int, int]] = []  # (position, storages made when it died)

    def tick(self, end: bool) -> None:
        for index, made in self._pending:  # no op made a storage since it died: the rest of
            if made == len(self.order):  # the stretch holds no more than its death did
                self.died[index] = (self.died[index][0], self.clock + 1)
        self._pending.clear()
        if end:
            self._last_end = (self.clock, len(self.order))
        self.clock += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        storages = {storage_key(t): t.untyped_storage() for _, t in iter_tensors(out)}
        seen = {storage_key(t) for _, t in iter_tensors((args, kwargs))}
        for key, size in new_storages(seen, out).items():
            self._refs.append(weakref.ref(storages[key], self._dead(len(self.order))))
            self.order.append((key, size))
        return out

    def _dead(self, index: int) -> Callable[[Any], None]:
        def dead(_ref: Any) -> None:
            if not self.watching:
                return
            quiet = self._last_end is not None and self._last_end[1] == len(self.order)
            gone = self._last_end[0] if quiet and self._last_end else self.clock
            self.died[index] = (gone, self.clock)
            self._pending.append((index, len(self.order)))

        return dead


def forward_deaths(
    model: nn.Module,
    args: Any,
    kwargs: dict[str, Any] | None,
    modules: Iterable[nn.Module],
    autocast_context: Any,
) -> ForwardDeaths:
    """The forward of ``model`` with nothing saved for backward (module docstring): the keys and
    bytes of the storages its ops made, in order, and for those that died before it returned,
    the index among the starts and ends of ``modules`` of the event after which each adds to
    no moment's peak (module docstring). ``autocast_context``: the context the recorded step's
    forward runs in. The caller puts the model's state back."""
    deaths = _Deaths()
    handles = []
    for m in modules:
        handles.append(m.register_forward_pre_hook(lambda *_: deaths.tick(end=False)))
        handles.append(m.register_forward_hook(lambda *_: deaths.tick(end=True)))
    nothing = torch.autograd.graph.saved_tensors_hooks(_drop, _never)
    try:
        with torch.enable_grad(), autocast_context, nothing, deaths:
            output = run_model(model, args, kwargs)
            deaths.watching = False
        del output
    finally:
        for h in handles:
            h.remove()
    return deaths.order, deaths.died


def _drop(_t: torch.Tensor) -> None:
    return None


def _never(_packed: None) -> torch.Tensor:
    raise RuntimeError("forward_deaths runs no backward")


def deaths_by_key(
    recorded: list[tuple[int, int]], made_at: dict[int, list[int]], found: ForwardDeaths
) -> dict[int, list[tuple[int, Death | None]]]:
    """For the recorded step's storages (``recorded``: key and bytes of each new storage, in
    order; ``made_at``: the clock of each birth per key, in order), per key each storage's
    ``(birth clock, death)`` in the forward of ``found`` (:data:`Death`), ``None`` for one that
    lived on; empty when the two did not make the same storages (by bytes, in order: the
    forward took another path)."""
    order, died = found
    if [size for _, size in recorded[: len(order)]] != [size for _, size in order]:
        return {}
    lives: dict[int, list[tuple[int, Death | None]]] = {}
    for i, (key, _) in enumerate(recorded[: len(order)]):
        had = lives.setdefault(key, [])
        had.append((made_at[key][len(had)], died.get(i)))
    return lives

"""The step's moments, collected from a plan's run: what the picture draws.

:func:`trace_step` runs a plan's step the way :meth:`~autoremat.planning.rehearsal.Rehearsal.peak`
runs it for :attr:`autoremat.Plan.estimated_peak` (the same rehearsal, the same tracker, with
its ``trace`` on), and labels every op the step runs (a *moment*) with where the step was:

* the **phase**: ``"forward"``, ``"loss"`` (after the model's forward, before backward),
  ``"backward"`` or ``"recompute"`` (a checkpoint's forward run again in backward, with the
  plan **entry** it recomputes, :func:`autoremat.wrap.replay.recomputing`);
* the **module** being run: in forward and recompute the innermost module whose forward is
  running (forward hooks); in backward the module whose output's autograd node ran last (each
  module's forward tags its outputs' nodes, ``grad_fn.metadata``: nothing more is kept alive).

Each moment holds the most bytes live during it and at its end, from the tracker's events, so
the highest moment is the tracker's peak: the plan's own figure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autoremat.core.entries import module_of
from autoremat.core.nested import iter_tensors
from autoremat.planning.rehearsal import PlanFields, Rehearsal
from autoremat.record.memory import LiveMemory
from autoremat.wrap.replay import recomputing

__all__ = ["PHASES", "Moment", "StepTrace", "moments_of", "trace_step"]

# The phases of a step, in the order they begin.
PHASES = ("forward", "loss", "backward", "recompute")
# the key a module's forward leaves in its outputs' autograd nodes' metadata
_TAG = "autoremat.picture.module"


@dataclass(frozen=True)
class Moment:
    """One op of the step: the most bytes live while it ran (``high``) and after it
    (``live``), the module being run (``path``, ``""``: the model itself, or none), the
    ``phase`` (:data:`PHASES`) and, in a recompute, the plan ``entry`` recomputed."""

    high: int
    live: int
    path: str
    phase: str
    entry: str = ""


@dataclass(frozen=True)
class StepTrace:
    """A step's moments, its ``peak`` (the tracker's, the highest moment's ``high``) and
    ``how`` it ran (:attr:`~autoremat.planning.rehearsal.Rehearsal.how`)."""

    moments: tuple[Moment, ...]
    peak: int
    how: str

    @property
    def peak_at(self) -> int:
        """The index of the first moment at the peak."""
        return next((k for k, m in enumerate(self.moments) if m.high == self.peak), 0)


def trace_step(rehearsal: Rehearsal, plan: PlanFields) -> StepTrace:
    """``plan``'s step run by ``rehearsal`` (as its :meth:`~Rehearsal.peak` runs it), traced.

    Raises:
        RuntimeError: the traced run's peak is not its tracker's (a bug: the moments lost an
            event).
    """
    watcher: list[_Watcher] = []

    @contextlib.contextmanager
    def watch(model: nn.Module, tracker: LiveMemory) -> Iterator[None]:
        watcher.append(_Watcher(model, tracker))
        with watcher[0].hooked(), watcher[0]:
            yield

    tracked = rehearsal.traced(plan, watch)
    moments = moments_of(tracked.events, watcher[0].labels)
    high = max((m.high for m in moments), default=0)
    if high != tracked.peak:
        raise RuntimeError(
            f"the traced step's moments peak at {high} bytes and its tracker at {tracked.peak}: "
            f"report this as a bug of autoremat.picture"
        )
    return StepTrace(tuple(moments), tracked.peak, rehearsal.how)


def moments_of(
    events: list[tuple[str, int, int]], labels: list[tuple[int, str, str, str]]
) -> list[Moment]:
    """The moments of a step whose tracker recorded ``events`` (``(op, delta, live after)``)
    and whose ops began at the ``labels``' event indexes (``(index, path, phase, entry)``):
    each moment's events are those from its index to the next one's (those before the first
    op, the first's)."""
    moments: list[Moment] = []
    live = 0
    for k, (start, path, phase, entry) in enumerate(labels):
        first = 0 if k == 0 else start
        end = labels[k + 1][0] if k + 1 < len(labels) else len(events)
        high = live
        for _, _, now in events[first:end]:
            high, live = max(high, now), now
        moments.append(Moment(high, live, path, phase, entry))
    return moments


class _Watcher(TorchDispatchMode):
    """Labels each op of a step with where it ran (module docstring), by the index of the
    tracker's next event."""

    def __init__(self, model: nn.Module, tracker: LiveMemory) -> None:
        super().__init__()
        self.model, self.tracker = model, tracker
        self.labels: list[tuple[int, str, str, str]] = []
        self.stack: list[str] = []
        self.forward_done = False
        self.last = ""  # the module whose autograd node ran last in backward

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.labels.append((len(self.tracker.events), *self._where()))
        return func(*args, **(kwargs or {}))

    def _where(self) -> tuple[str, str, str]:
        """(module path, phase, entry) of the op about to run."""
        entry = recomputing()
        if entry is not None:
            return (self.stack[-1] if self.stack else module_of(entry)), "recompute", entry
        node = torch._C._current_autograd_node()
        if node is not None:
            self.last = _metadata(node).get(_TAG, self.last)
            return self.last, "backward", ""
        if self.forward_done:
            return "", "loss", ""
        return (self.stack[-1] if self.stack else ""), "forward", ""

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        """Forward hooks on every module of the model, removed after the block."""
        handles = []
        for path, module in self.model.named_modules():
            handles.append(module.register_forward_pre_hook(self._entered(path)))
            handles.append(module.register_forward_hook(self._left(path), always_call=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _entered(self, path: str) -> Any:
        def pre(_module: nn.Module, _args: Any) -> None:
            self.stack.append(path)

        return pre

    def _left(self, path: str) -> Any:
        def post(_module: nn.Module, _args: Any, output: Any) -> None:
            if self.stack and self.stack[-1] == path:
                self.stack.pop()
            if recomputing() is None:
                for _, t in iter_tensors(output):
                    node = t.grad_fn
                    if node is not None and _TAG not in _metadata(node):
                        _metadata(node)[_TAG] = path
            if path == "" and recomputing() is None:
                self.forward_done = True

        return post


def _metadata(node: Any) -> dict[str, Any]:
    """An autograd node's ``metadata`` dict (an attribute at run time; typed as a method)."""
    found = node.metadata
    return found() if callable(found) else found

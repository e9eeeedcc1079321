"""Recomputing some calls of a module: which calls, counted afresh in each forward.

A plan entry ``path@k`` (:mod:`autoremat.core.entries`) recomputes only the ``k``-th call of the
module at ``path`` in one forward of the model (a shared layer applied at every depth, a cell
stepped in a loop). The wrap gives such a module a :class:`ChosenCalls`: the calls chosen, each
with its selective ``context_fn`` or ``None`` (recomputed whole), and how many calls the
profile saw. A :class:`NewStep` pre-hook on the model sets every count back to 0 when the model's
forward begins, so call ``k`` is the same call in every step.

Every call counts, with gradients or without; a recompute counts nothing: the calls made inside
a recomputed module are told, in order, what they did in its forward
(:func:`autoremat.wrap.replay.decided`), so nested checkpoints replay exactly.

Under ``torch.compile`` the choice is made once, when dynamo traces the forward: counting and
restarting run there, outside the traced code (``torch._dynamo.assume_constant_result``), and
the graph holds a checkpoint region for each chosen call. Dynamo refuses a change to an
outside object inside a checkpoint region, where a call of a module inside a recomputed call
of another would otherwise be counted; and the compiled step itself counts nothing.

A step ends, and the counts restart, when the model's forward begins (the pre-hook) or when
backward reaches the first call of the step (a model trained through another method than
``forward``, a submodule called directly).

**A step with another number of calls** (a loop whose length follows the input): the calls the
plan names are recomputed, the others run as usual, so training stays exact; only memory
differs from the plan's prediction. A training step (one with gradients) with more calls than
profiled warns when the call past them runs; one with fewer, or that did not reach a call the
plan names, when the step ends. Each such count warns once per module, naming it, the counts
and the fix: plan on inputs with the longest loop, or name the module without a call index
(every call recomputed, however many). Forwards without gradients (evaluation) warn nothing.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from autoremat.core.classes import Hook, pickle_as_plain, stop_pickling_as_plain
from autoremat.wrap.replay import decided

__all__ = [
    "ATTR",
    "PLAIN",
    "ChosenCalls",
    "NewStep",
    "add_new_step_hook",
    "chosen_calls",
    "remove_new_step_hooks",
]

# What a call not chosen gets from ChosenCalls.take: run without recompute.
PLAIN = "plain"
# the instance attribute of a wrapped module that holds its ChosenCalls
ATTR = "_autoremat_calls"


class ChosenCalls:
    """The chosen calls of the module at ``path``: call index -> its ``context_fn`` (``None``:
    recomputed whole); ``profiled``: the calls the profile saw (``None``: unknown)."""

    def __init__(self, path: str, chosen: dict[int, Any], profiled: int | None) -> None:
        self.path = path
        self.chosen = chosen
        self.profiled = profiled
        self.count = 0
        self.training = False  # a call of this step ran with gradients enabled
        self.warned: set[Any] = set()  # the counts warned about ("more": more than profiled)
        _LIVE[id(self)] = self

    def __deepcopy__(self, memo: dict[int, Any]) -> ChosenCalls:
        copied = ChosenCalls(self.path, copy.deepcopy(self.chosen, memo), self.profiled)
        copied.count, copied.training = self.count, self.training
        copied.warned = set(self.warned)
        return copied

    def take(self) -> tuple[int, Any]:
        """This call's index and ``context_fn`` (``None``: whole, :data:`PLAIN`: not chosen);
        in a recompute, what the same call had in the forward."""
        compiling = torch.compiler.is_compiling()
        k = _advance_untraced(id(self)) if compiling else decided(self.advance)
        return k, self.chosen.get(k, PLAIN)

    def advance(self) -> int:
        """The index of this call; the count moves on. The first call of a step with gradients
        also arranges for the count to restart when backward reaches it (the step is over,
        however the model was called: :class:`NewStep` only sees ``model(...)``)."""
        k = self.count
        self.count += 1
        self.training = self.training or torch.is_grad_enabled()
        if self.training and self.profiled is not None and k == self.profiled:
            self._warn("more", f"more than the {self.profiled}")
        return k

    def started(self, k: int, out: Any) -> None:
        """Call ``k`` returned ``out``: for call 0 with gradients, restart the count when
        backward reaches it (after the later calls' backward, before the next step)."""
        needs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if k == 0 and needs and not torch.compiler.is_compiling():
            register_multi_grad_hook(needs, self._backward_reached, mode="any")

    def _backward_reached(self, grads: Any) -> None:
        self.new_step()

    def new_step(self) -> None:
        """A step is over (its backward reached call 0, or the model's forward begins): count
        from 0. Warns when a training step made fewer calls than profiled, or did not reach a
        call the plan names."""
        count, training = self.count, self.training
        self.count, self.training = 0, False
        if not training or count == 0:
            return
        if self.profiled is not None and count < self.profiled:
            self._warn(count, f"{count} instead of the {self.profiled}")
        elif max(self.chosen, default=-1) >= count:
            self._warn(count, f"{count}, fewer than the plan's call @{max(self.chosen)} needs of")

    def _warn(self, key: Any, how_many: str) -> None:
        if key in self.warned:
            return
        self.warned.add(key)
        named = ", ".join(f"@{k}" for k in sorted(self.chosen)[:8])
        warnings.warn(
            f"autoremat: module {self.path or '(root)'!r} ran {how_many} calls the plan was "
            f"made for in one training step (a loop of another length?). The calls the plan "
            f"names ({named}{' ...' if len(self.chosen) > 8 else ''}) are recomputed and the "
            f"others run as usual: training is exact, but memory differs from the plan's "
            f"prediction. Fix: plan on inputs with the longest loop, or name {self.path!r} "
            f"without a call index in the plan to recompute every call.",
            stacklevel=5,
        )


# every ChosenCalls alive, by id (for the untraced functions below, which take constants)
_LIVE: weakref.WeakValueDictionary[int, ChosenCalls] = weakref.WeakValueDictionary()


def _constant_under_dynamo(fn: Any) -> Any:
    """``torch._dynamo.assume_constant_result``, which does only this, without importing dynamo
    (0.6 s) with autoremat: dynamo calls ``fn`` when tracing and keeps its result as a constant."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_under_dynamo
def _advance_untraced(key: int) -> int:
    """:meth:`ChosenCalls.advance` of the one with id ``key``, run when dynamo traces."""
    return _LIVE[key].advance()


@_constant_under_dynamo
def _new_step_untraced(key: int) -> int:
    """:meth:`ChosenCalls.new_step` of the one with id ``key``, run when dynamo traces."""
    _LIVE[key].new_step()
    return 0


class NewStep(Hook):
    """The model's forward pre-hook that starts every :class:`ChosenCalls` in it afresh."""

    def __call__(self, model: nn.Module, args: Any) -> None:
        compiling = torch.compiler.is_compiling()
        for m in model.modules():
            chosen = m.__dict__.get(ATTR)
            if chosen is not None and compiling:
                _new_step_untraced(id(chosen))
            elif chosen is not None:
                chosen.new_step()


def chosen_calls(module: nn.Module) -> ChosenCalls | None:
    """The :class:`ChosenCalls` the wrap gave ``module``, if any."""
    return module.__dict__.get(ATTR)


def add_new_step_hook(model: nn.Module) -> None:
    """Register :class:`NewStep` on ``model`` unless it has one (a deep copy carries it); the
    model pickles without it (:func:`autoremat.core.classes.pickle_as_plain`)."""
    if not any(isinstance(h, NewStep) for h in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(NewStep())
        pickle_as_plain(model)


def remove_new_step_hooks(model: nn.Module) -> None:
    """Take every :class:`NewStep` off the modules of ``model``."""
    for m in model.modules():
        found = [i for i, h in m._forward_pre_hooks.items() if isinstance(h, NewStep)]
        for i in found:
            del m._forward_pre_hooks[i]
        others = any(isinstance(h, Hook) for h in m._forward_pre_hooks.values())
        if found and not others:
            stop_pickling_as_plain(m)

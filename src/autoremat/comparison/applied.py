"""What a contender of a comparison is, and what it makes of a model: a :class:`Contender`
turns a fresh deep copy of the model into the model to train and says what it did in an
:class:`Applied` (with a :class:`CompileInfo` for a compiled model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from autoremat.planning.plans import Plan

__all__ = [
    "BASELINE",
    "Applied",
    "Args",
    "CompileInfo",
    "Contender",
    "Kwargs",
    "MiB",
    "as_applied",
]

MiB = 2**20
BASELINE = "none"  # the name of the baseline contender; every ratio is relative to its row

Args = tuple[Any, ...]
Kwargs = dict[str, Any]


@dataclass
class CompileInfo:
    """What compiling one model took and made.

    Attributes:
        budget: the ``activation_memory_budget`` it was compiled under.
        graphs: graphs inductor compiled so far (forward and backward count one each).
        flops: FLOPs of those graphs (:func:`graph_flops`); ``None`` once a graph could not be
            counted.
        compile_seconds: the warm-up step, cold compile included.
        calls_after_warmup: ``graphs`` after the warm-up step; more later means it recompiled.
        warm_flops: ``flops`` after the warm-up step: the FLOPs of one step.
    """

    budget: float
    graphs: int = 0
    flops: int | None = 0
    compile_seconds: float = 0.0
    calls_after_warmup: int = 0
    warm_flops: int | None = None


@dataclass
class Applied:
    """What a contender made of the model.

    Attributes:
        model: the model to run: the copy it received, changed in place, or a module wrapping
            it (:class:`SqrtSegments`, a compiled module).
        note: what the row's note says first; ``None``: the modules wrapped, if any
            (:func:`describe_paths`).
        plan: the :class:`autoremat.Plan` applied, for contenders that plan.
        predicted_peak: the plan's predicted step peak in bytes; the row's note gives it with
            its error against the measured peak.
        compile_info: set for a model compiled by ``torch.compile``
            (:func:`autoremat.comparison.compiled`): such a model is measured differently.
    """

    model: nn.Module
    note: str | None = None
    plan: Plan | None = None
    predicted_peak: int | None = None
    compile_info: CompileInfo | None = None


@dataclass
class Contender:
    """A way to train a model with less activation memory.

    ``apply(model, args, kwargs)`` receives a fresh deep copy of the model and returns an
    :class:`Applied` (a bare module is taken as ``Applied(module)``), or ``None`` when the
    contender does not apply to this model (its row is then left out). It may raise: the row
    then has no figures and the error in its note.

    ``dedupe``: a contender with ``dedupe=True`` that wraps exactly the same set of modules as
    an earlier row is dropped (the kept row's note names it).
    """

    name: str
    apply: Callable[[nn.Module, Args, Kwargs], Applied | nn.Module | None]
    dedupe: bool = False


def as_applied(result: Applied | nn.Module | None) -> Applied | None:
    """What ``Contender.apply`` returned, as an :class:`Applied` (``None`` stays ``None``)."""
    if result is None or isinstance(result, Applied):
        return result
    return Applied(result)



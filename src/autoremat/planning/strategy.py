"""What a strategy is: how the modules to recompute are chosen.

A :class:`Strategy` names itself (as :attr:`autoremat.Plan.strategy` and the JSON do), the
keyword of :func:`autoremat.plan` that selects it, what it needs of the model (the module tree,
or a profile of one training step), a check of its request that runs before the model does
(and returns the request with its keywords parsed), and ``choose``: a function from that
evidence and the request to the plan's fields. ``choose`` is pure planning: it reads, it
neither runs the model nor wraps anything nor logs (the planner does; what a strategy has to
say goes into the plan's ``warnings``). Adding one: :mod:`autoremat.planning.strategies`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from autoremat.core.sizes import Budget
from autoremat.record.step import LossFn

__all__ = ["Request", "Strategy", "left_out_warning"]


@dataclass(frozen=True)
class Request:
    """What :func:`autoremat.plan` was asked, the same for every strategy: ``model_name``
    (the model's class name, for messages), and each strategy's keywords."""

    model_name: str
    segments: int | None = None
    budget: int | float | str | Budget | None = None
    loss_fn: LossFn | None = None
    selective: bool = True
    objective: str = "time"
    autocast: Any = None  # as autoremat.profile takes it
    # what runs a budget plan's step (a Rehearsal); None: the profile's own step
    rehearsal: Any = None


@dataclass(frozen=True)
class Strategy:
    """One way to choose a plan (module docstring). ``choose(evidence, request)`` returns
    keyword arguments for :class:`autoremat.Plan` (at least ``modules``)."""

    name: str
    keyword: str
    needs: Literal["tree", "profile"]
    check: Callable[[Request], Request]
    choose: Callable[[Any, Request], dict[str, Any]]


def left_out_warning(left_out: dict[str, str], model_name: str, shown: int = 5) -> str | None:
    """The warning naming the modules a strategy left out of its plan (``left_out``: path ->
    reason; the first ``shown`` of them with their reasons); ``None`` when there are none."""
    if not left_out:
        return None
    return (
        f"{len(left_out)} module(s) of {model_name} cannot be recomputed on their own and were "
        f"left out of the plan (modules inside or around them can still be chosen): "
        + "; ".join(f"{p!r}: {why}" for p, why in list(left_out.items())[:shown])
        + (" ..." if len(left_out) > shown else "")
    )

"""Strategies: how the modules to recompute are chosen. Each is one registry entry.

A :class:`Strategy` names itself (as :attr:`autoremat.Plan.strategy` and the JSON do), the
keyword of :func:`autoremat.plan` that selects it, what it needs of the model (the module tree,
or a profile of one training step), a check of its request that runs before the model does
(and returns the request with its keywords parsed),
and ``choose``: a function from that evidence and the request to the plan's fields. ``choose``
is pure planning: it reads, it does not run the model or wrap anything (the planner does).

Adding a strategy is one file in this package that defines a ``STRATEGY`` and one line in
:data:`STRATEGIES`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from autoremat.sizes import Budget
from autoremat.step import LossFn

__all__ = ["STRATEGIES", "Request", "Strategy", "log_left_out"]

logger = logging.getLogger("autoremat")


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


@dataclass(frozen=True)
class Strategy:
    """One way to choose a plan (see the package docstring). ``choose(evidence, request)``
    returns keyword arguments for :class:`autoremat.Plan` (at least ``modules``)."""

    name: str
    keyword: str
    needs: Literal["tree", "profile"]
    check: Callable[[Request], Request]
    choose: Callable[[Any, Request], dict[str, Any]]


def log_left_out(left_out: dict[str, str], model_name: str, shown: int = 5) -> None:
    """One warning on the ``autoremat`` logger naming the modules a strategy left out of its
    plan (``left_out``: path -> reason; the first ``shown`` of them with their reasons);
    nothing when there are none."""
    if not left_out:
        return
    logger.warning(
        "%d module(s) of %s cannot be recomputed on their own and were left out of the "
        "plan (modules inside or around them can still be chosen): %s",
        len(left_out),
        model_name,
        "; ".join(f"{p!r}: {why}" for p, why in list(left_out.items())[:shown])
        + (" ..." if len(left_out) > shown else ""),
    )


def _registry() -> dict[str, Strategy]:
    from autoremat.strategies import budget, levels

    return {s.keyword: s for s in (levels.STRATEGY, budget.STRATEGY)}


# plan() keyword -> strategy; the first is the default when no keyword is given
STRATEGIES: dict[str, Strategy] = _registry()

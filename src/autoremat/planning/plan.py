"""Making a plan of the activations (:func:`autoremat.plan` calls it for a budget or segments):
:func:`activation_plan` checks the request, runs the model once for what the chosen strategy
needs and lets it choose; :func:`lowest_budget` says the least a budget may be."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

from autoremat.core.nested import parameter_bytes
from autoremat.costs.profile import Profile, profile
from autoremat.planning.fingerprint import fingerprint, structure
from autoremat.planning.plans import Plan
from autoremat.planning.rehearsal import Rehearsal
from autoremat.planning.search import Judge
from autoremat.planning.strategies import budget as budget_strategy
from autoremat.planning.strategies import levels as levels_strategy
from autoremat.planning.strategy import Request, Strategy
from autoremat.record.compiled import running_eagerly
from autoremat.record.step import LossFn
from autoremat.record.tree import Node, build_tree

__all__ = [
    "STRATEGIES",
    "activation_plan",
    "lowest_budget",
    "plan_from_profile",
    "planned",
    "profile_lowest",
]

# plan() keyword -> strategy (one line per strategy)
STRATEGIES: dict[str, Strategy] = {
    s.keyword: s for s in (levels_strategy.STRATEGY, budget_strategy.STRATEGY)
}


def activation_plan(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    segments: int | None = None,
    budget: int | float | str | None = None,
    loss_fn: LossFn | None = None,
    selective: bool = True,
    objective: str = "time",
    autocast: Any = None,
    rehearsal: Any = None,
) -> Plan:
    """Choose the modules of ``model`` to recompute, as :func:`autoremat.plan` says for
    ``segments`` (default 3 when no budget is given: the levels strategy,
    :func:`~autoremat.planning.strategies.levels.choose_levels`) and ``budget`` (the budget
    strategy, :mod:`autoremat.planning.strategies.budget`, from a profile of one training step),
    the other keywords as it takes them; ``rehearsal`` runs each budget plan's step (a
    :class:`~autoremat.planning.compiled_plan.CompiledRehearsal`; ``None``: the profiled step).
    The model is left as found; what the strategy has to say is in :attr:`Plan.warnings`.

    Raises:
        ValueError: ``segments`` negative; a malformed or non-positive budget (the message
            lists the accepted forms); a budget below the lowest peak any plan reaches
            (:class:`autoremat.BudgetTooLow`, whose ``lowest`` is that peak); no submodule ran.
        TypeError: ``segments`` not an int, ``budget`` of another type, or ``model`` not an
            ``nn.Module``.
        ExampleInputsError: (a ValueError) the example inputs fail in forward; the message
            names the module.
    """
    name = type(model).__name__
    if budget is None and segments is None:
        segments = levels_strategy.DEFAULT_SEGMENTS
    strategy = STRATEGIES["segments" if budget is None else "budget"]
    request = Request(name, segments, budget, loss_fn, selective, objective, autocast, rehearsal)
    request = strategy.check(request)
    evidence, tree = _evidence(strategy, model, args, kwargs, request)
    return _made(model, strategy.name, tree, strategy.choose(evidence, request))


def _made(model: nn.Module, strategy: str, tree: Node | None, fields: dict[str, Any]) -> Plan:
    """The plan of ``strategy`` for ``model``, with its structure and ``fields``."""
    return Plan(
        strategy=strategy,
        model_class=type(model).__name__,
        fingerprint=fingerprint(model),
        structure=structure(model),
        parameter_bytes=parameter_bytes(model),
        tree=tree,
        **fields,
    )


def _evidence(
    strategy: Strategy, model: nn.Module, args: Any, kwargs: Any, request: Request
) -> tuple[Any, Node]:
    """What ``strategy`` needs of the model (its tree, or a profile), and the tree. A compiled
    model runs eagerly meanwhile (:mod:`autoremat.record.compiled`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found: Any
    with running_eagerly(model):
        if strategy.needs == "profile":
            found = profile(model, args, kwargs, loss_fn=request.loss_fn, autocast=request.autocast)
            tree = found.module_tree
        else:
            found = tree = build_tree(model, args, kwargs)
    assert tree is not None, "profile() sets it"
    if tree.is_leaf:
        raise ValueError(
            f"{type(model).__name__} has no submodules that ran on the example inputs: there "
            f"is nothing to recompute; wrap it in a model with submodules, or check the inputs"
        )
    return found, tree


def plan_from_profile(
    model: nn.Module,
    prof: Profile,
    budget: int | float | str,
    *,
    selective: bool = True,
    objective: str = "time",
    rehearsal: Rehearsal | None = None,
) -> Plan:
    """The budget plan :func:`activation_plan` would make for ``model`` from ``prof``, a
    profile of it (or of a copy of it of the same structure, such as one on ``meta``): the
    model is not run again (plans are run on a shadow of the profiled step, or by ``rehearsal``:
    :mod:`autoremat.planning.rehearsal`).

    Raises:
        BudgetTooLow, ValueError: as :func:`activation_plan`.
    """
    request = Request(type(model).__name__, None, budget, None, selective, objective)
    request = budget_strategy.STRATEGY.check(dataclasses.replace(request, rehearsal=rehearsal))
    return _made(model, "budget", prof.module_tree, budget_strategy.STRATEGY.choose(prof, request))


def planned(model: nn.Module, planner: budget_strategy.Planner, limit: int,
            judge: Judge | None = None, too_low: Callable[[], Exception] | None = None,
            ) -> Plan:  # fmt: skip
    """The cheapest plan ``planner`` finds for ``model`` whose step peaks at most ``limit``,
    or that ``judge`` says fits (:meth:`~autoremat.planning.strategies.budget.Planner.cheapest`:
    a whole step on a device, a rank's), its budget ``limit``.

    Raises:
        BudgetTooLow: none does (or ``too_low()``, when given).
    """
    return _made(model, "budget", planner.prof.module_tree, planner.fields(limit, judge, too_low))


def profile_lowest(prof: Profile, *, selective: bool = True, objective: str = "time",
                   rehearsal: Rehearsal | None = None) -> int:  # fmt: skip
    """:func:`lowest_budget` from ``prof``, a profile already made (plans run as
    :func:`plan_from_profile` runs them)."""
    request = Request("model", None, 1, None, selective, objective, rehearsal=rehearsal)
    planner = budget_strategy.Planner(prof, budget_strategy.STRATEGY.check(request), rehearsal)
    return planner.lowest()[1]


def lowest_budget(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: LossFn | None = None,
    selective: bool = True,
    objective: str = "time",
    autocast: Any = None,
) -> int:
    """The lowest budget, in bytes, that :func:`autoremat.plan` meets for this model and inputs: the
    lowest step peak among the plans the planner makes (each run: the walk's lowest plan,
    every block and every block's children recomputed: blocks of one class, and the layers of
    one container), the same figure an infeasible budget's error states. A plan at it holds; a
    budget below it raises :class:`~autoremat.BudgetTooLow`. Profiles one training step; the
    model is left as found.

    Raises:
        ValueError: no submodule ran, or ``objective`` is unknown; see :func:`activation_plan`.
    """
    request = Request(type(model).__name__, None, 1, loss_fn, selective, objective, autocast)
    request = budget_strategy.STRATEGY.check(request)
    prof, _ = _evidence(budget_strategy.STRATEGY, model, args, kwargs, request)
    return budget_strategy.Planner(prof, request).lowest()[1]

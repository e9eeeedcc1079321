"""Choosing the modules to recompute: a :class:`Plan`, made by :func:`plan`.

Two strategies: ``levels`` (claims 2-3 of the method, a preset count of split points, from the
tree alone) and ``budget`` (the cheapest recompute whose predicted step peak fits a memory
budget, from a profile of the step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoremat import wrap
from autoremat.profile import Profile, profile
from autoremat.strategies.budget import (
    Infeasible,
    Item,
    min_peak,
    parse_budget,
    predict_peak,
    solve,
)
from autoremat.strategies.levels import choose_levels
from autoremat.tree import Node, build_tree

_MiB = 2**20
# Bytes a budget plan keeps free below the budget for what the cost model does not see: the
# recompute's copies of small buffers and statistics, measured at up to a few hundred bytes.
HEADROOM = 1024


@dataclass(frozen=True)
class Choice:
    """One chosen module of a budget plan: bytes its recompute frees, FLOPs it adds."""

    path: str
    freed: int
    flops: int


@dataclass(frozen=True)
class Plan:
    """Which modules of a model to recompute in backward, and how they were chosen.

    ``modules`` are qualified names as in ``model.named_modules()`` (``""`` is the model
    itself), never one inside another. A budget plan also predicts the step peak with and
    without it (bytes, as :func:`autoremat.measure` defines ``peak``) and the FLOPs its
    recomputes add. ``print(plan)`` shows the choice and the tree with it marked ``*``.
    """

    modules: tuple[str, ...]
    strategy: str
    model_class: str
    segments: int | None = None
    budget: int | None = None
    estimated_peak: int | None = None
    baseline_peak: int | None = None
    recompute_flops: int | None = None
    choices: tuple[Choice, ...] = ()
    tree: Node | None = field(default=None, repr=False, compare=False)

    def apply(self, model: nn.Module) -> nn.Module:
        """Wrap the plan's modules of ``model`` in place (claim 4) and return ``model``.

        See :func:`autoremat.wrap.apply` for the errors; the model is unchanged when it raises.
        """
        return wrap.apply(model, self.modules)

    def table(self) -> str:
        """The chosen modules with what each frees and adds, and the predicted peak."""
        if self.strategy != "budget":
            return "\n".join(f"  {p or '(root)'}" for p in self.modules)
        width = max([len(c.path or "(root)") for c in self.choices] + [6])
        rows = [f"  {'module':{width}}  {'frees MiB':>10}  {'adds GFLOP':>10}"]
        rows += [
            f"  {c.path or '(root)':{width}}  {c.freed / _MiB:>10.2f}  {c.flops / 1e9:>10.3f}"
            for c in self.choices
        ]
        assert self.estimated_peak is not None and self.baseline_peak is not None
        assert self.budget is not None and self.recompute_flops is not None
        rows.append(
            f"predicted peak {self.estimated_peak / _MiB:.2f} MiB (budget "
            f"{self.budget / _MiB:.2f} MiB, no recompute {self.baseline_peak / _MiB:.2f} MiB, "
            f"{self.estimated_peak / self.baseline_peak:.0%}), recompute adds "
            f"{self.recompute_flops / 1e9:.3f} GFLOP"
        )
        return "\n".join(rows)

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.tree is not None:
            lines += ["", self.tree.render(marked=frozenset(self.modules))]
        return "\n".join(lines)

    def summary(self) -> str:
        """The header and :meth:`table`, without the tree."""
        how = {
            "levels": f"levels, segments={self.segments}",
            "budget": f"budget {self.budget / _MiB:.2f} MiB" if self.budget else "budget",
        }.get(self.strategy, self.strategy)
        head = (
            f"Plan for {self.model_class} ({how}): recompute {len(self.modules)} module"
            f"{'' if len(self.modules) == 1 else 's'}"
        )
        lines = [head, self.table()] if self.modules or self.strategy == "budget" else [head]
        return "\n".join(lines)


def plan(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    segments: int | None = None,
    budget: int | float | str | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> Plan:
    """Choose the modules of ``model`` to recompute.

    With ``segments`` (default 3 when no budget is given), the levels strategy of the method
    (claims 2-3): the tree is walked level by level until the scheme holds more than
    ``segments`` modules (:func:`autoremat.strategies.choose_levels`).

    With ``budget``, the budget strategy: profile one training step (``loss_fn`` as in
    :func:`autoremat.measure`), then choose the modules, anywhere in the tree and never one
    inside another, whose recompute costs least while the predicted step peak stays within the
    budget (:mod:`autoremat.strategies.budget`). ``budget`` is bytes (int), a fraction of the
    no-recompute peak (float, ``0 < f <= 1``), a percentage (``"50%"``) or a size string
    (``"800MB"``, ``"6GiB"``). A budget at or above the no-recompute peak gives an empty plan.

    Both run the model on the example inputs and leave it as they found it.

    Raises:
        ValueError: ``segments`` negative; both ``segments`` and ``budget``; a malformed or
            non-positive budget (the message lists the accepted forms); a budget below the
            lowest peak any plan reaches (the message states that peak); no submodule ran.
        TypeError: ``segments`` not an int, ``budget`` of another type, or ``model`` not an
            ``nn.Module``.
        RuntimeError: the example inputs fail in forward (the message names the module).
    """
    if segments is not None and budget is not None:
        raise ValueError(
            "segments and budget are mutually exclusive: pass segments=K for the levels "
            "strategy, or budget=... for the memory-budget strategy"
        )
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
            parse_budget(budget, 1)  # raises the TypeError that lists the forms
        parse_budget(budget, 1)  # malformed budgets fail before the model runs
        return _budget_plan(model, args, kwargs, budget, loss_fn)
    segments = 3 if segments is None else segments
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError(f"segments must be an int, got {type(segments).__name__}")
    if segments < 0:
        raise ValueError(f"segments must be >= 0, got {segments}; try segments=3")
    tree = build_tree(model, args, kwargs)
    _require_submodules(model, tree)
    chosen = choose_levels(tree, segments)
    return Plan(
        modules=tuple(n.path for n in chosen),
        strategy="levels",
        model_class=type(model).__name__,
        segments=segments,
        tree=tree,
    )


def _require_submodules(model: nn.Module, tree: Node) -> None:
    if tree.is_leaf:
        raise ValueError(
            f"{type(model).__name__} has no submodules that ran on the example inputs: there "
            f"is nothing to recompute; wrap it in a model with submodules, or check the inputs"
        )


def planning_tree(prof: Profile) -> Item:
    """The budget strategy's view of a profile: one :class:`Item` per node, children in the
    order they ended. A module called several times whose calls interleave with a sibling's
    (a dropout used after attention and after the MLP), and its descendants, are not
    candidates: the cost model places each node at one span. Modules that cannot be wrapped
    are not candidates either."""

    def buffer_bytes(module: nn.Module) -> int:
        # the wrap copies the module's buffers around each recompute (wrap.py)
        return sum(b.numel() * b.element_size() for b in module.buffers())

    def wrappable(module: nn.Module) -> bool:
        return not isinstance(module, torch.jit.ScriptModule) and "forward" not in vars(module)

    def build(node: Node, allowed: bool) -> Item:
        cost = prof[node.path]
        kids = sorted(node.children, key=lambda c: prof[c.path].end)
        clash = set()
        for k, after in enumerate(kids):
            for before in kids[:k]:
                if prof[after.path].start <= prof[before.path].end:
                    # interleaved calls: the module called several times is left out (the
                    # solver then only checks the points after its sibling); if neither was
                    # called several times, both
                    shared = {c.path for c in (before, after) if c.calls > 1}
                    clash.update(shared or {before.path, after.path})
        return Item(
            path=node.path,
            start=cost.start,
            end=cost.end,
            freed=cost.freeable,
            flops=cost.flops,
            candidate=allowed and wrappable(node.module),
            children=tuple(build(c, allowed and c.path not in clash) for c in kids),
            recompute_peak=cost.recompute_peak + buffer_bytes(node.module),
            runs=tuple(
                (
                    i,
                    j,
                    freed,
                    sum(prof[c.path].flops for c in kids[i:j]),
                    peak + sum(buffer_bytes(c.module) for c in kids[i:j]),
                )
                for i, j, freed, peak in cost.runs
            )
            if allowed
            else (),
        )

    return build(prof.tree, True)


def _budget_plan(
    model: nn.Module,
    args: tuple[Any, ...] | Any,
    kwargs: dict[str, Any] | None,
    budget: int | float | str,
    loss_fn: Callable[[Any], torch.Tensor] | None,
) -> Plan:
    prof = profile(model, args, kwargs, loss_fn=loss_fn)
    _require_submodules(model, prof.tree)
    limit = parse_budget(budget, prof.peak)
    root = planning_tree(prof)
    try:
        chosen = [] if limit >= prof.peak else solve(root, prof.points, limit - HEADROOM)
    except Infeasible:
        lowest = min_peak(root, prof.points) + HEADROOM
        raise ValueError(
            f"budget {limit / _MiB:.2f} MiB ({budget!r}) is below the lowest peak that "
            f"recomputing modules of {type(model).__name__} reaches, {lowest / _MiB:.2f} MiB "
            f"({lowest / prof.peak:.0%} of the {prof.peak / _MiB:.2f} MiB peak without "
            f"recompute; about {lowest} bytes). Try budget={lowest}, a smaller batch, or "
            f"mixed precision."
        ) from None
    return Plan(
        modules=tuple(i.path for i in chosen),
        strategy="budget",
        model_class=type(model).__name__,
        budget=limit,
        estimated_peak=predict_peak(prof.points, chosen),
        baseline_peak=prof.peak,
        recompute_flops=sum(i.flops for i in chosen),
        choices=tuple(Choice(i.path, i.freed, i.flops) for i in chosen),
        tree=prof.tree,
    )

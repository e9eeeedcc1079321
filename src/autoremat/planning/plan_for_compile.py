"""A budget plan that holds under ``torch.compile``: planned eagerly, checked compiled.

The cost model prices the eager step. A compiled step keeps what each recomputed region's
policy says (its ``tag_activation_checkpoint`` regions), but the partitioner chooses what to
save outside them and inductor orders the backward's kernels itself. Measured on the benchmark
zoo (``docs/benchmarks.md``, "Under torch.compile"): at 75% and 50% budgets the compiled step
peaks at or below the eager plan's estimate (0.74-0.98x), while at the lowest budgets, plans
of many small entries, it peaks 12-28% above it. :func:`plan_for_compile` therefore *profiles
the compiled step*: it compiles the model with the plan, measures the allocator's peak of one
warm step, and while that is over the budget plans again for a lower budget.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, cast

import torch
from torch import nn

from autoremat.core.sizes import format_size
from autoremat.planning.plan import plan
from autoremat.planning.plans import Plan
from autoremat.planning.strategies.budget import BudgetTooLow
from autoremat.record.measure import measure
from autoremat.record.snapshot import preserved
from autoremat.record.step import LossFn, default_loss, leaf_inputs, train_step
from autoremat.wrap.wrapping import remove

__all__ = ["compiled_peak", "plan_for_compile"]

logger = logging.getLogger(__name__)


def compiled_peak(
    model: nn.Module,
    chosen: Plan,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    backend: str = "inductor",
    loss_fn: LossFn | None = None,
    inductor_config: dict[str, Any] | None = None,
) -> int:
    """The allocator's peak (bytes above the start) of one training step of ``model`` with
    ``chosen`` applied and compiled by ``torch.compile(backend=backend)``, measured after a
    warm-up step (:func:`autoremat.measure` of a compiled model), with
    ``torch._inductor.config`` patched by ``inductor_config`` meanwhile (compile-time options
    change what the compiled step keeps: ``fallback_random`` moves ViT's peak by about 2 MiB of
    32). The model is left as found:
    unwrapped, its state restored (:func:`autoremat.record.snapshot.preserved`); dynamo keeps the
    graphs it compiled for the wrapped classes (they match nothing once unwrapped).

    Raises:
        ValueError: ``chosen`` does not fit ``model`` (see :meth:`Plan.apply`).
        Exception: whatever compiling or the step raises.
    """
    kwargs = {} if kwargs is None else kwargs
    loss_fn = default_loss if loss_fn is None else loss_fn
    if not isinstance(args, tuple):
        args = (args,)
    with preserved(model, leaf_inputs(args, kwargs)):
        chosen.apply(model)
        try:
            with torch._inductor.config.patch(**(inductor_config or {})):
                compiled = cast(nn.Module, torch.compile(model, backend=backend))
                train_step(compiled, args, kwargs, loss_fn)  # the cold compile, not measured
                return measure(compiled, args, kwargs, loss_fn=loss_fn, memory="allocator").peak
        finally:
            remove(model)


def plan_for_compile(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    budget: int | float | str,
    backend: str = "inductor",
    loss_fn: LossFn | None = None,
    selective: bool = True,
    objective: str = "time",
    tries: int = 4,
    inductor_config: dict[str, Any] | None = None,
) -> Plan:
    """:func:`autoremat.plan` with ``budget``, checked under ``torch.compile``: the plan is
    applied, compiled with ``backend`` and one warm step measured (:func:`compiled_peak`);
    while the compiled peak is over the budget, the model is planned again for a budget lowered
    by the overshoot, twice that on the next try, and so on (the compiled peak does not fall
    monotonically with the eager budget; at most ``tries`` compiles). The plan returned keeps
    the budget asked for and records the compiled peak measured (``Plan.compiled_peak``). Each
    try costs a cold compile (seconds to a minute on a CPU) and three training steps.

    Then apply the plan and ``torch.compile(model, backend=backend)`` with the inductor
    settings ``inductor_config`` gives: the budget holds for the configuration measured.

    Raises:
        BudgetTooLow: the eager budget needed to hold ``budget`` under compile is below the
            lowest peak any plan reaches, or ``tries`` compiles did not get under it; the
            message gives the compiled peaks measured.
        ValueError, TypeError: as :func:`autoremat.plan`; ``tries`` below 1.
    """
    if not isinstance(tries, int) or tries < 1:
        raise ValueError(f"tries must be an int >= 1, got {tries!r}")
    options = {"loss_fn": loss_fn, "selective": selective, "objective": objective}
    compiling: dict[str, Any] = {"backend": backend, "loss_fn": loss_fn}
    compiling["inductor_config"] = inductor_config
    chosen = plan(model, args, kwargs, budget=budget, **options)  # type: ignore[arg-type]
    assert chosen.budget is not None
    limit = target = chosen.budget
    peaks: list[int] = []
    for attempt in range(tries):
        peak = compiled_peak(model, chosen, args, kwargs, **compiling)
        peaks.append(peak)
        if peak <= limit:
            return dataclasses.replace(chosen, budget=limit, compiled_peak=peak)
        if attempt == tries - 1:
            break
        target -= (peak - limit) * 2**attempt
        logger.info(
            "under torch.compile(backend=%r) the plan peaks at %s, over the %s budget: "
            "planning again for %s",
            backend,
            format_size(peak),
            format_size(limit),
            format_size(target),
        )
        chosen = _replan(model, args, kwargs, target, options, peaks, limit, backend)
    raise BudgetTooLow(_over_message(peaks, limit, backend), peaks[-1], chosen.baseline_peak or 0)


def _replan(
    model: nn.Module,
    args: Any,
    kwargs: Any,
    target: int,
    options: dict[str, Any],
    peaks: list[int],
    limit: int,
    backend: str,
) -> Plan:
    try:
        if target <= 0:
            raise BudgetTooLow("no budget left", 0, 0)
        return plan(model, args, kwargs, budget=target, **options)
    except BudgetTooLow as exc:
        raise BudgetTooLow(
            _over_message(peaks, limit, backend)
            + f"; the eager budget that would be needed, {format_size(max(target, 0))}, is "
            f"below the lowest peak any plan reaches",
            exc.lowest,
            exc.baseline,
        ) from None


def _over_message(peaks: list[int], limit: int, backend: str) -> str:
    return (
        f"under torch.compile(backend={backend!r}) the plans for a {format_size(limit)} "
        f"budget peaked at {', '.join(format_size(p) for p in peaks)}: over the budget. Try a "
        f"larger budget, or plan for the eager step (autoremat.plan) and accept the compiled "
        f"peak"
    )

"""A budget plan that holds under ``torch.compile`` (``plan(..., compile=...)``): each plan's
step run compiled: it peaks elsewhere than eagerly (docs/guide.md, "The budget under compile")."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
from torch import nn

from autoremat.planning.plan import activation_plan
from autoremat.planning.plans import Plan
from autoremat.planning.rehearsal import PlanFields
from autoremat.record.measure import measure
from autoremat.record.snapshot import preserved
from autoremat.record.step import LossFn, leaf_inputs, train_step
from autoremat.wrap.wrapping import apply, remove

__all__ = ["CompiledRehearsal", "compiled_peak", "compiled_plan"]


def compiled_peak(
    model: nn.Module,
    chosen: PlanFields | Plan,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    backend: str = "inductor",
    loss_fn: LossFn | None = None,
    inductor_config: dict[str, Any] | None = None,
) -> int:
    """The allocator's peak (bytes above the start) of one training step of ``model`` with
    ``chosen``'s entries applied and compiled by ``torch.compile(backend=backend)``, measured
    after a warm-up step (:func:`autoremat.measure` of a compiled model), with
    ``torch._inductor.config`` patched by ``inductor_config`` meanwhile. The model is left as
    found: unwrapped, its state restored (:func:`autoremat.record.snapshot.preserved`). Each
    call compiles apart (``isolate_recompiles``: docs/guide.md, "The budget under compile").

    Raises:
        ValueError: the entries do not fit ``model`` (see :func:`autoremat.wrap.apply`).
        RuntimeError: dynamo compiled no graph (its limits reached: it ran the step eagerly).
        Exception: whatever compiling or the step raises.
    """
    from torch._dynamo.utils import counters  # (not on import: planning without compile)

    with preserved(model, leaf_inputs(args, kwargs)):
        apply(model, chosen.modules, selective=chosen.selective or {}, calls=chosen.calls)
        try:
            with torch._inductor.config.patch(**(inductor_config or {})):
                compiled = torch.compile(model, backend=backend, isolate_recompiles=True)  # type: ignore[call-overload]
                graphs = counters["stats"]["unique_graphs"]
                train_step(cast(nn.Module, compiled), args, kwargs, loss_fn)  # (cold: unmeasured)
                if counters["stats"]["unique_graphs"] == graphs:
                    raise RuntimeError(
                        f"torch.compile compiled no graph of {type(model).__name__} (dynamo's "
                        f"recompile limits reached): call torch._dynamo.reset() and plan again"
                    )
                return measure(compiled, args, kwargs, loss_fn=loss_fn, memory="allocator").peak
        finally:
            remove(model)


@dataclasses.dataclass(eq=False)  # (a runner: compared, and remembered, by identity)
class CompiledRehearsal:
    """Plans' steps run compiled (:func:`compiled_peak`), each once: a rehearsal for the
    search, as :class:`~autoremat.planning.rehearsal.Rehearsal` is for eager steps. The walk
    counts no RNG states (the allocator's figure has whatever the compiled step keeps)."""

    model: nn.Module
    args: Any
    kwargs: dict[str, Any]
    options: dict[str, Any]
    seen: dict[Any, int] = dataclasses.field(default_factory=dict)
    way = "compiled"
    rng_state = 0
    eager = False

    def peak(self, plan: PlanFields | None) -> int:
        fields = plan or PlanFields()
        if fields.key() not in self.seen:
            self.seen[fields.key()] = compiled_peak(self.model, fields, self.args, self.kwargs,
                                                    **self.options)  # fmt: skip
        return self.seen[fields.key()]

    @property
    def how(self) -> str:
        return f"compiled with torch.compile(backend={self.options['backend']!r}), by the allocator"


def compiled_plan(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    budget: int | float | str,
    backend: str = "inductor",
    loss_fn: LossFn | None = None,
    selective: bool = True,
    objective: str = "time",
    inductor_config: dict[str, Any] | None = None,
) -> Plan:
    """``autoremat.plan(..., budget=..., compile=backend)``: each plan the search tries is
    measured compiled (:func:`compiled_peak`); the plan returned peaks within the budget so, its
    ``compiled_peak`` (and ``estimated_peak``) that figure: for ``torch.compile(model,
    backend=backend)`` with ``inductor_config``.

    Raises:
        BudgetTooLow: no plan the search tried peaks within ``budget`` compiled; ``lowest`` is
            the lowest compiled peak found.
        ValueError, TypeError: as :func:`autoremat.plan`.
    """
    options = {"backend": backend, "loss_fn": loss_fn, "inductor_config": inductor_config}
    chosen = activation_plan(
        model, args, kwargs, budget=budget, loss_fn=loss_fn, selective=selective,
        objective=objective, rehearsal=CompiledRehearsal(model, args, kwargs or {}, options),
    )  # fmt: skip
    return dataclasses.replace(chosen, compiled_peak=chosen.estimated_peak)

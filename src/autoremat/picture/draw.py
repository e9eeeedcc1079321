""":func:`plot`: a plan's step, or what :func:`autoremat.fit` tried, as one HTML page.

For a :class:`~autoremat.Plan`, the step is run the way its ``estimated_peak`` was found (the
rehearsal, :mod:`autoremat.planning.rehearsal`: on fake tensors, on ``meta``, or the model
itself, under the same tracker) once with the plan and once with the empty plan, both traced
(:mod:`autoremat.picture.trace`): the curves are the plan's own figures, their peaks its
``estimated_peak`` and ``baseline_peak`` (a note says so where they are not: a plan whose
figure was the CPU allocator's, or the walk's). ``measure=True`` adds the real step of the
real model, the plan applied, under the tracker. For a :class:`~autoremat.training.fit.Fit`,
the whole step by part at each batch tried (nothing runs).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from autoremat.core.sizes import format_size
from autoremat.picture.fit_figure import Bar, fit_svg
from autoremat.picture.page import page, writable, write_page
from autoremat.picture.series import aligned, spans
from autoremat.picture.step_figure import Curve, Span, StepFigure, step_svg
from autoremat.picture.trace import StepTrace, trace_step
from autoremat.planning.plans import Plan
from autoremat.planning.rehearsal import PlanFields, Rehearsal
from autoremat.record.step import LossFn, Step, step_autocast
from autoremat.training.fit import Fit
from autoremat.training.step_memory import StepMemory
from autoremat.wrap.checkpointed import wrapped_paths
from autoremat.wrap.wrapping import remove

__all__ = ["fit_bars", "fit_page", "plan_traces", "plot", "step_figure", "step_page"]


def plot(
    found: Plan | Fit,
    path: str | os.PathLike[str],
    model: nn.Module | None = None,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: LossFn | None = None,
    autocast: Any = None,
    measure: bool = False,
) -> Path:
    """Write the picture of ``found`` to ``path`` (an HTML file) and return its path: a
    plan's step with and without it (give the ``model``, ``args``, ``kwargs``, ``loss_fn``
    and ``autocast`` it was planned with; ``measure``: the real step too), or a fit's batches.
    The model is left as found: one the plan was applied to is unwrapped while the steps run
    (the curve without recompute needs it so) and wrapped again after.

    Raises:
        TypeError: ``found`` is neither a Plan nor a Fit, or a plan without its model.
        ValueError: the plan was made for another model (:meth:`Plan.check`), the model has
            other entries wrapped than the plan's, or the folder of ``path`` does not exist.
    """
    writable(path)
    if isinstance(found, Fit):
        return write_page(path, fit_page(found))
    if not isinstance(found, Plan):
        raise TypeError(f"plot draws a Plan or a Fit, got {type(found).__name__}")
    if model is None:
        raise TypeError(
            "plot(plan, path) needs the model and inputs the plan was made for: "
            "plot(plan, path, model, args, kwargs, autocast=...) (a plan holds no model)"
        )
    found.check(model)
    wrapped = wrapped_paths(model)
    if wrapped and set(wrapped) != set(found.modules):
        raise ValueError(
            f"the model has entries wrapped ({', '.join(wrapped[:3])}) that are not this plan's "
            f"({', '.join(found.modules[:3]) or 'none'}): draw the plan they were applied from, "
            f"or unwrap the model first (autoremat.remove(model))"
        )
    step = Step(model, args, kwargs or {}, loss_fn, step_autocast(autocast, model))
    if wrapped:
        remove(model)
    try:
        return write_page(path, step_page(found, step, measure))
    finally:
        if wrapped:
            found.apply(model)


def plan_traces(plan: Plan, step: Step, measure: bool = False) -> dict[str, StepTrace]:
    """The traced steps of ``plan`` (``"plan"``), of the empty plan (``"without"``) and, with
    ``measure``, of the real model with the plan applied (``"measured"``)."""
    rehearsal = Rehearsal(step, _way(plan, step))
    fields = PlanFields(plan.modules, plan.selective, plan.calls)
    traces = {"without": trace_step(rehearsal, PlanFields()), "plan": trace_step(rehearsal, fields)}
    if measure:
        traces["measured"] = trace_step(Rehearsal(step, "real"), fields)
    return traces


def _way(plan: Plan, step: Step) -> str:
    """How the plan's figure was found, as a rehearsal's way (the model itself where it was
    the allocator's or the walk's: counted by the tracker)."""
    if any(p.device.type == "meta" for p in step.model.parameters()):
        return "meta"
    by = plan.estimated_by or ""
    return "fake" if by.startswith("on fake") else "real"


NAMES = {
    "without": "without recompute",
    "plan": "with the plan (predicted)",
    "measured": "with the plan, measured (the real step)",
}
# how each curve's peak is named beside it
SHORT = {"without": "without recompute", "plan": "with the plan", "measured": "measured"}


def step_figure(plan: Plan, traces: dict[str, StepTrace]) -> StepFigure:
    """The figure of ``traces`` (:func:`plan_traces`) on the planned step's axis."""
    main = traces["plan"]
    onto = _phase_lengths(main)
    curves = []
    for key in ("without", "plan", "measured"):
        trace = traces.get(key)
        if trace is None:
            continue
        xs = aligned(_phase_lengths(trace), onto) if key != "plan" else range(len(main.moments))
        at = trace.moments[trace.peak_at] if trace.moments else None
        curves.append(Curve(key, NAMES[key], SHORT[key], tuple(float(x) for x in xs),
                            tuple(m.high for m in trace.moments),
                            at.path if at else "", at.phase if at else ""))  # fmt: skip
    forward, loss, _ = onto
    phases = [Span(0, forward, "forward"), Span(forward, forward + loss, "loss"),
              Span(forward + loss, len(main.moments), "backward")]  # fmt: skip
    ways = {c.path: c.way for c in plan.choices}
    recomputes = [
        Span(a, b, entry, ways.get(entry, "selective" if entry in plan.selective else "full"))
        for a, b, entry in spans([m.entry for m in main.moments])
    ]
    return StepFigure(tuple(curves), float(max(len(main.moments), 1)),
                      tuple(p for p in phases if p.end > p.start), _module_spans(main),
                      tuple(recomputes), plan.budget)  # fmt: skip


def _phase_lengths(trace: StepTrace) -> tuple[int, int, int]:
    """Moments in forward, in the loss, in backward (recomputes included)."""
    phases = [m.phase for m in trace.moments]
    forward = next((k for k, p in enumerate(phases) if p != "forward"), len(phases))
    back = next((k for k, p in enumerate(phases) if p in ("backward", "recompute")), len(phases))
    return forward, back - forward, len(phases) - back


def _module_spans(trace: StepTrace) -> tuple[Span, ...]:
    """The spans of the step's modules at the deepest depth (up to 3) at which at most
    :data:`MOST_MODULES` ran (1 when more do at every depth)."""
    paths = [m.path if m.phase != "loss" else "" for m in trace.moments]
    depth = max(
        (d for d in (1, 2, 3) if len({_prefix(p, d) for p in paths}) <= MOST_MODULES), default=1
    )
    found = spans([_prefix(p, depth) for p in paths])
    return tuple(Span(a, b, label) for a, b, label in found)


# the most modules named in the band under the axis
MOST_MODULES = 40


def _prefix(path: str, depth: int) -> str:
    return ".".join(path.split(".")[:depth]) if path else ""


def step_page(plan: Plan, step: Step, measure: bool = False) -> str:
    """The page of ``plan``'s step (module docstring)."""
    traces = plan_traces(plan, step, measure)
    figure = step_figure(plan, traces)
    cast = f" under {step.autocast[1]} autocast".replace("torch.", "") if step.autocast else ""
    lines = [
        f"{len(plan.modules)} entries recomputed ({len(plan.selective)} selectively){cast}; "
        f"recompute adds {(plan.recompute_flops or 0) / 1e9:.3f} GFLOP"
        + (f" and about {plan.recompute_seconds * 1e3:.1f} ms" if plan.recompute_seconds else ""),
        f"each curve is the step run {traces['plan'].how}, counted by the live-storage "
        f"tracker: bytes the step creates above what was live before it (parameters, inputs "
        f"and optimizer state not included); hover over a shape for its module",
    ]
    notes = _differences(plan, traces)
    title = f"{plan.model_class}: the step's memory with and without the plan"
    if plan.budget is not None:
        title += f" (budget {format_size(plan.budget)})"
    return page(title, [("the step's live memory", lines, step_svg(figure))], notes)


def _differences(plan: Plan, traces: dict[str, StepTrace]) -> list[str]:
    """Where a drawn peak is not the plan's figure: why."""
    notes = []
    for key, figure in (("plan", plan.estimated_peak), ("without", plan.baseline_peak)):
        drawn = traces[key].peak
        if figure is not None and drawn != figure:
            notes.append(
                f"the {NAMES[key]} curve peaks at {drawn} bytes and the plan says {figure} "
                f"(found {plan.estimated_by or 'by its strategy'}): the curve is the step "
                f"run {traces[key].how}"
            )
    return notes


def fit_bars(found: Fit) -> list[Bar]:
    """A bar per batch tried: the candidates planned (their plans), and the batches the
    search tried with the most recompute (:attr:`Fit.tried`)."""
    bars = {b: Bar(b, _parts(m, found), note="most recompute") for b, m in found.tried}
    for c in found.candidates:
        note = "no recompute" if c.plan is None or not c.plan.modules else "its plan"
        bars[c.batch] = Bar(c.batch, _parts(c.memory, found), c.batch == found.batch, note)
    return [bars[b] for b in sorted(bars)]


def _parts(memory: StepMemory, found: Fit) -> tuple[tuple[str, int], ...]:
    """The whole step's memory by part: what is live before it, then the larger of the
    step's peak and the optimizer's step, what the device adds, and the reserve."""
    step = memory.step_peak + memory.buffer_copies
    optimizer = memory.gradients + memory.optimizer_step
    gradients = memory.gradients if optimizer >= step else min(memory.gradients, step)
    return (
        ("parameters and buffers", memory.parameters + memory.buffers),
        ("optimizer state", memory.optimizer_state),
        ("inputs", memory.inputs + memory.buckets),
        ("gradients", gradients),
        ("activations", max(step - gradients, 0) if step > optimizer else 0),
        ("optimizer step", memory.optimizer_step if optimizer >= step else 0),
        ("runtime and allocator", memory.device - memory.tensors),
        ("reserve", found.device.reserve),
    )


def fit_page(found: Fit) -> str:
    """The page of what ``found`` tried."""
    dm = found.device
    lines = [
        f"batch {found.batch} chosen (objective: {found.objective}); the largest without "
        f"recompute: "
        f"{found.largest_without_recompute}; {len(found.plan.modules)} entries recomputed",
        "each bar: the whole training step's memory at that batch, as fit predicted it; the "
        "line: the device's memory; hover over a part for its bytes",
    ]
    svg = fit_svg(fit_bars(found), dm.total, f"{dm.device} memory to fit:")
    return page(f"fit: the training step at each batch tried on {dm}",
                [("the whole step by part", lines, svg)])  # fmt: skip

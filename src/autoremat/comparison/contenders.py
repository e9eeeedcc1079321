"""The built-in eager contenders (:class:`~autoremat.comparison.applied.Contender`):
:func:`no_recompute` (the baseline), :func:`every_block` (what users do by hand, on
:func:`find_blocks`), :func:`sqrt_segments` (``checkpoint_sequential``), :func:`levels_plan`
and :func:`budget_plan` (:func:`autoremat.plan`, applied), :func:`applied_plan` (a plan made
already). ``torch.compile`` is in :mod:`autoremat.comparison.inductor`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from autoremat.comparison.applied import BASELINE, Applied, Args, Contender, Kwargs, MiB
from autoremat.core import huggingface
from autoremat.planning.plan import lowest_budget
from autoremat.planning.plans import Plan
from autoremat.record.tree import build_tree, find_blocks
from autoremat.training.plan import plan
from autoremat.wrap.wrapping import apply as wrap_apply

__all__ = [
    "SqrtSegments",
    "applied_plan",
    "budget_plan",
    "describe_paths",
    "every_block",
    "levels_plan",
    "no_recompute",
    "plan_without_tree",
    "sqrt_segments",
    "unwrap",
]

def no_recompute() -> Contender:
    """The baseline: the model as it is, except that Hugging Face models run with their
    key/value cache off while training, as every autoremat plan runs them (and Hugging Face's
    own gradient checkpointing): the ratios then compare the same step with and without
    recompute, not one that also fills a cache."""

    def apply(model: nn.Module, args: Args, kwargs: Kwargs) -> Applied:
        huggingface.turn_cache_off_in_training(model, warn=False)
        return Applied(model)

    return Contender(BASELINE, apply)


def _every_block(model: nn.Module, args: Args, kwargs: Kwargs) -> Applied | None:
    if huggingface.is_pretrained_model(model) and getattr(
        model, "supports_gradient_checkpointing", False
    ):
        checkpoint_kwargs = {"use_reentrant": False}
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:  # transformers >= 5.x
            enable(activation_checkpointing_kwargs=checkpoint_kwargs)
        else:  # pragma: no cover - older transformers
            model.gradient_checkpointing_enable(  # type: ignore[operator]
                gradient_checkpointing_kwargs=checkpoint_kwargs
            )
        return Applied(model, note="HF activation_checkpointing_enable")
    paths = find_blocks(build_tree(model, args, kwargs))
    if not paths:
        return None
    return Applied(wrap_apply(model, paths))


def every_block() -> Contender:
    """Checkpoint every block: Hugging Face's own activation checkpointing (non-reentrant) for a
    ``PreTrainedModel`` that supports it, else :func:`autoremat.wrap.apply` on
    :func:`find_blocks`. Does not apply when the model has no blocks."""
    return Contender("every block", _every_block)


class SqrtSegments(nn.Module):
    """Runs an ``nn.Sequential`` through ``checkpoint_sequential`` (non-reentrant) with
    ``round(sqrt(len(seq)))`` segments when gradients are enabled. The last segment is not
    checkpointed (``checkpoint_sequential`` runs it plainly)."""

    def __init__(self, seq: nn.Sequential) -> None:
        super().__init__()
        self.seq = seq
        self.segments = max(1, round(math.sqrt(len(seq))))

    def forward(self, x: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.seq(x)
        return checkpoint_sequential(self.seq, self.segments, x, use_reentrant=False)


def _sqrt_segments(model: nn.Module, args: Args, kwargs: Kwargs) -> Applied | None:
    if not isinstance(model, nn.Sequential) or kwargs or len(args) != 1 or len(model) < 2:
        return None
    wrapped = SqrtSegments(model)
    note = f"checkpoint_sequential, {wrapped.segments} segments of {len(model)}"
    return Applied(wrapped, note=note)


def sqrt_segments() -> Contender:
    """``checkpoint_sequential`` with ``round(sqrt(n))`` segments; only for an ``nn.Sequential``
    called with one positional argument."""
    return Contender("sqrt segments", _sqrt_segments)


def levels_plan(segments: int) -> Contender:
    """:func:`autoremat.plan` with ``segments``, applied. A plan that wraps the same modules as
    an earlier row (another ``levels`` count, or ``every block``) is dropped by
    :func:`autoremat.comparison.compare`."""

    def apply(model: nn.Module, args: Args, kwargs: Kwargs) -> Applied | None:
        try:
            chosen = plan(model, args, kwargs, segments=segments)
        except ValueError:  # no submodule ran: nothing to recompute
            return None
        return Applied(chosen.apply(model), plan=chosen)

    return Contender(f"levels s={segments}", apply, dedupe=True)


def budget_plan(
    target: float | str,
    *,
    selective: bool = True,
    objective: str = "time",
    compile_backend: str | None = None,
) -> Contender:
    """:func:`autoremat.plan` with ``budget=target`` (a fraction of the peak without
    recompute), ``selective`` and ``objective``, applied; ``target="min"`` plans at the lowest
    budget the planner meets (:func:`autoremat.lowest_budget`). With ``compile_backend``, the
    plan is checked under ``torch.compile`` (``autoremat.plan(..., compile=...)``). The row is
    named ``budget 50%`` (``budget min``), with `` (module)`` appended for ``selective=False``
    (module-level recompute only), `` (flops)`` for ``objective="flops"`` and
    `` (compile-checked)`` with ``compile_backend``. Its :class:`Applied` carries the plan and
    its predicted peak; the row's note gives the budget, how many entries are recomputed
    (selectively), and the predicted peak with its error against the measured one."""

    def apply(model: nn.Module, args: Args, kwargs: Kwargs) -> Applied:
        spec: float | int | str = target
        if target == "min":
            spec = lowest_budget(model, args, kwargs, selective=selective)
        options: dict[str, Any] = {"budget": spec, "selective": selective, "objective": objective}
        if compile_backend is not None:  # (fallback_random: as compiled() compiles)
            options.update(compile=compile_backend, inductor_config={"fallback_random": True})
        chosen = plan(model, args, kwargs, **options)
        applied = chosen.apply(model)
        assert chosen.estimated_peak is not None and chosen.budget is not None
        note = (
            f"budget {chosen.budget / MiB:.1f} MiB, {len(chosen.modules)} entries "
            f"({len(chosen.selective)} selective): {describe_paths(chosen.modules)}"
        )
        return Applied(applied, note=note, plan=chosen, predicted_peak=chosen.estimated_peak)

    name = "budget min" if target == "min" else f"budget {float(target):.0%}"
    name += "" if selective else " (module)"
    name += "" if objective == "time" else f" ({objective})"
    return Contender(name + ("" if compile_backend is None else " (compile-checked)"), apply)


def applied_plan(name: str, chosen: Plan) -> Contender:
    """A plan made already (by :func:`autoremat.plan` on this model), applied; its row is
    named ``name`` and carries the plan and its predicted peak."""

    def apply(model: nn.Module, args: Args, kwargs: Kwargs) -> Applied:
        note = None if chosen.strategy == "budget" else describe_paths(chosen.modules)
        return Applied(
            chosen.apply(model), note=note, plan=chosen, predicted_peak=chosen.estimated_peak
        )

    return Contender(name, apply)


def describe_paths(paths: Sequence[str]) -> str:
    """``wraps N: a, b, ..., z``: how many entries, the first two and the last (``(root)`` for
    the model itself)."""
    shown = [p or "(root)" for p in paths]
    if len(shown) > 3:
        shown = [shown[0], shown[1], "...", shown[-1]]
    return f"wraps {len(paths)}: {', '.join(shown)}"


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a compiled or :class:`SqrtSegments` wrapper (its modules and
    parameters named as in the original)."""
    # Only torch.compile makes an OptimizedModule, and it imports torch._dynamo first.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    while True:
        if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, SqrtSegments):
            model = model.seq
        else:
            return model


def plan_without_tree(chosen: Plan | None) -> Plan | None:
    """``chosen`` without its tree, whose nodes hold the modules of the model it was made on
    (a :class:`Row` that keeps the plan should not keep that copy of the model alive)."""
    return None if chosen is None else dataclasses.replace(chosen, tree=None)

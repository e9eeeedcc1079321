""":func:`plan`, the one way in: what must fit (a budget of the step's activations, a device's
memory, or the method's count of segments) and where the step runs (one device, a rank of a
sharded job, compiled). It checks the request, hands it to the planner that answers it
(:mod:`autoremat.planning.plan`, :mod:`autoremat.training.device_plan`,
:mod:`autoremat.planning.compiled_plan`: each the same search, judged by runs of the step),
logs what the plan has to say, once, and says when the plan keeps more than the model as
given, which checkpoints itself."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from autoremat.core.own_checkpointing import switched_on
from autoremat.core.sizes import format_size
from autoremat.planning.compiled_plan import compiled_plan
from autoremat.planning.plan import activation_plan
from autoremat.planning.plans import Plan
from autoremat.planning.rehearsal import Rehearsal
from autoremat.record.step import LossFn, Step, step_autocast
from autoremat.training.device_plan import device_plan
from autoremat.training.optimizer_memory import OptimizerLike
from autoremat.training.sharding import Sharding

__all__ = ["eval_mode_warning", "plan"]

logger = logging.getLogger(__name__)


def plan(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    budget: int | float | str | None = None,
    device_memory: int | float | str | None = None,
    segments: int | None = None,
    objective: str = "time",
    selective: bool = True,
    autocast: Any = None,
    loss_fn: LossFn | None = None,
    optimizer: OptimizerLike | None = None,
    reserve: int | str = 0,
    sharding: Sharding | None = None,
    compile: bool | str = False,
    inductor_config: dict[str, Any] | None = None,
) -> Plan:
    """Choose the modules of ``model`` to recompute in backward, for one of three aims:

    * ``budget``: the step's activation peak (bytes, ``"50%"`` or a float fraction of the
      peak without recompute, ``"800MB"``, ``"6GiB"``) at the least recompute ``objective``
      (``"time"`` or ``"flops"``); ``selective`` lets a module keep its matrix products'
      outputs and recompute the rest;
    * ``device_memory`` (bytes, a size, or a fraction of the model's device): the whole
      training step fits, ``optimizer``'s state (``"adamw"`` by default, a name, an optimizer
      to copy, a factory, or ``None``) and ``reserve`` included; with ``sharding`` (a
      :class:`~autoremat.Sharding`), one rank's step of that job;
    * ``segments`` (3 when none of the three is given): the patented method's level-order walk
      (claims 2-3).

    ``autocast`` (a dtype, or ``(device_type, dtype)``): forward and loss under autocast.
    ``compile`` (``True``: inductor; or a backend's name): each plan tried is compiled and
    measured, ``inductor_config`` patched in (a budget only). The model is left as found;
    :attr:`Plan.warnings` are logged, once each.

    Raises:
        BudgetTooLow: (a ValueError) no plan meets the aim; its ``lowest`` is the lowest peak.
        ValueError: two aims, or a setting the aim does not take (the message says which); a
            malformed budget or size; no such ``compile`` backend; as ``activation_plan``.
        TypeError: ``model`` not an ``nn.Module``; ``sharding`` or ``compile`` of a wrong type.
    """
    _check(budget, device_memory, segments, optimizer, reserve, sharding, compile, autocast,
           objective, selective, inductor_config)  # fmt: skip
    how: dict[str, Any] = {"loss_fn": loss_fn, "selective": selective, "objective": objective}
    if compile:
        backend = "inductor" if compile is True else str(compile)
        made = compiled_plan(model, args, kwargs or {}, budget=budget,  # type: ignore[arg-type]
                             backend=backend, inductor_config=inductor_config, **how)  # fmt: skip
    elif device_memory is not None:
        made = device_plan(model, args, kwargs, device_memory=device_memory, autocast=autocast,
                           optimizer="adamw" if optimizer is None else optimizer,
                           reserve=reserve, sharding=sharding, **how)  # fmt: skip
    else:
        made = activation_plan(model, args, kwargs, segments=segments, budget=budget,
                               autocast=autocast, **how)  # fmt: skip
    if budget is not None and not compile:
        _compare_with_own_checkpointing(model, (args, kwargs or {}), made, loss_fn, autocast)
    return _said(model, made)


def _said(model: nn.Module, made: Plan) -> Plan:
    """``made`` with the warning ``"eval_mode"`` added for a budget or device plan of a model
    in eval mode, its warnings logged."""
    if made.strategy == "budget" and not model.training:
        made.warnings["eval_mode"] = eval_mode_warning(model, "its budget")
    for text in made.warnings.values():
        logger.warning("%s", text)
    return made


def eval_mode_warning(model: nn.Module, exceeded: str) -> str:
    """What a plan (or fit) made while ``model`` is in eval mode says: its step ran as it runs
    now, and a training step may exceed its ``exceeded`` (what it was made to fit)."""
    return (
        f"{type(model).__name__} is in eval mode, so this plan was made for its step as it runs "
        f"now (dropout off, batch norm on running statistics) and may exceed {exceeded} in "
        f"training: call model.train() before planning a training step"
    )


def _check(budget: Any, device_memory: Any, segments: Any, optimizer: Any, reserve: Any,
           sharding: Any, compile: Any, autocast: Any, objective: str, selective: bool,
           inductor_config: Any) -> None:  # fmt: skip
    """Raise ValueError for a request :func:`plan` cannot answer as asked: two aims, or a
    setting the aim does not take (it would be ignored)."""
    aims = [n for n, v in (("budget", budget), ("device_memory", device_memory),
                           ("segments", segments)) if v is not None]  # fmt: skip
    if len(aims) > 1:
        raise ValueError(
            f"{' and '.join(aims)} are different aims: pass budget= (the step's activations), "
            f"device_memory= (the whole step on a device) or segments= (the method's walk)"
        )
    device_only = [n for n, v in (("optimizer", optimizer), ("reserve", reserve or None),
                                  ("sharding", sharding)) if v is not None]  # fmt: skip
    if device_only and device_memory is None:
        named = " and ".join(f"{n}=" for n in device_only)
        raise ValueError(
            f"{named} count{'s' * (len(device_only) == 1)} in the whole step on a device: pass "
            f"device_memory=... too (a budget bounds the step's activations only)"
        )
    step_only = [n for n, v in (("objective", objective != "time"), ("selective", not selective),
                                ("autocast", autocast is not None)) if v]  # fmt: skip
    if step_only and budget is None and device_memory is None:  # (the levels walk runs none)
        raise ValueError(
            f"{'= and '.join(step_only)}= appl{'ies' if len(step_only) == 1 else 'y'} to the "
            f"steps budget= and device_memory= plans run; segments= (the method's level-order "
            f"walk, the aim when none is given) runs none"
        )
    if inductor_config is not None and not compile:
        raise ValueError("inductor_config= patches the compiled step: pass compile=True too")
    _check_compile(compile)
    if compile and budget is None:
        raise ValueError(
            "compile= checks a budget on the compiled step: pass budget=... (device_memory= "
            "and segments= are planned on the eager step; compile after applying the plan)"
        )
    if compile and autocast is not None:
        raise ValueError(
            "compile= does not plan under autocast yet: plan the eager step with autocast= "
            "and measure the compiled one with autoremat.measure(torch.compile(model), ...)"
        )


def _check_compile(compile: Any) -> None:
    """Raise TypeError or ValueError for a ``compile=`` that is neither a bool nor the name of
    a ``torch.compile`` backend (before anything runs: torch would refuse it after a profile)."""
    if not isinstance(compile, (bool, str)):
        raise TypeError(
            f"compile must be True, False or a torch.compile backend's name ('inductor', "
            f"'aot_eager', ...), got {compile!r}"
        )
    if isinstance(compile, str):
        from torch._dynamo import list_backends

        if compile not in list_backends(exclude_tags=()):  # (the debugging ones too)
            raise ValueError(
                f"compile={compile!r} is not a torch.compile backend: compile=True (inductor) "
                f"or one of {', '.join(list_backends())}, or for debugging 'aot_eager' or "
                f"'eager' (torch._dynamo.list_backends(exclude_tags=()) lists them all)"
            )


def _compare_with_own_checkpointing(model: nn.Module, inputs: tuple[Any, Any], made: Plan,
                                    loss_fn: LossFn | None, autocast: Any) -> None:  # fmt: skip
    """For a model that checkpoints itself (the plan turns that off): add the warning
    ``"own_checkpointing"`` to ``made`` when the plan's step peaks above the model's as given
    (its own checkpointing on), the budget's percentages being of its peak with it off."""
    if not switched_on(model) or made.estimated_peak is None or made.baseline_peak is None:
        return
    args, kwargs = inputs
    step = Step(model, args, kwargs, loss_fn, step_autocast(autocast, model))
    meta = any(p.device.type == "meta" for p in model.parameters())
    own = Rehearsal(step, "meta" if meta else "real").peak(None)
    if made.estimated_peak > own:
        name = type(model).__name__
        made.warnings["own_checkpointing"] = (
            f"{name} checkpoints itself, and as given its step peaks at {format_size(own)}; "
            f"this plan, which turns that off, at {format_size(made.estimated_peak)} (a budget "
            f"in % is of the peak without any checkpointing, {format_size(made.baseline_peak)}"
            f"): keep the model's own checkpointing instead, or plan with "
            f"budget={own} or lower for less than it"
        )

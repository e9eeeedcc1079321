"""A fixed batch's plan for a device: the cheapest plan whose whole training step fits it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from autoremat.core.devices import model_device
from autoremat.core.sizes import format_size
from autoremat.costs.profile import profile
from autoremat.planning.plan import plan_from_profile, profile_lowest
from autoremat.planning.plans import Plan
from autoremat.planning.strategies.budget import BudgetTooLow
from autoremat.record.step import Autocast, LossFn, autocast_spec
from autoremat.training.device_model import device_model
from autoremat.training.optimizer_memory import OptimizerLike, optimizer_memory
from autoremat.training.step_memory import step_memory

__all__ = ["plan_for_device"]


def plan_for_device(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    device_memory: int | float | str,
    optimizer: OptimizerLike = "adamw",
    loss_fn: LossFn | None = None,
    selective: bool = True,
    objective: str = "time",
    autocast: Autocast | torch.dtype | None = None,
) -> Plan:
    """The cheapest plan whose whole training step (:mod:`autoremat.training.step_memory`) fits
    ``device_memory`` at these inputs: a budget plan whose budget is what the device leaves for the
    step once parameters, buffers, inputs and ``optimizer``'s state are in it (and, on CUDA, the
    runtime and the allocator's share, :mod:`autoremat.training.device_model`). An empty plan when
    no recompute is needed. Profiles one step (on ``meta`` too).

    Raises:
        BudgetTooLow: (a ValueError) the step does not fit even with the most recompute; the
            message gives the device memory it needs then, and ``lowest`` is that step's
            lowest peak (activations).
    """
    device = model_device(model)
    spec = autocast_spec(autocast, model)
    prof = profile(model, args, kwargs, loss_fn=loss_fn, autocast=spec)
    dm = device_model(device_memory, device)
    memory = step_memory(model, (args, kwargs), prof.peak, optimizer_memory(model, optimizer), dm)
    room = dm.for_tensors() - memory.resident
    lowest = profile_lowest(prof, selective=selective, objective=objective)
    if room < max(lowest, memory.gradients + memory.optimizer_step):
        need = dataclasses.replace(memory, step_peak=lowest)
        raise BudgetTooLow(
            f"{type(model).__name__}'s training step does not fit {dm}: with the most "
            f"recompute it needs {format_size(need.device)}:\n{need}\nUse a smaller batch, "
            f"{'' if spec else 'mixed precision, '}an optimizer with less state, or a device "
            f"with more memory",
            lowest,
            prof.peak,
        )
    budget: int | float = 1.0 if room >= prof.peak else room
    return plan_from_profile(model, prof, budget, selective=selective, objective=objective)

"""A fixed batch's plan for a device: the cheapest plan whose whole training step fits it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from autoremat.core.devices import model_device
from autoremat.core.sizes import format_size
from autoremat.costs.profile import Profile, profile
from autoremat.planning.plan import plan_from_profile, profile_lowest
from autoremat.planning.plans import Plan
from autoremat.planning.strategies.budget import BudgetTooLow
from autoremat.record.memory import cpu_allocator_countable
from autoremat.record.step import Autocast, LossFn, step_autocast
from autoremat.training.device_model import device_model
from autoremat.training.optimizer_memory import OptimizerLike, optimizer_memory
from autoremat.training.per_rank import RankStep, ShardingLike, plan_for_rank
from autoremat.training.sharding import sharding_of
from autoremat.training.step_memory import checkpoint_state, step_memory

__all__ = ["plan_fitting", "plan_for_device"]


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
    reserve: int | str = 0,
    world_size: int = 1,
    sharding: ShardingLike = None,
    fsdp_units: list[str] | tuple[str, ...] | None = None,
    reshard_after_forward: bool = True,
) -> Plan:
    """The cheapest plan whose whole training step (:mod:`autoremat.training.step_memory`) fits
    ``device_memory`` at these inputs: a budget plan whose budget is what the device leaves for the
    step once parameters, buffers, inputs and ``optimizer``'s state are in it (and, on CUDA, the
    runtime and the allocator's share, :mod:`autoremat.training.device_model`; on the CPU the
    RNG state each checkpoint keeps, and kernels' scratch: the step is profiled by the CPU
    allocator, ``profile(memory="allocator")``; ``reserve``, bytes or a size, left free). An
    empty plan when no recompute is needed. Profiles one step (on ``meta`` too, by tensors).
    Per rank (``world_size``, ``sharding`` ... as :func:`autoremat.predict_training` takes
    them): :func:`autoremat.training.per_rank.plan_for_rank`, by tensors.

    Raises:
        BudgetTooLow: (a ValueError) the step does not fit even with the most recompute; the
            message gives the device memory it needs then, and ``lowest`` is that step's
            lowest peak (activations).
    """
    device = model_device(model)
    spec = step_autocast(autocast, model)
    ranks = sharding_of(model, world_size, sharding, fsdp_units, reshard_after_forward)
    if ranks is not None:
        prof = profile(model, args, kwargs, loss_fn=loss_fn, autocast=spec)
        step = RankStep(model, (args, kwargs or {}), prof, ranks, optimizer, loss_fn, spec)
        dm = device_model(device_memory, device, reserve)
        return plan_for_rank(step, dm, selective, objective)[0]
    memory = "allocator" if cpu_allocator_countable(device) else "tensors"
    prof = profile(model, args, kwargs, loss_fn=loss_fn, autocast=spec, memory=memory)
    dm = device_model(device_memory, device, reserve)
    whole = step_memory(model, (args, kwargs), prof.peak, optimizer_memory(model, optimizer), dm)
    room = dm.for_tensors() - whole.resident
    lowest = profile_lowest(prof, selective=selective, objective=objective)
    if room < max(lowest, whole.gradients + whole.optimizer_step):
        need = dataclasses.replace(whole, step_peak=lowest)
        raise BudgetTooLow(
            f"{type(model).__name__}'s training step does not fit {dm}: with the most "
            f"recompute it needs {format_size(need.device)}:\n{need}\nUse a smaller batch, "
            f"{'' if spec else 'mixed precision, '}an optimizer with less state, or a device "
            f"with more memory",
            lowest,
            prof.peak,
        )
    if room >= prof.peak:
        return plan_from_profile(model, prof, 1.0, selective=selective, objective=objective)
    return plan_fitting(model, prof, room, dm.rng_state, selective, objective)


def plan_fitting(
    model: nn.Module,
    prof: Profile,
    room: int,
    rng_state: int,
    selective: bool = True,
    objective: str = "time",
    fallback: Plan | None = None,
) -> Plan:
    """The cheapest plan from ``prof`` whose step peak, with what its checkpoints keep (the
    ``rng_state`` bytes each, the buffer copies: :func:`checkpoint_state`), fits ``room``:
    planned at ``room`` less what the plan before kept, up to three times; then ``fallback``
    (a plan known to fit) or the last plan.

    Raises:
        BudgetTooLow: ``room`` is below the lowest budget, and no ``fallback``.
    """
    kept, tried = 0, None
    for _ in range(3):
        try:
            tried = plan_from_profile(
                model, prof, room - kept, selective=selective, objective=objective
            )
        except BudgetTooLow:
            break
        kept = checkpoint_state(tried, prof, rng_state)
        if (tried.estimated_peak or 0) + kept <= room:
            return tried
    chosen = fallback or tried
    if chosen is None:  # (raises BudgetTooLow: the room is below the lowest budget)
        return plan_from_profile(model, prof, room, selective=selective, objective=objective)
    return chosen

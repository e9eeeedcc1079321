"""One rank's training step memory under DDP or FSDP2, and the cheapest plan that fits it.

The whole step's arithmetic (:mod:`autoremat.training.step_memory`) holds per rank, with
each strategy's parts (:mod:`autoremat.training.sharding`):

* **DDP**: the one-device figures at the rank's batch, plus DDP's gradient buckets (one
  more copy of the trainable parameters, resident);
* **FSDP2**: the parameters, gradients and optimizer state of rank 0's shards (the largest),
  and a step peak that counts what FSDP2 gathers and frees: all of it from the step run on
  fake tensors over a fake process group (:mod:`autoremat.training.rank_emulation`).

:func:`rank_step_memory` adds them up for a plan (or none); :func:`plan_for_rank` finds the
cheapest plan whose rank step fits a device: the budget planner's room less what sharding
adds to the step peak, checked by the emulation and lowered by what it was over, up to four
times. Nothing runs on a device and no rank is needed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from autoremat.core.sizes import format_size
from autoremat.costs.profile import Profile
from autoremat.planning.plan import plan_from_profile, profile_lowest
from autoremat.planning.plans import Plan
from autoremat.planning.strategies.budget import BudgetTooLow
from autoremat.record.step import Autocast, LossFn
from autoremat.training.device_model import DeviceModel
from autoremat.training.optimizer_memory import OptimizerLike, optimizer_memory, optimizer_memory_of
from autoremat.training.rank_emulation import emulate_fsdp2
from autoremat.training.sharding import Sharding
from autoremat.training.step_memory import (
    StepMemory,
    buffer_copies,
    checkpointed_calls,
    step_memory,
)

__all__ = ["RankStep", "ShardingLike", "plan_for_rank", "rank_step_memory"]

ShardingLike = str | Sharding | None


@dataclasses.dataclass(frozen=True)
class RankStep:
    """How a rank's step is run and priced: the model's ``inputs`` at one rank's batch,
    ``prof`` (the unsharded step's profile there), the ``sharding``, the ``optimizer``, the
    loss and autocast as :func:`autoremat.profile` takes them."""

    model: nn.Module
    inputs: tuple[Any, dict[str, Any]]
    prof: Profile
    sharding: Sharding
    optimizer: OptimizerLike = "adamw"
    loss_fn: LossFn | None = None
    autocast: Autocast | None = None


def rank_step_memory(
    step: RankStep, plan: Plan | None, dm: DeviceModel | None = None
) -> StepMemory:
    """The :class:`~autoremat.training.step_memory.StepMemory` of one rank with ``plan``
    applied (``None``: the model's own step; an empty plan: the same), on ``dm``."""
    calls, copies = checkpointed_calls(plan, step.prof), buffer_copies(plan, step.prof)
    if step.sharding.strategy == "ddp":
        estimate = None if plan is None else plan.estimated_peak
        peak = step.prof.peak if estimate is None else estimate
        opt = optimizer_memory(step.model, step.optimizer)
        whole = step_memory(step.model, step.inputs, peak, opt, dm, calls, copies)
        return dataclasses.replace(whole, buckets=whole.gradients, sharding=str(step.sharding))
    rank = emulate_fsdp2(step.model, step.inputs, step.sharding, plan or None, step.loss_fn,
                         step.autocast)  # fmt: skip
    opt = optimizer_memory_of(list(rank.shards), step.optimizer)
    whole = step_memory(step.model, step.inputs, rank.step_peak, opt, dm, calls, copies)
    return dataclasses.replace(whole, parameters=rank.parameters, gradients=rank.gradients,
                               sharding=str(step.sharding))  # fmt: skip


def plan_for_rank(
    step: RankStep,
    dm: DeviceModel,
    selective: bool = True,
    objective: str = "time",
    known: tuple[StepMemory, Plan, StepMemory] | None = None,
) -> tuple[Plan, StepMemory]:
    """The cheapest plan whose rank step (:func:`rank_step_memory`) fits ``dm``, and that
    step's memory; an empty plan when none is needed (module docstring). ``known``: the rank
    step without a plan, the plan at the lowest budget and its rank step, when already
    priced (on ``dm``, with this ``objective``), not emulated again.

    Raises:
        BudgetTooLow: even the lowest plan's rank step does not fit (the message gives what
            it needs).
    """
    model, prof = step.model, step.prof
    plain = rank_step_memory(step, None, dm) if known is None else known[0]
    if plain.device <= dm.limit:
        return plan_from_profile(model, prof, 1.0, selective=selective, objective=objective), plain
    lowest = profile_lowest(prof, selective=selective, objective=objective)
    if known is None:
        least = plan_from_profile(model, prof, lowest, selective=selective, objective=objective)
        floor = rank_step_memory(step, least, dm)
    else:
        least, floor = known[1], known[2]
    if floor.device > dm.limit:
        raise BudgetTooLow(
            f"{type(model).__name__}'s training step does not fit {dm} per rank "
            f"({step.sharding}): with the most recompute it needs "
            f"{format_size(floor.device)}:\n{floor}\nUse a smaller batch per rank, more "
            f"ranks{', or FSDP2 over DDP' * (step.sharding.strategy == 'ddp')}",
            lowest,
            prof.peak,
        )
    added = plain.step_peak - prof.peak  # what sharding adds to the step peak (FSDP2 gathers)
    room = dm.for_tensors() - plain.resident - added
    for _ in range(4):
        if room <= lowest:
            break
        tried = plan_from_profile(model, prof, room, selective=selective, objective=objective)
        memory = rank_step_memory(step, tried, dm)
        if memory.device <= dm.limit:
            return tried, memory
        room -= memory.device - dm.limit
    return least, floor


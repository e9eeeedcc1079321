"""One rank's training step memory under DDP or FSDP2, and the cheapest plan that fits it.

The whole step's arithmetic (:mod:`autoremat.training.step_memory`) holds per rank, with
each strategy's parts (:mod:`autoremat.training.sharding`):

* **DDP**: the one-device figures at the rank's batch (the step run with the plan, or as
  the model trains without one: :mod:`autoremat.planning.rehearsal`), plus DDP's gradient
  buckets (one more copy of the trainable parameters, resident);
* **FSDP2**: the parameters, gradients and optimizer state of rank 0's shards (the largest),
  and a step peak that counts what FSDP2 gathers and frees: all of it from the step run on
  fake tensors over a fake process group (:mod:`autoremat.training.rank_emulation`).

:func:`rank_step_memory` adds them up for a plan (or none); :class:`RankPlanner` finds the
cheapest plan whose rank step fits a device: the budget planner's search
(:mod:`autoremat.planning.search`) from the room the device leaves less what sharding adds to
the step peak, each plan judged by its rank step. Nothing runs on a device and no rank is
needed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from autoremat.core.sizes import format_size
from autoremat.costs.profile import Profile
from autoremat.planning.plan import planned
from autoremat.planning.plans import Plan
from autoremat.planning.rehearsal import PlanFields, Rehearsal, rehearsal_for
from autoremat.planning.search import Chosen
from autoremat.planning.strategies.budget import BudgetTooLow, Planner, fields_for
from autoremat.planning.strategy import Request
from autoremat.record.step import Autocast, LossFn
from autoremat.training.device_model import DeviceModel
from autoremat.training.optimizer_memory import OptimizerLike, optimizer_memory, optimizer_memory_of
from autoremat.training.rank_emulation import emulate_fsdp2
from autoremat.training.sharding import Sharding
from autoremat.training.step_memory import StepMemory, buffer_copies, step_memory

__all__ = ["RankPlanner", "RankStep", "plan_for_rank", "rank_step_memory"]


@dataclasses.dataclass(frozen=True)
class RankStep:
    """How a rank's step is run and priced: the model's ``inputs`` at one rank's batch,
    ``prof`` (the unsharded step's profile there, to plan from; ``None`` to price a plan
    made already), the ``sharding``, the ``optimizer``, the loss and autocast as
    :func:`autoremat.profile` takes them; ``device``: where the rank trains, for how its step
    is counted (by default the model's)."""

    model: nn.Module
    inputs: tuple[Any, dict[str, Any]]
    prof: Profile | None
    sharding: Sharding
    optimizer: OptimizerLike = "adamw"
    loss_fn: LossFn | None = None
    autocast: Autocast | None = None
    device: str | None = None


def rank_step_memory(
    step: RankStep, plan: PlanFields | None, dm: DeviceModel | None = None,
    rehearsal: Rehearsal | None = None,
) -> StepMemory:  # fmt: skip
    """The :class:`~autoremat.training.step_memory.StepMemory` of one rank with ``plan``
    applied (``None``: the model's own step, as it trains without a plan), on ``dm``; DDP's
    one-device step run by ``rehearsal`` (by default the profile's)."""
    tree = step.prof.module_tree if step.prof is not None else None
    copies = buffer_copies(plan.modules if plan else (), step.model, tree)
    if step.sharding.strategy == "ddp":
        assert rehearsal is not None or step.prof is not None, "a profile or a rehearsal"
        peak = (rehearsal or rehearsal_for(step.prof, step.device)).peak(plan)  # type: ignore[arg-type]
        opt = optimizer_memory(step.model, step.optimizer)
        whole = step_memory(step.model, step.inputs, peak, opt, dm, copies)
        return dataclasses.replace(whole, buckets=whole.gradients, sharding=str(step.sharding))
    rank = emulate_fsdp2(step.model, step.inputs, step.sharding, plan, step.loss_fn,
                         step.autocast, step.device)  # fmt: skip
    opt = optimizer_memory_of(list(rank.shards), step.optimizer)
    whole = step_memory(step.model, step.inputs, rank.step_peak, opt, dm, copies)
    return dataclasses.replace(whole, parameters=rank.parameters, gradients=rank.gradients,
                               sharding=str(step.sharding))  # fmt: skip


class RankPlanner:
    """The cheapest plan whose rank step (:func:`rank_step_memory`) fits ``dm`` (module
    docstring), each plan's rank step found once."""

    def __init__(self, step: RankStep, dm: DeviceModel, selective: bool = True,
                 objective: str = "time", rehearsal: Rehearsal | None = None) -> None:  # fmt: skip
        assert step.prof is not None, "a rank's plans are made from a profile"
        self.step, self.dm, self.prof = step, dm, step.prof
        self.rehearsal = rehearsal or rehearsal_for(step.prof, step.device)
        request = Request(type(step.model).__name__, None, 1, None, selective, objective)
        self.planner = Planner(step.prof, request, self.rehearsal)
        self.seen: dict[Any, StepMemory] = {}

    def memory(self, chosen: Chosen | PlanFields | None) -> StepMemory:
        """The rank's step with ``chosen`` recomputed (items or a plan's entries; ``None``:
        the model's own step)."""
        fields = chosen
        if isinstance(chosen, tuple):
            fields = fields_for(self.prof, list(chosen))
        key = None if fields is None else fields.key()  # type: ignore[union-attr]
        if key not in self.seen:
            self.seen[key] = rank_step_memory(self.step, fields, self.dm, self.rehearsal)  # type: ignore[arg-type]
        return self.seen[key]

    def lowest(self) -> StepMemory:
        """The rank's step with the lowest plan the planner makes."""
        return self.memory(self.planner.lowest()[0])

    def bound(self) -> None:
        """No quick bound of a rank's step (its gathers are not in the walk)."""
        return None

    def plan(self) -> tuple[Plan, StepMemory]:
        """The cheapest plan that fits and its rank step; an empty plan when the model's own
        step fits.

        Raises:
            BudgetTooLow: even the lowest plan's rank step does not fit (the message gives
                what it needs).
        """
        step, dm = self.step, self.dm
        plain = self.memory(None)
        added = plain.step_peak - self.prof.peak  # what sharding adds (FSDP2's gathers)
        room = dm.for_tensors() - plain.resident - added
        if plain.device <= dm.limit:
            room = max(room, self.prof.peak)
        judge = lambda chosen: self.memory(chosen).device - dm.limit  # noqa: E731
        found = planned(step.model, self.planner, room, judge, self.too_low)
        return found, self.memory(PlanFields(found.modules, found.selective, found.calls))

    def too_low(self) -> BudgetTooLow:
        floor, step = self.lowest(), self.step
        return BudgetTooLow(
            f"{type(step.model).__name__}'s training step does not fit {self.dm} per rank "
            f"({step.sharding}): with the most recompute it needs "
            f"{format_size(floor.device)}:\n{floor}\nUse a smaller batch per rank, more "
            f"ranks{', or FSDP2 over DDP' * (step.sharding.strategy == 'ddp')}",
            floor.step_peak,
            self.prof.peak,
        )


def plan_for_rank(
    step: RankStep, dm: DeviceModel, selective: bool = True, objective: str = "time"
) -> tuple[Plan, StepMemory]:
    """:meth:`RankPlanner.plan`."""
    return RankPlanner(step, dm, selective, objective).plan()

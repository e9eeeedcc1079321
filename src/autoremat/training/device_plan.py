"""A fixed batch's plan for a device: the cheapest plan whose whole training step fits it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoremat.core.devices import model_device
from autoremat.core.sizes import format_size
from autoremat.costs.profile import Profile, profile
from autoremat.planning.plan import planned
from autoremat.planning.plans import Plan
from autoremat.planning.rehearsal import Rehearsal, rehearsal_for
from autoremat.planning.search import Chosen
from autoremat.planning.strategies.budget import BudgetTooLow, Planner, fields_for
from autoremat.planning.strategy import Request
from autoremat.record.memory import cpu_allocator_countable
from autoremat.record.step import Autocast, LossFn, step_autocast
from autoremat.training.device_model import DeviceModel, device_model
from autoremat.training.optimizer_memory import OptimizerLike, OptimizerMemory, optimizer_memory
from autoremat.training.per_rank import RankStep, plan_for_rank
from autoremat.training.sharding import Sharding, sharding_of
from autoremat.training.step_memory import StepMemory, buffer_copies, step_memory

__all__ = ["DevicePlanner", "device_plan"]


def device_plan(
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
    sharding: Sharding | None = None,
) -> Plan:
    """The cheapest plan whose whole training step (:mod:`autoremat.training.step_memory`) fits
    ``device_memory`` at these inputs: parameters, buffers, inputs, ``optimizer``'s state and
    the step's peak with the plan, its step run (on CUDA with what the runtime and the
    allocator add, :mod:`autoremat.training.device_model`; on the CPU counted by its allocator,
    kernels' scratch included; ``reserve``, bytes or a size, left free). An empty plan when no
    recompute is needed. Profiles one step (on ``meta`` too, by tensors). Per rank
    (``sharding``, a :class:`~autoremat.Sharding`):
    :func:`autoremat.training.per_rank.plan_for_rank`, by tensors.

    Raises:
        BudgetTooLow: (a ValueError) the step does not fit even with the most recompute; the
            message gives the device memory it needs then, and ``lowest`` is that step's
            lowest peak (activations).
    """
    device = model_device(model)
    spec = step_autocast(autocast, model)
    ranks = sharding_of(model, sharding)
    dm = device_model(device_memory, device, reserve)
    prof = profile(model, args, kwargs, loss_fn=loss_fn, autocast=spec)
    if ranks is not None:
        step = RankStep(model, (args, kwargs or {}), prof, ranks, optimizer, loss_fn, spec)
        return plan_for_rank(step, dm, selective, objective)[0]
    memory = "allocator" if cpu_allocator_countable(device) else "tensors"
    found = DevicePlanner(model, prof, dm, optimizer_memory(model, optimizer),
                          rehearsal_for(prof, memory=memory), selective, objective)  # fmt: skip
    return found.plan()


class DevicePlanner:
    """The cheapest plan for ``model`` whose whole step fits device ``dm``, from ``prof`` (a
    profile of it, or of its shadow at another batch) and the optimizer's memory ``opt``,
    each plan's step run by ``rehearsal``; ``inputs`` the step's (by default the profile's)."""

    def __init__(self, model: nn.Module, prof: Profile, dm: DeviceModel, opt: OptimizerMemory,
                 rehearsal: Rehearsal, selective: bool = True, objective: str = "time",
                 inputs: Any = None) -> None:  # fmt: skip
        self.model, self.prof, self.dm, self.opt = model, prof, dm, opt
        self.inputs = inputs if inputs is not None else _inputs(prof)
        request = Request(type(model).__name__, None, 1, None, selective, objective)
        self.planner = Planner(prof, request, rehearsal)
        self.scratch = rehearsal.way == "allocator"

    def memory(self, chosen: Chosen) -> StepMemory:
        """The whole step's memory with ``chosen`` recomputed, its step run."""
        entries = fields_for(self.prof, list(chosen)).modules
        copies = buffer_copies(entries, self.model, self.prof.module_tree)
        peak = self.planner.peak(chosen)
        return step_memory(self.model, self.inputs, peak, self.opt, self.dm, copies, self.scratch)

    def plan(self) -> Plan:
        """The cheapest plan that fits (none when none is needed).

        Raises:
            BudgetTooLow: even the lowest plan's step does not fit (the message gives it).
        """
        room = self.dm.for_tensors() - self.memory(()).resident
        judge = lambda chosen: self.memory(chosen).device - self.dm.limit  # noqa: E731
        return planned(self.model, self.planner, room, judge, self.too_low)

    def planned(self) -> tuple[Plan, StepMemory]:
        """:meth:`plan`, and its whole step's memory."""
        made = self.plan()
        copies = buffer_copies(made.modules, self.model, self.prof.module_tree)
        peak = self.prof.peak if made.estimated_peak is None else made.estimated_peak
        return made, step_memory(self.model, self.inputs, peak, self.opt, self.dm, copies,
                                 self.scratch)  # fmt: skip

    def lowest(self) -> StepMemory:
        """The whole step's memory with the lowest plan the planner makes."""
        return self.memory(self.planner.lowest()[0])

    def bound(self) -> StepMemory | None:
        """:meth:`lowest` guessed without running anything: the walk's lowest plan at the
        walk's own price (most often at or above its run, not always); ``None`` when the
        plans' steps are counted by the allocator, which the walk does not see."""
        if self.scratch:
            return None
        walk = self.planner.walk
        floor = walk.plan(walk.lowest)
        if floor is None:
            return None
        copies = buffer_copies(fields_for(self.prof, list(floor)).modules, self.model,
                               self.prof.module_tree)  # fmt: skip
        peak = walk.price(floor)
        return step_memory(self.model, self.inputs, peak, self.opt, self.dm, copies)

    def too_low(self) -> BudgetTooLow:
        need = self.lowest()
        return BudgetTooLow(
            f"{type(self.model).__name__}'s training step does not fit {self.dm}: with the "
            f"most recompute it needs {format_size(need.device)}:\n{need}\nUse a smaller "
            f"batch, {'' if self.prof.step and self.prof.step.autocast else 'mixed precision, '}"
            f"an optimizer with less state, or a device with more memory",
            need.step_peak,
            self.prof.peak,
        )


def _inputs(prof: Profile) -> Any:
    step = prof.step
    return () if step is None else (step.args, step.kwargs)


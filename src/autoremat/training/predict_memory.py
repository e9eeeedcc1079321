"""Predicting the whole training step's memory (:class:`~autoremat.training.step_memory.StepMemory`)
of a model on example inputs, with a plan's estimate or the model's own step profiled."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoremat.core.devices import model_device
from autoremat.planning.plans import Plan
from autoremat.planning.rehearsal import PlanFields, Rehearsal
from autoremat.record.step import Autocast, LossFn, Step, step_autocast
from autoremat.training.device_model import device_model
from autoremat.training.optimizer_memory import OptimizerLike, optimizer_memory
from autoremat.training.per_rank import RankStep, rank_step_memory
from autoremat.training.sharding import Sharding, sharding_of
from autoremat.training.step_memory import StepMemory, buffer_copies, step_memory

__all__ = ["predict_memory"]


def predict_memory(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    optimizer: OptimizerLike = "adamw",
    plan: Plan | None = None,
    loss_fn: LossFn | None = None,
    device_memory: int | float | str | None = None,
    autocast: Autocast | torch.dtype | None = None,
    sharding: Sharding | None = None,
) -> StepMemory:
    """The whole training step's memory of ``model`` on these inputs with ``optimizer`` (a
    name of :data:`autoremat.training.optimizer_memory.OPTIMIZERS`, an optimizer to copy, a function
    from parameters to one, or ``None``): the step run with ``plan`` applied (once, on the
    model's device, or on ``meta``: :mod:`autoremat.planning.rehearsal`; a model wrapped with
    the plan already runs as it is), its checkpoints' RNG states counted; without a plan,
    as the model trains (a Hugging Face model fills its key/value cache, a model that
    checkpoints itself does). On ``meta`` too: a model and inputs on ``meta`` give what real
    ones would. With ``autocast``, a dtype or ``(device_type, dtype)``, forward and loss run
    under autocast, emulated on ``meta`` (:mod:`autoremat.record.autocast_meta`). With
    ``device_memory`` (as :func:`autoremat.fit` takes it), ``device`` counts what the
    device's runtime and allocator add. Nothing is changed.

    Per rank of a job: ``sharding``, a :class:`~autoremat.Sharding` (DDP or FSDP2 over its
    ranks; :mod:`autoremat.training.sharding`), ``args``/``kwargs`` one rank's batch: the step is
    priced as :mod:`autoremat.training.per_rank` does (FSDP2 run on fake tensors over a fake
    process group, outside any initialised one).
    """
    spec = sharding_of(model, sharding)
    cast = step_autocast(autocast, model)
    device = model_device(model)
    dm = None if device_memory is None else device_model(device_memory, device)
    fields = None if plan is None else PlanFields(plan.modules, plan.selective, plan.calls)
    step = Step(model, args, kwargs or {}, loss_fn, cast)
    run = Rehearsal(step, "meta" if device.type == "meta" else "real")
    if spec is not None:
        rank = RankStep(model, (args, kwargs or {}), None, spec, optimizer, loss_fn, cast)
        return rank_step_memory(rank, fields, dm, run)
    copies = buffer_copies(fields.modules if fields else (), model, plan.tree if plan else None)
    opt = optimizer_memory(model, optimizer)
    return step_memory(model, (args, kwargs), run.peak(fields), opt, dm, copies)

"""Predicting the whole training step's memory (:class:`~autoremat.training.step_memory.StepMemory`)
of a model on example inputs, with a plan's estimate or the model's own step profiled."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoremat.core.devices import model_device
from autoremat.costs.profile import profile
from autoremat.planning.plans import Plan
from autoremat.record.step import Autocast, LossFn, step_autocast
from autoremat.training.device_model import device_model
from autoremat.training.optimizer_memory import OptimizerLike, optimizer_memory
from autoremat.training.per_rank import RankStep, ShardingLike, rank_step_memory
from autoremat.training.sharding import sharding_of
from autoremat.training.step_memory import StepMemory, step_memory

__all__ = ["predict_training"]


def predict_training(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    optimizer: OptimizerLike = "adamw",
    plan: Plan | None = None,
    loss_fn: LossFn | None = None,
    device_memory: int | float | str | None = None,
    autocast: Autocast | torch.dtype | None = None,
    world_size: int = 1,
    sharding: ShardingLike = None,
    fsdp_units: list[str] | tuple[str, ...] | None = None,
    reshard_after_forward: bool = True,
) -> StepMemory:
    """The whole training step's memory of ``model`` on these inputs with ``optimizer`` (a
    name of :data:`autoremat.training.optimizer_memory.OPTIMIZERS`, an optimizer to copy, a function
    from parameters to one, or ``None``): with ``plan``, its predicted step peak; without, one
    step of the model as it is, profiled (a Hugging Face model fills its key/value cache, as
    it does with no plan applied). On ``meta`` too: a model and inputs on ``meta`` give what
    real ones would. With ``autocast``, a dtype or ``(device_type, dtype)``, forward and loss
    run under autocast, emulated on ``meta`` (:mod:`autoremat.record.autocast_meta`); a plan's
    estimate is used as it is, so make the plan with the same ``autocast``. With
    ``device_memory`` (as :func:`autoremat.fit` takes it), ``device`` counts what the
    device's runtime and allocator add. Nothing is changed.

    Per rank of a job: ``world_size`` ranks with ``sharding`` ``"ddp"`` or ``"fsdp2"`` (its
    ``fsdp_units``, by default the model's blocks, and ``reshard_after_forward``;
    :mod:`autoremat.training.sharding`), ``args``/``kwargs`` one rank's batch: the step is
    priced as :mod:`autoremat.training.per_rank` does (FSDP2 run on fake tensors over a fake
    process group, outside any initialised one).
    """
    spec = sharding_of(model, world_size, sharding, fsdp_units, reshard_after_forward)
    if spec is not None:
        cast = step_autocast(autocast, model)
        prof = profile(model, args, kwargs, loss_fn=loss_fn, autocast=cast)
        rank = RankStep(model, (args, kwargs or {}), prof, spec, optimizer, loss_fn, cast)
        dm = None if device_memory is None else device_model(device_memory, model_device(model))
        return rank_step_memory(rank, plan, dm)
    if plan is not None and plan.estimated_peak is not None:
        peak = plan.estimated_peak
    else:  # the model's own step: a Hugging Face model fills its cache
        peak = profile(model, args, kwargs, loss_fn=loss_fn, autocast=autocast, hf_cache=True).peak
    device = model_device(model)
    dm = None if device_memory is None else device_model(device_memory, device)
    return step_memory(model, (args, kwargs), peak, optimizer_memory(model, optimizer), dm)

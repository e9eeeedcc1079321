"""The whole training step's memory: what a device must hold, not only the activations.

A budget plan's peak counts what the step creates (activations, gradients, temporaries) above
what was live before it. A device must also hold what was: the parameters, buffers and inputs,
and the optimizer's state; and the optimizer's step needs room of its own. With gradients
freed before each forward (``zero_grad(set_to_none=True)``, the default), the most live at once
in a steady training step is::

    parameters + buffers + optimizer state + inputs
        + max(step peak (activations, gradients included), gradients + optimizer step)

:class:`StepMemory` holds these parts and, for a device, what its runtime and allocator add
(:mod:`autoremat.device_memory`); :func:`step_memory` adds them up from a model, its inputs, the
step peak (a plan's prediction or a profile's) and the optimizer's memory
(:mod:`autoremat.optimizer_memory`). :func:`autoremat.measure_training` measures the same
around real optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoremat.costs import profile
from autoremat.device_memory import DeviceModel, device_model
from autoremat.nested import tensor_bytes
from autoremat.optimizer_memory import OptimizerLike, OptimizerMemory, optimizer_memory
from autoremat.sizes import format_size
from autoremat.step import Autocast, LossFn

if TYPE_CHECKING:
    from autoremat.plans import Plan

__all__ = ["StepMemory", "predict_training", "step_memory"]


@dataclass(frozen=True)
class StepMemory:
    """The parts of a training step's memory, in bytes (module docstring). ``tensors`` is the
    most tensors hold at once; ``device`` what the device shows (runtime and allocator
    included, :class:`~autoremat.device_memory.DeviceModel`; ``tensors`` without one)."""

    parameters: int
    buffers: int
    gradients: int
    optimizer_state: int
    optimizer_step: int
    inputs: int
    step_peak: int
    device_model: DeviceModel | None = None

    @property
    def resident(self) -> int:
        """What is live before the step begins: parameters, buffers, state, inputs."""
        return self.parameters + self.buffers + self.optimizer_state + self.inputs

    @property
    def tensors(self) -> int:
        return self.resident + max(self.step_peak, self.gradients + self.optimizer_step)

    @property
    def device(self) -> int:
        dm = self.device_model
        return self.tensors if dm is None else dm.device_bytes(self.tensors)

    def __str__(self) -> str:
        rows = [
            ("parameters", self.parameters),
            ("buffers", self.buffers),
            ("optimizer state", self.optimizer_state),
            ("inputs", self.inputs),
            ("step peak (activations, gradients)", self.step_peak),
            ("gradients + optimizer step", self.gradients + self.optimizer_step),
            ("tensors at most", self.tensors),
        ]
        if self.device_model is not None and self.device != self.tensors:
            rows.append(("device (runtime, allocator)", self.device))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"  {name:{width}}  {format_size(b):>11}" for name, b in rows)


def step_memory(
    model: nn.Module,
    inputs: Any,
    step_peak: int,
    optimizer: OptimizerMemory,
    device_model: DeviceModel | None = None,
) -> StepMemory:
    """The :class:`StepMemory` of training ``model`` on ``inputs`` (its args and kwargs) with
    an optimizer of that memory, when the step (forward, loss, backward) peaks at
    ``step_peak`` bytes above what was live before it."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    return StepMemory(
        parameters=tensor_bytes(params),
        buffers=tensor_bytes(list(model.buffers())),
        gradients=sum(p.numel() * p.element_size() for p in {id(p): p for p in trainable}.values()),
        optimizer_state=optimizer.state,
        optimizer_step=optimizer.step,
        inputs=tensor_bytes(inputs),
        step_peak=step_peak,
        device_model=device_model,
    )


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
) -> StepMemory:
    """The whole training step's memory of ``model`` on these inputs with ``optimizer`` (a
    name of :data:`autoremat.optimizer_memory.OPTIMIZERS`, an optimizer to copy, a function
    from parameters to one, or ``None``): with ``plan``, its predicted step peak; without, one
    step of the model as it is, profiled (a Hugging Face model fills its key/value cache, as
    it does with no plan applied). On ``meta`` too: a model and inputs on ``meta`` give what
    real ones would. With ``autocast``, a dtype or ``(device_type, dtype)``, forward and loss
    run under autocast, emulated on ``meta`` (:mod:`autoremat.autocast_meta`); a plan's
    estimate is used as it is, so make the plan with the same ``autocast``. With
    ``device_memory`` (as :func:`autoremat.fit` takes it), ``device`` counts what the
    device's runtime and allocator add. Nothing is changed.
    """
    if plan is not None and plan.estimated_peak is not None:
        peak = plan.estimated_peak
    else:  # the model's own step: a Hugging Face model fills its cache
        peak = profile(model, args, kwargs, loss_fn=loss_fn, autocast=autocast, hf_cache=True).peak
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    dm = None if device_memory is None else device_model(device_memory, device)
    return step_memory(model, (args, kwargs), peak, optimizer_memory(model, optimizer), dm)

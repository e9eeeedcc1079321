"""The whole training step's memory: what a device must hold, not only the activations.

A budget plan's peak counts what the step creates (activations, gradients, temporaries) above
what was live before it. A device must also hold what was: the parameters, buffers and inputs,
and the optimizer's state; and the optimizer's step needs room of its own. With gradients
freed before each forward (``zero_grad(set_to_none=True)``, the default), the most live at once
in a steady training step is::

    parameters + buffers + optimizer state + inputs
        + max(step peak (activations, gradients, checkpoints' RNG states) + buffer copies,
              gradients + optimizer step)

(the step peak is a plan's, its step run: :mod:`autoremat.planning.rehearsal`, which counts
the RNG states ``torch.utils.checkpoint`` keeps on the CPU; the buffer copies each
checkpointed call keeps for its recompute, :func:`buffer_copies`, are made outside the
dispatcher, so no tracker sees them).

:class:`StepMemory` holds these parts and, for a device, what its runtime and allocator add
(:mod:`autoremat.training.device_model`); :func:`step_memory` adds them up from a model, its inputs,
the step peak (a plan's step run, or a profile's) and the optimizer's memory
(:mod:`autoremat.training.optimizer_memory`). :func:`autoremat.measure_memory` measures the same
around real optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from autoremat.core.entries import module_of, parse_run
from autoremat.core.nested import tensor_bytes
from autoremat.core.sizes import format_size
from autoremat.record.tree import Node
from autoremat.training.device_model import DeviceModel
from autoremat.training.optimizer_memory import OptimizerMemory

__all__ = ["StepMemory", "buffer_copies", "step_memory"]


@dataclass(frozen=True)
class StepMemory:
    """The parts of a training step's memory, in bytes (module docstring). ``tensors`` is the
    most tensors hold at once; ``device`` what the device shows (runtime and allocator
    included, :class:`~autoremat.training.device_model.DeviceModel`; ``tensors`` without one)."""

    parameters: int
    buffers: int
    gradients: int
    optimizer_state: int
    optimizer_step: int
    inputs: int
    step_peak: int
    device_model: DeviceModel | None = None
    buffer_copies: int = 0
    scratch: bool = False  # the step peak counts kernels' scratch (a profile by the allocator)
    buckets: int = 0  # DDP's gradient buckets (resident from its construction on)
    sharding: str = ""  # per rank of this job (:class:`~autoremat.training.sharding.Sharding`)

    @property
    def resident(self) -> int:
        """What is live before the step begins: parameters, buffers, state, inputs."""
        return self.parameters + self.buffers + self.optimizer_state + self.inputs + self.buckets

    @property
    def tensors(self) -> int:
        step = self.step_peak + self.buffer_copies
        return self.resident + max(step, self.gradients + self.optimizer_step)

    @property
    def device(self) -> int:
        dm = self.device_model
        return self.tensors if dm is None else dm.device_bytes(self.tensors)

    def __str__(self) -> str:
        rows = [
            ("parameters" + " (this rank's shards)" * ("fsdp2" in self.sharding), self.parameters),
            ("buffers", self.buffers),
            ("optimizer state", self.optimizer_state),
            ("inputs", self.inputs),
            *([("DDP's gradient buckets", self.buckets)] if self.buckets else []),
            (f"step peak (activations, gradients{', scratch' * self.scratch})", self.step_peak),
            *([("checkpoints' buffer copies", self.buffer_copies)] if self.buffer_copies else []),
            ("or gradients + optimizer step", self.gradients + self.optimizer_step),
            ("at most (tensors and scratch)" if self.scratch else "tensors at most", self.tensors),
        ]
        if self.device_model is not None and self.device != self.tensors:
            rows.append(("device (runtime, allocator)", self.device))
        width = max(len(name) for name, _ in rows)
        lines = [f"  {name:{width}}  {format_size(b):>11}" for name, b in rows]
        return "\n".join([f"  per rank: {self.sharding}"] * bool(self.sharding) + lines)


def buffer_copies(entries: tuple[str, ...], model: nn.Module, tree: Node | None = None) -> int:
    """The most bytes of buffer copies the checkpoints of plan ``entries`` of ``model`` hold
    at once, an upper bound (:mod:`autoremat.wrap.replay`): each checkpointed call keeps the
    pre-forward value of the buffers its forward changes (BatchNorm's statistics) until its
    last recompute, and its forward and each recompute copy all its modules' buffers while
    they run; so every call's buffers, and the largest call's twice more. A module's entry
    counts one per call (``tree``: the module tree, which says how many; one without it)."""
    if not entries:
        return 0
    modules = dict(model.named_modules())
    calls = {n.path: n.calls for n in tree.walk()} if tree is not None else {}
    sizes = []
    for entry in entries:
        run = parse_run(entry)
        if run is not None:
            owners = list(modules[run[0]].children())[run[1] : run[2]]
        else:
            owners = [modules[module_of(entry)]]
        held = {id(b): b for m in owners for b in m.buffers()}.values()
        count = 1 if "@" in entry or run else max(1, calls.get(entry, 1))
        sizes += [sum(b.numel() * b.element_size() for b in held)] * count
    return sum(sizes) + 2 * max(sizes, default=0)


def step_memory(
    model: nn.Module,
    inputs: Any,
    step_peak: int,
    optimizer: OptimizerMemory,
    device_model: DeviceModel | None = None,
    copies: int = 0,
    scratch: bool = False,
) -> StepMemory:
    """The :class:`StepMemory` of training ``model`` on ``inputs`` (its args and kwargs) with
    an optimizer of that memory, when the step (forward, loss, backward) peaks at
    ``step_peak`` bytes above what was live before it, its checkpoints holding ``copies``
    bytes of buffer copies (:func:`buffer_copies`); ``scratch``: ``step_peak`` counts kernels'
    scratch."""
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
        buffer_copies=copies,
        scratch=scratch,
    )

"""What an optimizer holds and needs: its state, and what its step adds while it runs.

:func:`optimizer_memory` builds the optimizer on *shadow* parameters (the model's shapes and
dtypes on the ``meta`` device: no memory, no copy of the weights) with gradients, runs two
steps under :class:`~autoremat.record.memory.LiveMemory` and reports the bytes of the state it keeps
(SGD with momentum: one buffer per parameter; Adam and AdamW: two, and a step count) and the
most its second step adds on top (the temporaries of a ``foreach`` implementation). Any
``torch.optim`` optimizer is measured the same way; one that cannot step on ``meta`` (a
``fused=True`` one) raises, naming the fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoremat.core.nested import tensor_bytes
from autoremat.record.memory import LiveMemory

__all__ = [
    "OPTIMIZERS",
    "OptimizerLike",
    "OptimizerMemory",
    "optimizer_factory",
    "optimizer_memory",
    "optimizer_memory_of",
]

# What ``optimizer=`` may name.
OPTIMIZERS: dict[str, Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params),
    "adamw": lambda params: torch.optim.AdamW(params),
    "rmsprop": lambda params: torch.optim.RMSprop(params),
    "adagrad": lambda params: torch.optim.Adagrad(params),
}

OptimizerLike = str | torch.optim.Optimizer | Callable[[Iterable[torch.Tensor]], Any] | None


@dataclass(frozen=True)
class OptimizerMemory:
    """``state``: bytes the optimizer keeps between steps; ``step``: the most its step adds
    while it runs, beyond the state."""

    state: int = 0
    step: int = 0


def optimizer_factory(optimizer: OptimizerLike) -> Callable[[Iterable[torch.Tensor]], Any] | None:
    """A function from parameters to a new optimizer like ``optimizer``: a name of
    :data:`OPTIMIZERS` (``"sgd"`` is SGD with momentum), a ``torch.optim.Optimizer`` (the same
    class and defaults), such a function itself, or ``None`` (no optimizer).

    Raises:
        ValueError: an unknown name (the message lists the names).
    """
    if optimizer is None:
        return None
    if isinstance(optimizer, str):
        if optimizer.lower() not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}, a "
                f"torch.optim.Optimizer, or a function from parameters to one"
            )
        return OPTIMIZERS[optimizer.lower()]
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer = _inner(optimizer)
        cls, defaults = type(optimizer), _accepted(type(optimizer), dict(optimizer.defaults))
        return lambda params: cls(params, **defaults)
    return optimizer


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer inside a wrapper that is one too and holds it as ``optimizer``
    (accelerate's ``AcceleratedOptimizer``, which the Hugging Face Trainer hands its
    callbacks): the class to copy is the inner one's, whose constructor takes parameters."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # type: ignore[attr-defined]
    return optimizer


def _accepted(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The ``defaults`` that ``cls.__init__`` takes by name: an optimizer may record defaults
    its own constructor fixes (``AdamW`` records ``decoupled_weight_decay``, which only
    ``Adam`` takes)."""
    params = inspect.signature(cls).parameters  # the constructor's, without self
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return defaults
    return {k: v for k, v in defaults.items() if k in params}


def optimizer_memory(model: nn.Module, optimizer: OptimizerLike) -> OptimizerMemory:
    """The state ``optimizer`` keeps for the trainable parameters of ``model`` and what its
    step adds (module docstring), measured on ``meta`` shadows: ``model`` is not touched.

    Raises:
        ValueError: the optimizer cannot step on ``meta`` (``fused=True``): the message says
            to pass the same optimizer without it, whose state is the same.
    """
    return optimizer_memory_of([p for p in model.parameters() if p.requires_grad], optimizer)


def optimizer_memory_of(params: list[torch.Tensor], optimizer: OptimizerLike) -> OptimizerMemory:
    """:func:`optimizer_memory` for these parameters (their shapes and dtypes: one rank's
    shards under FSDP2, say), each counted once."""
    make = optimizer_factory(optimizer)
    trainable = {id(p): p for p in params}
    if make is None or not trainable:
        return OptimizerMemory()
    shadows = []
    for p in trainable.values():
        shadow = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"))
        shadow.grad = torch.zeros_like(shadow)
        shadows.append(shadow)
    try:
        opt = make(shadows)
        with LiveMemory() as first:
            opt.step()
        with LiveMemory() as second:
            opt.step()
    except RuntimeError as exc:
        raise ValueError(
            f"could not measure the optimizer's memory on meta tensors ({exc}); pass the same "
            f"optimizer without fused=True (its state is the same), or a name: "
            f"{', '.join(OPTIMIZERS)}"
        ) from exc
    state = tensor_bytes([list(entry.values()) for entry in opt.state.values()])
    return OptimizerMemory(state=state, step=max(0, second.peak, first.peak - first.current))

"""One training step, as every part of autoremat runs it: forward, loss, backward.

:func:`train_step` is the step that :func:`autoremat.measure` measures, :func:`autoremat.profile`
records and the comparison harness times: every ``.grad`` set to ``None`` first (as after
``optimizer.zero_grad(set_to_none=True)``), then ``loss_fn(model(*args, **kwargs)).backward()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoremat.core.devices import model_device
from autoremat.core.layerdrop import every_layer
from autoremat.core.measuring import measuring
from autoremat.core.nested import iter_tensors, run_model
from autoremat.record.autocast_meta import MetaAutocast

__all__ = [
    "Autocast",
    "LossFn",
    "Step",
    "StepHow",
    "autocast_for",
    "check_loss",
    "default_loss",
    "leaf_inputs",
    "no_ambient_autocast",
    "step_autocast",
    "train_step",
]

LossFn = Callable[[Any], torch.Tensor]
# (device type, dtype) of torch.autocast: ("cuda", torch.bfloat16)
Autocast = tuple[str, torch.dtype]
# how a training step runs, as train_step takes it: the loss function and the autocast
StepHow = tuple[LossFn | None, Autocast | None]


@dataclass(frozen=True, eq=False)
class Step:
    """One training step as :func:`train_step` runs it: ``model`` on ``args`` and ``kwargs``,
    ``loss_fn`` and ``autocast`` as it takes them. A profile keeps the step it recorded, so
    that a plan made from it can run the same step (:mod:`autoremat.planning.rehearsal`);
    ``mask_answers``: what Hugging Face's mask code decided reading the step's values
    (:func:`autoremat.core.huggingface.mask_answers`), for a step on fake tensors."""

    model: nn.Module = field(repr=False)
    args: Any = field(default=(), repr=False)
    kwargs: dict[str, Any] = field(default_factory=dict, repr=False)
    loss_fn: LossFn | None = None
    autocast: Autocast | None = None
    mask_answers: tuple[bool, ...] = ()


def default_loss(output: Any) -> torch.Tensor:
    """The loss of a model output.

    The output's ``loss`` (a key of a mapping, or an attribute, as on a Hugging Face
    ``ModelOutput``) when there is one and it is a tensor, returned as it is; otherwise the sum
    of every floating-point tensor found in the output (nested tuples, lists, dicts,
    dataclasses; see :func:`autoremat.core.nested.iter_tensors`), each summed with ``.sum()`` into a
    float32 scalar and added, as a float32 scalar.

    Raises:
        ValueError: the output holds no floating-point tensor.
    """
    loss = output.get("loss") if isinstance(output, Mapping) else None
    if loss is None and not isinstance(output, torch.Tensor):
        loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    # each tensor summed, then added, one at a time (sum takes the generator lazily)
    parts = (t.sum(dtype=torch.float32) for _, t in iter_tensors(output) if t.is_floating_point())
    total = next(parts, None)
    if total is None:
        raise ValueError(
            f"default_loss found no floating-point tensor in the model output "
            f"({type(output).__name__}); pass loss_fn=... that turns the output into a scalar"
        )
    return sum(parts, total)


def check_loss(loss: Any) -> torch.Tensor:
    """``loss`` if backward can start from it; else a ``ValueError`` that says how to fix
    ``loss_fn``."""
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"loss_fn returned {type(loss).__name__}, not a tensor; return a scalar tensor "
            f"computed from the model output (e.g. lambda out: out.sum())"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}; backward needs a single "
            f"number: reduce it (e.g. .sum() or .mean()) in loss_fn"
        )
    if not loss.requires_grad:
        raise ValueError("the loss does not require grad: " + (
            "the step ran under torch.inference_mode(), where no graph is recorded; plan and "
            "measure outside it" if torch.is_inference_mode_enabled() else "no parameter or "
            "input it depends on requires grad (all frozen? the model run under torch.no_grad "
            "or with detached outputs?), so there is no backward pass to measure"))  # fmt: skip
    return loss


def autocast_for(model: nn.Module, autocast: Autocast | None) -> Any:
    """The context that runs a forward of ``model`` under ``autocast`` (``(device_type,
    dtype)``): ``torch.autocast``, or on ``meta`` :class:`MetaAutocast` (autocast acts on real
    devices only); none without ``autocast``."""
    if autocast is None:
        return contextlib.nullcontext()
    device_type, dtype = autocast
    if any(p.device.type == "meta" for p in model.parameters()):
        return MetaAutocast(device_type, dtype)
    return _region(device_type, dtype)


@contextlib.contextmanager
def _region(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """``torch.autocast(device_type, dtype)`` with its cast cache empty on entry and exit, as
    an outermost region has it (inside another region, torch keeps the cache until that one
    ends)."""
    torch.clear_autocast_cache()
    try:
        with torch.autocast(device_type, dtype=dtype):
            yield
    finally:
        torch.clear_autocast_cache()


def step_autocast(value: Any, model: nn.Module) -> Autocast | None:
    """``autocast=`` as every function takes it, made ``(device_type, dtype)``: a dtype
    (``torch.bfloat16``: the autocast of the model's device, ``cuda`` for a model on ``meta``);
    ``(device_type, dtype)`` as it is; ``None``: the region the caller runs in (``cuda``
    first, then ``cpu``), else ``None``. Every step runs inside :func:`no_ambient_autocast`, so
    a budget means the same inside a caller's region as with ``autocast=``.

    Raises:
        TypeError: anything else (the message gives the forms).
    """
    match value:
        case torch.dtype():
            device = model_device(model).type
            return ("cuda" if device == "meta" else device, value)
        case tuple((str(), torch.dtype())):
            return value
        case None:
            for device_type in ("cuda", "cpu"):  # (the caller's region: cuda first)
                if torch.is_autocast_enabled(device_type):
                    return device_type, torch.get_autocast_dtype(device_type)
            return None
    raise TypeError(
        f"autocast must be None, a dtype (torch.bfloat16) or (device_type, dtype) such as "
        f"('cuda', torch.bfloat16); got {value!r}"
    )


@contextlib.contextmanager
def no_ambient_autocast() -> Iterator[None]:
    """Autocast off for ``cpu`` and ``cuda`` while a step runs (the step turns it on again
    around its forward and loss, in a region of its own whose cast cache it empties), and the
    block outside every region, as a step outside one runs (why: docs/guide.md, "Fitting a
    device", Autocast: torch empties the cast cache only when the outermost region ends)."""
    ambient = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    with contextlib.ExitStack() as stack:
        for device_type in ambient:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        levels = 0
        if ambient:  # (the nesting count to 0, put back after)
            while torch.autocast_decrement_nesting() >= 0:
                levels += 1
            torch.autocast_increment_nesting()  # (back from -1)
        try:
            yield
        finally:
            for _ in range(levels):
                torch.autocast_increment_nesting()


def leaf_inputs(args: Any, kwargs: Any) -> list[torch.Tensor]:
    """Input tensors that backward would give a ``.grad``: leaves that require grad."""
    found = {id(t): t for _, t in iter_tensors((args, kwargs)) if t.requires_grad and t.is_leaf}
    return list(found.values())


def train_step(
    model: nn.Module,
    args: Any,
    kwargs: dict[str, Any] | None,
    loss_fn: LossFn | None = None,
    *,
    after_forward: Callable[[], Any] | None = None,
    autocast: Autocast | None = None,
) -> torch.Tensor:
    """One training step from ``.grad = None`` (parameters, and input tensors that are leaves
    requiring grad): forward, ``loss_fn`` (:func:`default_loss` when None), backward, with
    gradients enabled whatever the caller's mode. ``after_forward`` runs between the loss and
    backward. With ``autocast`` (``(device_type, dtype)``), forward and loss run under
    :func:`autocast_for` (backward outside, as PyTorch recommends). LayerDrop is off from
    forward to backward (:func:`~autoremat.core.layerdrop.every_layer`: a recompute of a
    stack runs every layer too). Returns the loss, detached.

    Raises:
        ValueError: the loss is not a scalar tensor that requires grad (:func:`check_loss`).
    """
    for t in [*model.parameters(), *leaf_inputs(args, kwargs)]:
        t.grad = None
    with torch.enable_grad(), measuring(), every_layer(model):  # (and the backward's hooks)
        with autocast_for(model, autocast):
            output = run_model(model, args, kwargs)
            loss = check_loss((loss_fn or default_loss)(output))
        if after_forward is not None:
            after_forward()
        loss.backward()
    return loss.detach()

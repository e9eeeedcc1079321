"""Whether a contender trains as the baseline does: one step of each from the same seed, then the
loss, every parameter's gradient and every buffer compared."""

from __future__ import annotations

import math

import torch
from torch import nn

from autoremat.comparison.applied import Args, Kwargs
from autoremat.comparison.contenders import unwrap
from autoremat.record.snapshot import preserved
from autoremat.record.step import LossFn, train_step

__all__ = ["ATOL", "RTOL", "StepResult", "check_grads", "identical", "one_step", "worst_error"]

RTOL = 1e-5
ATOL = 1e-6

# (the detached loss, gradient by parameter name, buffer value by name)
StepResult = tuple[torch.Tensor, dict[str, torch.Tensor | None], dict[str, torch.Tensor]]


def _param_name(name: str) -> str:
    """``name`` without wrapper prefixes such as ``_orig_mod.`` (a compiled module's)."""
    while name.startswith("_orig_mod."):
        name = name.removeprefix("_orig_mod.")
    return name


def one_step(model: nn.Module, args: Args, kwargs: Kwargs, loss_fn: LossFn) -> StepResult:
    """Loss, gradients and buffers after one step from seed 0, parameters and buffers named as
    in the unwrapped model; the model and the global random state are left as found."""
    inner = unwrap(model)
    with torch.random.fork_rng(devices=[]), preserved(inner):
        torch.manual_seed(0)
        loss = train_step(model, args, kwargs, loss_fn)
        grads = {
            _param_name(n): None if p.grad is None else p.grad.detach().clone()
            for n, p in inner.named_parameters()
        }
        buffers = {_param_name(n): b.detach().clone() for n, b in inner.named_buffers()}
    return loss, grads, buffers


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=RTOL, atol=ATOL))


def _relative_error(g: torch.Tensor | None, reference: torch.Tensor | None) -> float:
    """``||g - reference|| / ||reference||`` (Frobenius); ``inf`` when only one is None."""
    if g is None or reference is None or g.shape != reference.shape:
        return math.inf
    norm = float(reference.double().norm())
    diff = float((g.double() - reference.double()).norm())
    return diff / norm if norm else (0.0 if diff == 0 else math.inf)


def _moved_buffers(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """Names of the buffers in both whose values differ (floating-point ones beyond the
    tolerances)."""
    return [
        name
        for name in before
        if name in after
        and not (
            torch.equal(after[name], before[name])
            or (before[name].is_floating_point() and _close(after[name], before[name]))
        )
    ]


def check_grads(reference: StepResult, result: StepResult) -> tuple[bool, list[str]]:
    """Whether ``result`` matches ``reference``: the loss and every gradient within
    ``rtol=RTOL, atol=ATOL`` (a gradient that is ``None`` in one only differs). Also notes on
    what differs: the loss, how many gradients and the worst one by relative error, and
    buffers (which do not make it a mismatch)."""
    loss0, grads0, buffers0 = reference
    loss1, grads1, buffers1 = result
    notes: list[str] = []
    ok = _close(loss1.float(), loss0.float())
    if not ok:
        notes.append(f"loss differs by {float(loss1) - float(loss0):.2g}")
    bad: list[tuple[float, str]] = []
    for name in grads0.keys() | grads1.keys():
        g0, g1 = grads0.get(name), grads1.get(name)
        if g0 is None and g1 is None:
            continue
        if g0 is None or g1 is None or not _close(g1, g0):
            bad.append((_relative_error(g1, g0), name))
    if bad:
        ok = False
        worst = max(bad)
        notes.append(
            f"{len(bad)}/{len(grads0)} grads differ (worst {worst[1]}: "
            f"|g - g_none| / |g_none| = {worst[0]:.2g})"
        )
    moved = _moved_buffers(buffers0, buffers1)
    if moved:
        notes.append(f"{len(moved)} buffers differ after a step (e.g. {moved[0]})")
    return ok, notes


def worst_error(reference: StepResult, result: StepResult) -> float:
    """The largest relative error (:func:`_relative_error`, Frobenius) of the loss and of any
    parameter gradient of ``result`` against ``reference``: 0.0 when all are equal, about
    1e-7..1e-5 for float rounding (other kernels, other fusion), about 1 for another
    computation (other dropout masks)."""
    errors = [_relative_error(result[0].double(), reference[0].double())]
    for name in reference[1].keys() | result[1].keys():
        g0, g1 = reference[1].get(name), result[1].get(name)
        if g0 is not None or g1 is not None:
            errors.append(_relative_error(g1, g0))
    return max(errors)


def identical(reference: StepResult, result: StepResult) -> bool:
    """Whether ``result`` has ``reference``'s loss, every gradient and every buffer, bit for
    bit (the same parameters and buffers by name, a gradient ``None`` in both or in neither)."""
    loss0, grads0, buffers0 = reference
    loss1, grads1, buffers1 = result
    if grads0.keys() != grads1.keys() or buffers0.keys() != buffers1.keys():
        return False
    if not torch.equal(loss0, loss1):
        return False
    for name, g in grads0.items():
        h = grads1[name]
        if (g is None) != (h is None):
            return False
        if g is not None and h is not None and not torch.equal(g, h):
            return False
    return all(torch.equal(b, buffers1[name]) for name, b in buffers0.items())

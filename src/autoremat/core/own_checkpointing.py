"""A model's own activation checkpointing, as the libraries switch it on.

transformers (``gradient_checkpointing_enable()``), diffusers (``enable_gradient_checkpointing()``)
and timm (``set_grad_checkpointing(True)``) each set a plain boolean attribute on the modules
that then checkpoint their blocks: ``gradient_checkpointing`` (transformers, diffusers) or
``grad_checkpointing`` (timm). A model planned with it on would recompute twice over (its own
checkpoint around autoremat's), and its profile would record the model's own recomputes.

autoremat turns those switches off while it profiles a model (:func:`switched_off`), and while
a plan is applied (:func:`autoremat.wrap.apply`; :func:`autoremat.wrap.remove` turns them
back on): the plan's recompute replaces the model's own. The training reproduced is the one
without either: the same gradients, and statistics (BatchNorm) that move once per step, where
a model's own checkpoint around a BatchNorm block moves them twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from autoremat.core.words import first_few

__all__ = ["SWITCHES", "switched_off", "switched_on", "turned_off_message"]

# The attributes that switch a module's own checkpointing on (transformers and diffusers; timm).
SWITCHES = ("gradient_checkpointing", "grad_checkpointing")


def switched_on(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(path, module, attribute)`` for every switch of ``model`` that is on (``True``): an
    attribute of the module itself, not one a wrapper forwards from the module it wraps (peft's
    ``PeftModel`` answers ``grad_checkpointing`` with its timm model's), which switching would
    leave behind as a new attribute of the wrapper."""
    return [
        (path, m, name)
        for path, m in model.named_modules()
        for name in SWITCHES
        if vars(m).get(name) is True
    ]


@contextlib.contextmanager
def switched_off(model: nn.Module) -> Iterator[list[str]]:
    """While active, every switch of ``model`` that is on is off; then on again (also when the
    body raises). Yields the paths of the modules switched off."""
    found = switched_on(model)
    for _, m, name in found:
        setattr(m, name, False)
    try:
        yield [path for path, _, _ in found]
    finally:
        for _, m, name in found:
            setattr(m, name, True)


def turned_off_message(model: nn.Module, paths: list[str], how: str) -> str:
    """One warning for a model whose own checkpointing autoremat turned off (``how``: for the
    profile, or while the plan is applied); BatchNorm named only for a model that has one."""
    shown = first_few([repr(p or "(root)") for p in paths[:3]], 3, len(paths))
    norms = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    return (
        f"{type(model).__name__} checkpoints itself (its own activation checkpointing is on in "
        f"{len(paths)} module(s): {shown}); autoremat turned it off {how}: the plan's "
        f"recompute replaces it (the same gradients"
        + ("; BatchNorm statistics move once per step)" if norms else ")")
    )

"""Hugging Face models: their key/value cache is turned off while training.

A module with a ``config.use_cache`` and a ``use_cache`` argument (a Hugging Face model) fills a
key/value cache in its forward. A recompute would fill it a second time, so once a model is
wrapped its Hugging Face modules are called with ``use_cache=False`` while training with
gradients, as Hugging Face's own gradient checkpointing does (one warning per class on the
``autoremat`` logger); inference keeps its cache. The profile records the same cache-less step
(:func:`cache_off_in_training`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "cache_off_in_training",
    "is_pretrained_model",
    "remove_cache_hooks",
    "turn_cache_off_in_training",
]

logger = logging.getLogger("autoremat")

# model -> the handle of its use_cache=False pre-hook, for turn_cache_off_in_training's models
_cache_hooks: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def is_pretrained_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel`` (without importing
    transformers)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _use_cache_index(m: nn.Module) -> int | None:
    """For a Hugging Face-style model (a module with ``config.use_cache`` and a ``use_cache``
    argument), the position of ``use_cache`` among its forward's arguments; else None."""
    if not hasattr(getattr(m, "config", None), "use_cache"):
        return None
    try:
        params = list(inspect.signature(type(m).forward).parameters)
    except (TypeError, ValueError):
        return None
    if "use_cache" not in params:
        return None
    return params.index("use_cache") - 1  # without self


def turn_cache_off_in_training(model: nn.Module, warn: bool = True) -> None:
    """Register a pre-hook on each Hugging Face-style model inside ``model`` that turns the
    cache off while training with gradients (with ``warn``, one warning per class on the
    ``autoremat`` logger). :func:`remove_cache_hooks` takes the hooks off."""
    for m in model.modules():
        index = _use_cache_index(m)
        if m in _cache_hooks or index is None:
            continue
        hook = functools.partial(_no_cache_pre_hook, index=index, warn=warn)
        _cache_hooks[m] = m.register_forward_pre_hook(hook, with_kwargs=True)


def remove_cache_hooks(model: nn.Module) -> None:
    """Undo :func:`turn_cache_off_in_training` for every module of ``model``."""
    for m in model.modules():
        handle = _cache_hooks.pop(m, None)
        if handle is not None:
            handle.remove()


@contextlib.contextmanager
def cache_off_in_training(model: nn.Module) -> Iterator[None]:
    """While active, Hugging Face-style models inside ``model`` are called with
    ``use_cache=False`` when training with gradients, as they are once wrapped (without the
    warning): :func:`autoremat.profile` records the step the wrapped model will run, not one
    that also fills a key/value cache."""
    handles = []
    for m in model.modules():
        index = _use_cache_index(m)
        if m not in _cache_hooks and index is not None:
            hook = functools.partial(_no_cache_pre_hook, index=index, warn=False)
            handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _no_cache_pre_hook(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    index: int,
    warn: bool = True,
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if not (module.training and torch.is_grad_enabled()):
        return None
    if index < len(args):
        if args[index] is False:
            return None
        args = (*args[:index], False, *args[index + 1 :])
    elif kwargs.get("use_cache") is False:
        return None
    else:
        kwargs = {**kwargs, "use_cache": False}
    if warn:
        _warn_once(type(module).__name__)
    return args, kwargs


@functools.cache
def _warn_once(name: str) -> None:
    logger.warning(
        "%s is called with use_cache=False while training: a key/value cache would be "
        "updated again when wrapped modules are recomputed (Hugging Face's own gradient "
        "checkpointing does the same)",
        name,
    )

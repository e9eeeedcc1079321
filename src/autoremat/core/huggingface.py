"""Hugging Face models: their key/value cache is turned off while training.

A module with a ``config.use_cache`` and a ``use_cache`` argument (a Hugging Face model) fills a
key/value cache in its forward. A recompute would fill it a second time, so once a model is
wrapped its Hugging Face modules are called with ``use_cache=False`` while training with
gradients, as Hugging Face's own gradient checkpointing does (one warning on the ``autoremat``
logger, naming the outermost Hugging Face class: a ``...ForCausalLM`` and the base model inside
it give one note); inference keeps its cache. The profile records the same cache-less step
(:func:`cache_off_in_training`).

On the ``meta`` device the cache-less path of their mask code asks whether the position ids
are packed sequences, reading tensor values: for the time of a ``meta`` profile,
:func:`ordinary_positions_on_meta` answers "not packed", as any ordinary batch does.

The hook is found by what it is, not by a handle kept aside: on a deep copy of a hooked model
(which carries a copy of the hook) :func:`remove_cache_hooks` finds and removes it too. A pickle
of a hooked model (``torch.save``) leaves it out (:func:`autoremat.core.classes.pickle_as_plain`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from autoremat.core.classes import Hook, pickle_as_plain, stop_pickling_as_plain

__all__ = [
    "MASK_QUESTIONS",
    "cache_modules",
    "cache_off_in_training",
    "is_pretrained_model",
    "mask_answers",
    "ordinary_positions_on_meta",
    "remove_cache_hooks",
    "turn_cache_off_in_training",
]

logger = logging.getLogger(__name__)


class _CacheOff(Hook):
    """The ``use_cache=False`` pre-hook. ``lasting``: registered by
    :func:`turn_cache_off_in_training` (and removed by :func:`remove_cache_hooks`), not for
    the time of :func:`cache_off_in_training`."""

    __slots__ = ("index", "lasting", "note", "warn", "without_grad")

    def __init__(self, index: int, *, warn: bool, lasting: bool, without_grad: bool = False,
                 note: str = ""):  # fmt: skip
        self.index = index
        self.warn = warn
        self.lasting = lasting
        self.without_grad = without_grad
        self.note = note  # the class the warning names ("": the hooked module's)

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        found = _no_cache_pre_hook(
            module, args, kwargs, index=self.index, without_grad=self.without_grad
        )
        if found is not None and self.warn and not torch.compiler.is_compiling():
            _warn_once(self.note or type(module).__name__)
        return found


def _lasting_hooks(m: nn.Module) -> list[int]:
    """The ids of the lasting :class:`_CacheOff` hooks on ``m`` (found in its hook dictionary,
    so also on a copy of a hooked module)."""
    return [i for i, h in m._forward_pre_hooks.items() if isinstance(h, _CacheOff) and h.lasting]


def is_pretrained_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel`` (without importing
    transformers)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _use_cache_index(m: nn.Module) -> int | None:
    """For a Hugging Face-style model (a module with ``config.use_cache`` and a ``use_cache``
    argument), the position of ``use_cache`` among its forward's arguments; else None."""
    if not _has_cache_config(m):
        return None
    try:
        params = list(inspect.signature(type(m).forward).parameters)
    except (TypeError, ValueError):
        return None
    if "use_cache" not in params:
        return None
    return params.index("use_cache") - 1  # without self


def cache_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``model`` (with their paths) that :func:`turn_cache_off_in_training`
    may hook and :func:`remove_cache_hooks` may unhook: those with a ``config.use_cache`` (a
    few per model), for the wrap to keep whole while either runs."""
    return [(p, m) for p, m in model.named_modules() if _has_cache_config(m)]


def _has_cache_config(m: nn.Module) -> bool:
    return hasattr(getattr(m, "config", None), "use_cache")


def turn_cache_off_in_training(model: nn.Module, warn: bool = True) -> None:
    """Register a pre-hook on each Hugging Face-style model inside ``model`` that turns the
    cache off while training with gradients (with ``warn``, one warning per outermost such
    model, by its class, on the ``autoremat`` logger: the hooks of ``GPT2LMHeadModel`` and
    of the ``GPT2Model`` inside it give one note). :func:`remove_cache_hooks` takes the hooks
    off. A module that has the hook already (also one deep-copied from a hooked module) gets
    no second one.

    A hooked module pickles without the hook (``pickle``, ``torch.save``: the plain model) and
    deep-copies with it (:func:`autoremat.core.classes.pickle_as_plain`)."""
    outermost: list[tuple[str, str]] = []  # (path, class) of the hooked modules no other holds
    for path, m in model.named_modules():
        index = _use_cache_index(m)
        if index is None:
            continue
        note = next((cls for top, cls in outermost if _inside(path, top)), None)
        if note is None:
            note = type(m).__name__
            outermost.append((path, note))
        if _lasting_hooks(m):
            continue
        hook = _CacheOff(index, warn=warn, lasting=True, note=note)
        m.register_forward_pre_hook(hook, with_kwargs=True)
        pickle_as_plain(m)


def _inside(path: str, top: str) -> bool:
    return top == "" or path == top or path.startswith(top + ".")


def remove_cache_hooks(model: nn.Module) -> None:
    """Undo :func:`turn_cache_off_in_training` for every module of ``model``, wherever the
    hooks came from (registered on it, or copied with it by ``copy.deepcopy``)."""
    for m in model.modules():
        found = _lasting_hooks(m)
        for i in found:
            # what RemovableHandle.remove does, without the handle
            del m._forward_pre_hooks[i]
            m._forward_pre_hooks_with_kwargs.pop(i, None)
        if found:
            stop_pickling_as_plain(m)


@contextlib.contextmanager
def cache_off_in_training(model: nn.Module, without_grad: bool = False) -> Iterator[None]:
    """While active, Hugging Face-style models inside ``model`` are called with
    ``use_cache=False`` when training with gradients, as they are once wrapped (without the
    warning): :func:`autoremat.profile` records the step the wrapped model will run, not one
    that also fills a key/value cache. ``without_grad``: in training mode without gradients
    too (:func:`autoremat.build_tree`'s forward, which stands for a training step)."""
    handles = []
    for m in model.modules():
        index = _use_cache_index(m)
        if index is not None and not _lasting_hooks(m):
            hook = _CacheOff(index, warn=False, lasting=False, without_grad=without_grad)
            handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def ordinary_positions_on_meta() -> Iterator[None]:
    """While active, Hugging Face's mask code (``transformers.masking_utils``, when imported)
    takes position ids on the ``meta`` device (or fake ones, ``FakeTensorMode``'s) for one
    ordinary sequence per batch row, not
    packed sequences: the answer it reaches on real tensors for positions ``0..n-1``, which
    it finds by reading their values (``.item()``, impossible on ``meta``). Other devices are
    asked as before. Without it a ``meta`` profile of such a model could only run with the
    key/value cache on (another path), and over-predicted by the cache."""
    masks = sys.modules.get("transformers.masking_utils")
    found = getattr(masks, "find_packed_sequence_indices", None)
    if found is None:
        yield
        return

    def packed(position_ids: torch.Tensor) -> torch.Tensor | None:
        valueless = position_ids.device.type == "meta" or is_fake(position_ids)
        return None if valueless else found(position_ids)

    masks.find_packed_sequence_indices = packed  # type: ignore[union-attr]
    try:
        yield
    finally:
        masks.find_packed_sequence_indices = found  # type: ignore[union-attr]


# Hugging Face's functions that read a padding mask's values to decide whether attention may
# skip its mask (SDPA's ``is_causal``): on fake tensors they answer "no" and a mask is made
# that the real step does not make.
MASK_QUESTIONS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


@contextlib.contextmanager
def mask_answers(answers: list[bool], replay: bool = False) -> Iterator[None]:
    """While active, the answers of :data:`MASK_QUESTIONS` (``transformers.masking_utils``,
    when imported) are appended to ``answers`` as a step with values gives them; with
    ``replay``, a step without values (fake tensors) gets them back from ``answers``, in
    order (again from the first once all were given: a recompute asks again)."""
    masks = sys.modules.get("transformers.masking_utils")
    asked = {n: getattr(masks, n) for n in MASK_QUESTIONS if hasattr(masks, n)}
    given = iter(range(1 << 62))

    def answer(name: str) -> Any:
        def ask(*args: Any, **kwargs: Any) -> bool:
            if replay and answers:
                return answers[next(given) % len(answers)]
            found = bool(asked[name](*args, **kwargs))
            answers.append(found)
            return found

        return ask

    for name in asked:
        setattr(masks, name, answer(name))
    try:
        yield
    finally:
        for name, original in asked.items():
            setattr(masks, name, original)


def _no_cache_pre_hook(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    index: int,
    without_grad: bool = False,
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if not (module.training and (without_grad or torch.is_grad_enabled())):
        return None
    if index < len(args):
        if args[index] is False:
            return None
        args = (*args[:index], False, *args[index + 1 :])
    elif kwargs.get("use_cache") is False:
        return None
    else:
        kwargs = {**kwargs, "use_cache": False}
    return args, kwargs


_warned: set[str] = set()


def _warn_once(name: str) -> None:
    """Log the ``use_cache`` warning once per class (not from code dynamo traces: it would
    trace the logging call). Not counted as given while the logger is quieted (a plan's
    rehearsal on a shadow of the model): the user's own step still gets it."""
    if name in _warned or not logger.isEnabledFor(logging.WARNING):
        return
    _warned.add(name)
    logger.warning(
        "%s is called with use_cache=False while training: a key/value cache would be "
        "updated again when wrapped modules are recomputed (Hugging Face's own gradient "
        "checkpointing does the same)",
        name,
    )

"""Tensors inside nested Python values: the one walker every part of autoremat uses.

Model inputs and outputs are tensors nested in tuples, lists, dicts, dataclasses and Hugging
Face ``ModelOutput`` objects. :func:`iter_tensors` finds them, each with where it sat
(``args[0]``, ``kwargs['attention_mask']``, ``out.logits``); with ``objects=True`` it also
looks inside plain objects' attributes (a key/value cache object), to a bounded depth.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from autoremat.core.layerdrop import every_layer
from autoremat.core.measuring import measuring

__all__ = [
    "iter_tensors",
    "op_tensors",
    "parameter_bytes",
    "run_model",
    "storage_key",
    "tensor_bytes",
    "version_of",
]

_ATOMS = (str, bytes, int, float, bool, complex, type(None), nn.Module, type)


def iter_tensors(
    obj: Any, where: str = "", *, objects: bool = False, depth: int | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(where, tensor)`` for every tensor nested in ``obj``.

    Searched: tuples, lists, mappings and dataclasses (``ModelOutput`` is both a mapping and a
    dataclass: its set fields are found once). With ``objects``, also the attributes of other
    objects (``where`` then shows ``<Class>``); modules, types and strings are never entered.
    ``depth`` bounds how many containers deep the search goes (``None``: no bound).
    """
    if isinstance(obj, torch.Tensor):
        yield where, obj
        return
    if depth == 0 or isinstance(obj, _ATOMS):
        return
    below = None if depth is None else depth - 1
    if isinstance(obj, Mapping):
        items: Any = ((f"[{k!r}]", v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(obj))
    elif dataclasses.is_dataclass(obj):
        items = ((f".{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj))
    elif objects and hasattr(obj, "__dict__"):
        where = f"{where}<{type(obj).__name__}>"
        items = ((f"[{k!r}]", v) for k, v in vars(obj).items())
    else:
        return
    for suffix, value in items:
        yield from iter_tensors(value, where + suffix, objects=objects, depth=below)


def op_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an ATen op's arguments or result: a tensor, or tuples, lists and dicts of
    them and of plain values (what a dispatch mode sees, found faster than by pytree, which
    every op of a step would otherwise flatten twice)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (tuple, list)):
        return []
    found = []
    for v in value:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (tuple, list, dict)):
            found.extend(op_tensors(v))
    return found


_serials = itertools.count(1)


def storage_key(t: torch.Tensor) -> int | None:
    """An identity for the storage behind ``t``, equal for every view of it and never given to
    another storage in this process, even after this one is freed (a recording keeps keys of
    storages long gone: an address would be reused); ``None`` for a tensor without a storage
    (sparse, some wrapper subclasses). The number is kept on the storage's Python object,
    which PyTorch preserves for as long as the storage lives."""
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    key: int | None = getattr(st, "_autoremat_key", None)
    if key is None:
        key = next(_serials)
        setattr(st, "_autoremat_key", key)  # noqa: B010 (UntypedStorage declares no such field)
    return key


def tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct storages behind the tensors in ``obj`` (walked as
    :func:`iter_tensors` walks), each storage counted once (views and shared tensors too)."""
    found: dict[int, int] = {}
    for _, t in iter_tensors(obj):
        key = storage_key(t)
        if key is not None:
            found[key] = t.untyped_storage().nbytes()
    return sum(found.values())


def parameter_bytes(module: nn.Module) -> int:
    """The bytes of ``module``'s parameters, each parameter counted once, by shape and dtype
    (a sharded parameter's whole size)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place change); ``None`` for an inference
    tensor, which has none."""
    try:
        return t._version
    except RuntimeError:
        return None


def run_model(model: nn.Module, args: tuple[Any, ...] | Any, kwargs: dict[str, Any] | None) -> Any:
    """Call ``model(*args, **kwargs)``; a bare ``args`` that is not a tuple is one argument.
    Autoremat runs the user's model only through here: inside,
    :func:`~autoremat.core.measuring.is_measuring` is True, and LayerDrop is off (every layer
    runs: :func:`~autoremat.core.layerdrop.every_layer`)."""
    if not isinstance(args, tuple):
        args = (args,)
    with measuring(), every_layer(model):
        return model(*args, **(kwargs or {}))

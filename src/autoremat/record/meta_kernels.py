"""PyTorch's meta kernels, remembered: a step on ``meta`` runs each op's own kernel once per
distinct input and gives the same result again without running it (why: docs/cost-model.md,
"Running a plan's step").

A meta kernel's result is a pure function of the inputs' metadata and the other arguments,
so an op met again with the same ones (the next layer's) gets fresh tensors of the shapes,
strides and dtypes its kernel gave the first time. Only ops whose outputs are new tensors are
remembered: no view, no in-place or ``out=`` op (their schema marks an alias), every return
a plain ``Tensor`` whose storage holds exactly its elements, not shared with another output
or an input; and only when every argument is a ``meta`` tensor or a plain value. Any other op
runs its kernel every time.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _len_torch_dispatch_stack

from autoremat.core.nested import op_tensors

__all__ = ["RememberedKernels", "fresh_only", "run_kernel"]

# (op, arguments' key) -> the outputs' (shape, stride, dtype), or None: run it every time
_SEEN: dict[tuple[Any, ...], tuple[tuple[Any, ...], ...] | None] = {}
_MOST = 200_000  # entries kept; past it the memory starts afresh
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format)  # fmt: skip


def run_kernel(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)``, from memory when it ran on the same ``meta`` inputs before
    (module docstring). Called from a dispatch mode's handler: the memory is used only when no
    other mode is below it (one would not see the op)."""
    key = None if _len_torch_dispatch_stack() else _key(func, args, kwargs)
    known = None if key is None else _SEEN.get(key, ())
    if key is None or known is None:
        return func(*args, **kwargs)
    if known:
        outs = [torch.empty_strided(s, st, dtype=d, device="meta") for s, st, d in known]
        return outs[0] if len(outs) == 1 else tuple(outs)  # (one per return of its schema)
    out = func(*args, **kwargs)
    if len(_SEEN) >= _MOST:
        _SEEN.clear()
    _SEEN[key] = _remembered(out, args, kwargs)
    return out


class RememberedKernels(TorchDispatchMode):
    """A dispatch mode that runs every op by :func:`run_kernel`: for a step on ``meta`` under
    no other mode (:func:`autoremat.build_tree`'s forward; under the memory tracker, the
    tracker does the same)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return run_kernel(func, args, kwargs or {})


def _key(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """What the op's result depends on, hashable; ``None`` when it cannot be remembered."""
    if args and type(args[0]) is torch.Tensor and not args[0].is_meta:
        return None  # (the common case, found first: not on meta)
    parts: list[Any] = [func]
    fits = fresh_only(func) and all(_add(value, parts) for value in (*args, *kwargs.items()))
    return tuple(parts) if fits else None


def _add(value: Any, parts: list[Any]) -> bool:
    """Append ``value``'s key to ``parts``; False when it has none."""
    if type(value) is torch.Tensor and value.is_meta:
        parts.append((value.shape, value.stride(), value.dtype, value.storage_offset()))
        return True
    if isinstance(value, torch.Tensor):  # (not on meta, or a subclass: not remembered)
        return False
    if isinstance(value, (tuple, list)):
        parts.append(len(value))
        return all(_add(v, parts) for v in value)
    if isinstance(value, _PLAIN):
        parts.append((type(value), value))
        return True
    return False


@functools.cache
def fresh_only(func: Any) -> bool:
    """Whether ``func``'s schema returns only new plain tensors (no alias anywhere)."""
    schema = getattr(func, "_schema", None)
    return bool(
        schema is not None
        and schema.returns
        and all(str(r.type) == "Tensor" and r.alias_info is None for r in schema.returns)
        and all(a.alias_info is None for a in schema.arguments)
    )


def _remembered(out: Any, args: Any, kwargs: Any) -> tuple[tuple[Any, ...], ...] | None:
    """The outputs' (shape, stride, dtype) when each is a new tensor filling its own storage
    exactly; else ``None``."""
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if not all(type(t) is torch.Tensor and t.device.type == "meta" for t in outs):
        return None
    taken = {t.untyped_storage()._cdata for t in op_tensors((args, kwargs))}  # (and outputs')
    for t in outs:
        st = t.untyped_storage()
        if st._cdata in taken or t.storage_offset() != 0:
            return None
        taken.add(st._cdata)
        fresh = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        if fresh.untyped_storage().nbytes() != st.nbytes():
            return None
    return tuple((tuple(t.shape), t.stride(), t.dtype) for t in outs)

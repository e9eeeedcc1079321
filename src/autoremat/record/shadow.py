"""A model's shadow: its structure and attributes, with parameters and buffers that hold no
memory (on ``meta``, or fake tensors), for profiling and emulating without touching it."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["meta_shadow"]


def meta_shadow(
    model: nn.Module, shared: tuple[object, ...] = (), device: str = "meta"
) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on ``meta``: the same structure
    and attributes, no memory, no copy of the values; the objects of ``shared`` (a trainer a
    module refers to) are referred to, not copied. ``device``: another device for them
    (``"cpu"`` inside a ``FakeTensorMode``: fake CPU tensors)."""
    memo: dict[int, Any] = {id(obj): obj for obj in shared}
    for t in [*model.parameters(), *model.buffers()]:
        shadow = torch.empty_like(t, device=device)
        if isinstance(t, nn.Parameter):
            shadow = nn.Parameter(shadow, requires_grad=t.requires_grad)
        memo[id(t)] = shadow
    return copy.deepcopy(model, memo)

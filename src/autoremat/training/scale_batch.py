"""Example inputs at another batch size.

:func:`scale_batch` makes, from a model's example inputs, the inputs of a batch of ``batch``
rows: every tensor whose batch dimension (the first, or ``dim``) has the examples' batch size
(the most common size there) gets ``batch`` rows, the example rows repeated in turn; every
other value stays as it is. Under ``torch.device("meta")`` the new tensors are made on ``meta`` (no
memory), which is how :func:`autoremat.fit` sizes batches it never runs.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["batch_size_of", "scale_batch"]


def batch_size_of(args: Any, kwargs: Any = None, dim: int = 0) -> int:
    """The examples' batch size: the most common size of dimension ``dim`` among the input
    tensors that have it.

    Raises:
        ValueError: no input tensor has that dimension.
    """
    sizes = Counter(
        t.shape[dim]
        for t in torch.utils._pytree.tree_leaves((args, kwargs))
        if isinstance(t, torch.Tensor) and t.dim() > dim
    )
    if not sizes:
        raise ValueError(f"no input tensor has a dimension {dim} (the batch's) to scale")
    return sizes.most_common(1)[0][0]


def scale_batch(args: Any, kwargs: Any, batch: int, dim: int = 0) -> tuple[Any, Any]:
    """``(args, kwargs)`` with ``batch`` rows along dimension ``dim`` (module docstring;
    ``dim=1`` for sequence-first inputs).

    Raises:
        ValueError: ``batch`` below 1, or no input tensor has dimension ``dim``.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    rows = batch_size_of(args, kwargs, dim)
    meta = torch.get_default_device().type == "meta"

    def scaled(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() <= dim or value.shape[dim] != rows:
            return value
        source = value.to("meta") if meta else value
        index = torch.arange(batch, device=source.device) % rows
        return source.index_select(dim, index)

    return tree_map(scaled, (args, kwargs))

"""Example inputs at another batch size.

:func:`scale_batch` makes, from a model's example inputs, the inputs of a batch of ``batch``
rows: every tensor whose first dimension is the examples' batch size (the most common first
dimension among them) gets ``batch`` rows, the example rows repeated in turn; every other
value stays as it is. Under ``torch.device("meta")`` the new tensors are made on ``meta`` (no
memory), which is how :func:`autoremat.fit` sizes batches it never runs.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["batch_size_of", "scale_batch"]


def batch_size_of(args: Any, kwargs: Any = None) -> int:
    """The examples' batch size: the most common first dimension among the input tensors.

    Raises:
        ValueError: no input tensor has a dimension.
    """
    sizes = Counter(
        t.shape[0]
        for t in torch.utils._pytree.tree_leaves((args, kwargs))
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    if not sizes:
        raise ValueError("no input tensor has a batch dimension to scale")
    return sizes.most_common(1)[0][0]


def scale_batch(args: Any, kwargs: Any, batch: int) -> tuple[Any, Any]:
    """``(args, kwargs)`` with ``batch`` rows (module docstring).

    Raises:
        ValueError: ``batch`` below 1, or no input tensor has a dimension.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    rows = batch_size_of(args, kwargs)
    meta = torch.get_default_device().type == "meta"

    def scaled(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != rows:
            return value
        source = value.to("meta") if meta else value
        index = torch.arange(batch, device=source.device) % rows
        return source.index_select(0, index)

    return tree_map(scaled, (args, kwargs))

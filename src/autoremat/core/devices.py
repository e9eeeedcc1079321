"""Where a model lives: the one device lookup every part uses."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoremat.core.nested import iter_tensors

__all__ = ["model_device", "uses_cuda"]


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (``cpu`` for a model without parameters):
    where its step runs and its memory is counted."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def uses_cuda(model: nn.Module, inputs: Any = ()) -> bool:
    """Whether any parameter, buffer or tensor of ``inputs`` (nested values) is on a CUDA
    device: then its step's kernels run asynchronously and must be waited for."""
    tensors = [*model.parameters(), *model.buffers(), *(t for _, t in iter_tensors(inputs))]
    return any(t.device.type == "cuda" for t in tensors)

"""The most live bytes at each point of a forward, measured: what the profile's points
predict, one by one (``tests/test_profile.py``, ``tests/test_liveness.py``)."""

from __future__ import annotations

import torch
from torch import nn


def forward_moments(model: nn.Module, x: torch.Tensor) -> dict[int, int]:
    """The most live bytes at each point of the forward (``p``: module calls ended before).
    The moment a call ends is its point's alone: the next point has the moments after it (a
    tensor the code lets go just after a call returns is gone at every moment there that can
    hold a peak, as the profile prices it)."""
    from autoremat.record.memory import LiveMemory
    from autoremat.record.step import default_loss, train_step

    memory, most, ended, on = LiveMemory(), {}, [0], [True]

    def mark(ends: int) -> None:
        if on[0]:
            most[ended[0]] = max(most.get(ended[0], 0), memory.peak)
            ended[0] += ends
        memory.reset_peak()
        if ends:
            memory.peak = 0  # (only what is made from now on can raise it)

    def stop() -> None:
        mark(0)
        on[0] = False

    hooks = [
        h
        for m in model.modules()
        for h in (
            m.register_forward_pre_hook(lambda *_: mark(0)),
            m.register_forward_hook(lambda *_: mark(1)),
        )
    ]
    try:
        with memory:
            train_step(model, (x,), {}, default_loss, after_forward=stop)
    finally:
        for h in hooks:
            h.remove()
    return most

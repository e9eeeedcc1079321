"""Wall time of a piece of work, the one timer every part uses: CUDA runs its kernels
asynchronously, so the timer waits for the device on both sides of the work."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["timed"]

T = TypeVar("T")


def timed(work: Callable[[], T], cuda: bool = False) -> tuple[T, float]:
    """``work()``'s result and the seconds it took; with ``cuda``, the current CUDA device is
    synchronised before the clock starts and before it stops."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = work()
    if cuda:
        torch.cuda.synchronize()
    return result, time.perf_counter() - start

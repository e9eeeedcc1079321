"""Timing: each module's forward, each op alone, and what a recompute adds per op.

How time prices a recompute: docs/cost-model.md, "Pricing: time or FLOPs". :func:`time_forward`
times the ops; :func:`overheads` measures the per-op overheads once per device. On ``meta``
nothing can be timed: :data:`DEFAULT_OVERHEADS`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from autoremat.core.clock import timed
from autoremat.core.entries import call_key
from autoremat.core.nested import run_model
from autoremat.core.selective import WAYS, context_fn, keeps, resolve
from autoremat.record.snapshot import preserved
from autoremat.record.step import Autocast, autocast_for

__all__ = ["DEFAULT_OVERHEADS", "OpTimes", "overheads", "per_op", "time_forward"]

# Per-op overheads assumed where nothing can be timed (meta): a recompute's dispatch, and
# selective checkpointing's Python policy and cache, per op (forward and recompute together).
DEFAULT_OVERHEADS = (5e-6, 5e-5)


class OpTimes(TorchDispatchMode):
    """Adds the time of each op (the op alone; on CUDA with a synchronize before and after)
    to the running module, and apart for each way of selective recompute that keeps it."""

    def __init__(self, stack: list[str], seconds: dict[tuple[str, str], float], cuda: bool):
        super().__init__()
        self.stack, self.seconds, self.cuda = stack, seconds, cuda
        self.keep = {way: resolve(ops) for way, ops in WAYS.items()}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out, took = timed(lambda: func(*args, **kwargs), self.cuda)
        path = self.stack[-1]
        self.seconds[path, ""] += took
        for way, packets in self.keep.items():
            if keeps(func, args, kwargs, packets):
                self.seconds[path, way] += took
        return out


def time_forward(
    model: nn.Module,
    args: Any,
    kwargs: dict[str, Any] | None,
    nodes: dict[int, tuple[str, nn.Module, int]],
    device: torch.device,
    runs: int = 2,
    autocast: Autocast | None = None,
) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """Inclusive forward wall time per node (all calls), and the time of each node's own ops
    (``(path, "")``) and of those each way of selective recompute keeps (``(path, way)``):
    the fastest of ``runs`` forwards, each figure on its own. ``nodes``: module id -> (path,
    module, calls); the figures of a module that ran several times are per call, under the
    names of :func:`autoremat.core.entries.call_key` (a call beyond ``calls`` is not timed)."""
    best_seconds: dict[str, float] = {}
    best_ops: dict[tuple[str, str], float] = {}
    for _ in range(runs):
        with autocast_for(model, autocast):
            seconds, ops = _one_timed_forward(model, args, kwargs, nodes, device.type == "cuda")
        for path, t in seconds.items():
            best_seconds[path] = min(best_seconds.get(path, math.inf), t)
        for key, t in ops.items():
            best_ops[key] = min(best_ops.get(key, math.inf), t)
    return best_seconds, best_ops


def _one_timed_forward(model: nn.Module, args: Any, kwargs: dict[str, Any] | None,
                       nodes: dict[int, tuple[str, nn.Module, int]], cuda: bool,
                       ) -> tuple[dict[str, float], dict[tuple[str, str], float]]:  # fmt: skip
    starts: list[float] = []  # when each call on the stack (but its root) began
    seconds: dict[str, float] = defaultdict(float)
    ops: dict[tuple[str, str], float] = defaultdict(float)
    stack = [""]
    count: dict[int, int] = defaultdict(int)

    def enter(module: nn.Module, *_: Any) -> None:
        path, calls = nodes[id(module)][0], nodes[id(module)][2]
        k = count[id(module)]
        count[id(module)] += 1
        stack.append(call_key(path, k, calls) if k < calls else f"{path}@untimed")
        starts.append(time.perf_counter())

    def leave(module: nn.Module, *_: Any) -> None:
        seconds[stack.pop()] += time.perf_counter() - starts.pop()

    with contextlib.ExitStack() as hooks:  # (a hook's handle removes it on exit)
        for node in nodes.values():
            hooks.enter_context(node[1].register_forward_pre_hook(enter))
            hooks.enter_context(node[1].register_forward_hook(leave))
        with preserved(model), torch.enable_grad(), OpTimes(stack, ops, cuda):
            run_model(model, args, kwargs)
    return seconds, ops


def per_op(times: dict[str, float], ops: int) -> tuple[float, float]:
    """The per-op overheads ``(checkpoint, selective)`` from the fastest step times of a chain
    of ``ops`` ops run ``"plain"``, checkpointed ``"full"`` and checkpointed ``"selective"``:
    what each adds over plain, per op, never negative, and the selective one never below the
    checkpoint one (it runs a checkpoint too)."""
    full = max(0.0, times["full"] - times["plain"]) / ops
    return full, max(full, (times["selective"] - times["plain"]) / ops)


@functools.cache
def overheads(device: torch.device, ops: int = 64, repeats: int = 5) -> tuple[float, float]:
    """Seconds a recompute adds per op beyond the op's own time, measured once per device on a
    chain of ``ops`` tiny ops (fastest of ``repeats``): ``(checkpoint, selective)``
    (:func:`per_op`). The first is what checkpoint's recompute costs per op in dispatch and
    autograd; the second what a selective checkpoint costs per op, its forward and its
    recompute together (every op of a selectively recomputed module goes through its Python
    policy twice)."""
    if device.type == "meta":
        return DEFAULT_OVERHEADS
    cuda = device.type == "cuda"
    x = torch.ones(4, device=device, requires_grad=True)

    def chain(t: torch.Tensor) -> torch.Tensor:
        for _ in range(ops):
            t = torch.sin(t)
        return t

    def step(how: str) -> None:
        if how == "plain":
            y = chain(x)
        elif how == "full":
            y = checkpoint(chain, x, use_reentrant=False)
        else:
            y = checkpoint(chain, x, use_reentrant=False, context_fn=context_fn(("aten.mm",)))
        y.sum().backward()

    times: dict[str, float] = {}
    with torch.enable_grad():
        for _ in range(repeats):
            for how in ("plain", "full", "selective"):
                seconds = timed(lambda: step(how), cuda)[1]  # noqa: B023 (run at once)
                times[how] = min(times.get(how, math.inf), seconds)
    x.grad = None
    return per_op(times, ops)

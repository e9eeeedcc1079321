"""Per-module costs on the tree: what each module stores for backward and costs to recompute.

:func:`profile` runs the model's forward once with gradients enabled and attributes every cost
to the innermost module of the tree that was running when it arose:

* **saved**: bytes of the tensor storages that autograd saved for backward
  (``torch.autograd.graph.saved_tensors_hooks``). Each storage counts once, for the module that
  saved it first; storages that existed before the step (parameters, buffers, the example
  inputs) do not count: they are not activations and recompute cannot free them.
* **flops**: forward FLOPs, with the formulas of ``torch.utils.flop_counter`` (matmuls,
  convolutions, attention; pointwise ops count zero there).
* **seconds**: forward wall time, measured in a separate forward with only timing hooks; on the
  ``meta`` device, where nothing runs, estimated from FLOPs.

A node's figures are its own plus its children's, so they reconcile down the tree by
construction. A shared module's costs, whichever parent called it, are counted at its node
(its first path), like its parameters. The model must not be wrapped (profile it before
``plan.apply``, or after ``autoremat.remove``): a checkpointed module saves nothing to see.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from autoremat.snapshot import preserved
from autoremat.tree import Node, build_tree, iter_tensors, run_model
from autoremat.wrap import wrapped_paths

# Forward throughput assumed when the model is on the meta device and nothing can be timed.
META_FLOPS_PER_SECOND = 1e11


@dataclass(frozen=True)
class NodeCost:
    """Costs of one tree node, its subtree included (``own_*``: the node alone)."""

    path: str
    saved: int
    own_saved: int
    flops: int
    own_flops: int
    seconds: float
    input_bytes: int
    output_bytes: int
    param_bytes: int
    calls: int


@dataclass(frozen=True)
class Profile:
    """The tree of a model with a :class:`NodeCost` for every node (``profile[path]``)."""

    tree: Node
    costs: dict[str, NodeCost]
    device: str

    def __getitem__(self, path: str) -> NodeCost:
        return self.costs[path]

    def __iter__(self) -> Iterator[NodeCost]:
        return iter(self.costs.values())

    def render(self, depth: int = 3) -> str:
        """A table of the nodes down to ``depth`` levels below the root."""
        mib = 2**20
        rows = [
            f"{'module':48} {'calls':>5} {'saved MiB':>10} {'GFLOP':>9} {'ms':>9} "
            f"{'params MiB':>10}"
        ]

        def visit(node: Node, level: int) -> None:
            c = self.costs[node.path]
            label = ("  " * level + (node.path.rsplit(".", 1)[-1] if node.path else "(root)"))[:48]
            rows.append(
                f"{label:48} {c.calls:>5} {c.saved / mib:>10.2f} {c.flops / 1e9:>9.3f} "
                f"{c.seconds * 1e3:>9.2f} {c.param_bytes / mib:>10.2f}"
            )
            if level < depth:
                for child in node.children:
                    visit(child, level + 1)

        visit(self.tree, 0)
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.render()


class _OpCosts(TorchDispatchMode):
    """Adds each op's FLOPs (``torch.utils.flop_counter`` formulas) to the running module."""

    def __init__(self, stack: list[str], flops: dict[str, int]) -> None:
        super().__init__()
        self.stack = stack
        self.flops = flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops[self.stack[-1]] += formula(*args, **kwargs, out_val=out)
        return out


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Progress:
    """``profiling: k/n module calls`` on stderr, only when stderr is a terminal."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.last = total, 0, 0.0
        self.on = sys.stderr.isatty() and total > 0

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        if self.on and (now - self.last > 0.1 or self.done == self.total):
            self.last = now
            width = 30
            filled = width * self.done // self.total
            sys.stderr.write(
                f"\rprofiling [{'#' * filled}{'.' * (width - filled)}] "
                f"{self.done}/{self.total} module calls"
            )
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def profile(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> Profile:
    """Per-node costs of ``model`` on the example inputs (see the module docstring).

    Runs the forward (and ``loss_fn`` on its output, if given; its costs go to the root) with
    gradients enabled, twice on real tensors (costs, then timing) and once on ``meta``
    tensors. The model is left as it was found (:func:`autoremat.snapshot.preserved`). Shows a
    progress line on a terminal.

    Raises:
        ValueError: the model has modules wrapped by autoremat (remove them first).
        RuntimeError: the example inputs fail in forward (the message names the module).
    """
    if wrapped_paths(model):
        raise ValueError(
            "profile needs the unwrapped model (a checkpointed module saves nothing to "
            "measure): call autoremat.remove(model) first"
        )
    tree = build_tree(model, args, kwargs)
    nodes = {id(n.module): n.path for n in tree.walk()}
    modules = {id(n.module): n.module for n in tree.walk()}
    inputs = [t for _, t in iter_tensors((args, kwargs))]
    preexisting = {_storage_key(t) for t in [*model.parameters(), *model.buffers(), *inputs]}
    meta = any(t.device.type == "meta" for t in [*inputs, *model.parameters()])
    stack: list[str] = [""]
    own_saved: dict[str, int] = defaultdict(int)
    own_flops: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    progress = _Progress(sum(n.calls for n in tree.walk()))

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in seen and key not in preexisting:
            seen.add(key)
            own_saved[stack[-1]] += t.untyped_storage().nbytes()
        return t

    def enter(path: str) -> None:
        stack.append(path)

    def leave(path: str) -> None:
        stack.pop()
        progress.step()

    handles = _hooks(modules, nodes, enter, leave)
    try:
        with preserved(model), torch.enable_grad(), _OpCosts(stack, own_flops):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = run_model(model, args, kwargs)
                if loss_fn is not None:
                    loss_fn(out)
            del out
    finally:
        for h in handles:
            h.remove()

    own_seconds: dict[str, float] = defaultdict(float)
    if not meta:
        own_seconds = _time_forward(model, args, kwargs, modules, nodes)

    costs: dict[str, NodeCost] = {}

    def total(node: Node) -> NodeCost:
        kids = [total(c) for c in node.children]
        params = {id(p): p for p in node.module.parameters()}
        flops = own_flops[node.path] + sum(k.flops for k in kids)
        cost = NodeCost(
            path=node.path,
            saved=own_saved[node.path] + sum(k.saved for k in kids),
            own_saved=own_saved[node.path],
            flops=flops,
            own_flops=own_flops[node.path],
            seconds=flops / META_FLOPS_PER_SECOND if meta else own_seconds[node.path],
            input_bytes=node.input_bytes,
            output_bytes=node.output_bytes,
            param_bytes=sum(p.numel() * p.element_size() for p in params.values()),
            calls=node.calls,
        )
        costs[node.path] = cost
        return cost

    total(tree)
    ordered = {n.path: costs[n.path] for n in tree.walk()}
    return Profile(tree=tree, costs=ordered, device="meta" if meta else "real")


def _hooks(
    modules: dict[int, nn.Module],
    nodes: dict[int, str],
    enter: Callable[[str], None],
    leave: Callable[[str], None],
) -> list[Any]:
    handles = []
    for key, module in modules.items():
        path = nodes[key]
        handles.append(module.register_forward_pre_hook(lambda *_, p=path: enter(p)))
        handles.append(module.register_forward_hook(lambda *_, p=path: leave(p)))
    return handles


def _time_forward(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    modules: dict[int, nn.Module],
    nodes: dict[int, str],
) -> dict[str, float]:
    """Inclusive forward wall time per node (all calls), from one timed forward."""
    starts: dict[str, list[float]] = defaultdict(list)
    seconds: dict[str, float] = defaultdict(float)

    def enter(path: str) -> None:
        starts[path].append(time.perf_counter())

    def leave(path: str) -> None:
        seconds[path] += time.perf_counter() - starts[path].pop()

    handles = _hooks(modules, nodes, enter, leave)
    try:
        with preserved(model), torch.enable_grad():
            run_model(model, args, kwargs)
    finally:
        for h in handles:
            h.remove()
    return seconds

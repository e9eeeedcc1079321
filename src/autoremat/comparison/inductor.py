"""``torch.compile`` (inductor) as a contender, with ``activation_memory_budget``: the min-cut
partitioner then decides what to recompute.

A compiled model cannot be measured by a dispatch mode (dynamo runs the original Python code
eagerly when a ``TorchDispatchMode`` is active), so :func:`compiled` counts the FLOPs of the
graphs inductor compiles (:func:`graph_flops`) while it warms the model up, and hands them to
the harness in a :class:`CompileInfo`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from autoremat.comparison.applied import Applied, Args, CompileInfo, Contender, Kwargs, as_applied
from autoremat.record.snapshot import preserved
from autoremat.record.step import LossFn, default_loss, train_step

__all__ = ["compiled", "graph_flops"]


def graph_flops(gm: torch.fx.GraphModule) -> int:
    """FLOPs of one run of an FX graph whose nodes carry ``meta["val"]`` (the graphs that
    AOTAutograd hands to inductor), by the formulas ``FlopCounterMode`` uses."""
    from torch.utils.flop_counter import flop_registry

    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        packet = getattr(node.target, "overloadpacket", node.target)
        formula = flop_registry.get(packet)
        if formula is None:
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        total += int(formula(*args, **kwargs, out_val=node.meta.get("val")))
    return total


def _counting_inductor(info: CompileInfo) -> Callable[..., Any]:
    """An inductor backend that also counts the graphs it compiles and their FLOPs. A distinct
    backend object per compiled model also keeps dynamo from reusing one model's compiled code
    (made under another memory budget) for another copy of the same model."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm: torch.fx.GraphModule, example_inputs: Any, *a: Any, **kw: Any) -> Any:
        info.graphs += 1
        if info.flops is not None:
            try:
                info.flops += graph_flops(gm)
            except Exception:  # a formula that cannot read this node: FLOPs unknown
                info.flops = None
        return compile_fx_inner(gm, example_inputs, *a, **kw)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs, inner_compile=inner)

    return backend


def compiled(
    budget: float = 1.0,
    *,
    loss_fn: LossFn | None = None,
    fallback_random: bool = True,
    first: Contender | None = None,
) -> Contender:
    """``torch.compile(model)`` (inductor) with ``activation_memory_budget=budget`` while it
    compiles: one warm-up step (forward and backward) runs in ``apply``, so the cold compile is
    not timed (its seconds go to the row's note). With ``first``, that contender is applied to
    the model before it is compiled (an autoremat plan, Hugging Face's checkpointing): the row
    is named ``"{first} + compile"`` and keeps its plan and predicted peak. The row's figures
    come from the allocator (:func:`autoremat.measure` of a compiled model); its FLOPs are
    those of the compiled graphs (recompute included).

    ``fallback_random=True`` sets ``torch._inductor.config.fallback_random`` while compiling so
    that dropout draws the same masks as eager PyTorch (otherwise gradients cannot be compared;
    the memory the partitioner chooses is the same either way). The AOTAutograd cache is off
    while compiling (a cache hit would skip the graphs whose FLOPs are counted); inductor's FX
    graph cache stays on.

    Known problem (torch 2.13, pytorch#190758, open): with a budget below 1.0 the partitioner
    may recompute random ops (dropout) in backward with fresh random numbers, so a model with
    dropout gets wrong gradients; ``compare`` reports ``grads_match=False`` for it.
    """
    loss_fn = default_loss if loss_fn is None else loss_fn

    def apply(model: nn.Module, args: Args, kwargs: Kwargs) -> Applied | None:
        before = Applied(model) if first is None else as_applied(first.apply(model, args, kwargs))
        if before is None:
            return None
        info = CompileInfo(budget)
        # an OptimizedModule (typed as a plain callable)
        optimized = cast(nn.Module, torch.compile(before.model, backend=_counting_inductor(info)))
        start = time.perf_counter()
        with (
            torch._functorch.config.patch(
                activation_memory_budget=budget, enable_autograd_cache=False
            ),
            torch._inductor.config.patch(fallback_random=fallback_random),
            preserved(model),
        ):
            train_step(optimized, args, kwargs, loss_fn)
        info.compile_seconds = time.perf_counter() - start
        if info.graphs == 0:
            raise RuntimeError(
                "torch.compile compiled no graph: dynamo ran the model eagerly (every copy of "
                "a model compiles its code again; past torch._dynamo.config.recompile_limit "
                "it stops: raise it, or call torch._dynamo.reset())"
            )
        info.calls_after_warmup = info.graphs
        info.warm_flops = info.flops
        return dataclasses.replace(before, model=optimized, compile_info=info)

    name = f"compile b={budget:g}" if first is None else f"{first.name} + compile"
    if first is not None and budget != 1.0:
        name += f" b={budget:g}"
    return Contender(name, apply)

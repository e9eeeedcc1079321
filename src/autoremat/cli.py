"""The ``autoremat`` command line: ``tree``, ``plan``, ``demo`` and ``examples``.

TARGET is a built-in example name (``autoremat examples`` lists them) or
``path/to/file.py:factory``, where ``factory()`` returns ``(model, args, kwargs)``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoremat.examples import EXAMPLES, Example
from autoremat.planner import plan
from autoremat.plans import Plan
from autoremat.tree import build_tree


class TargetError(ValueError):
    """A TARGET that names no example and no loadable factory."""


def load_target(target: str) -> Example:
    """``(model, args, kwargs)`` for a TARGET (see the module docstring).

    Raises:
        TargetError: the name is unknown, the file or factory is missing, or the factory does
            not return ``(nn.Module, tuple, dict)``.
    """
    if target in EXAMPLES:
        return EXAMPLES[target]()
    if ":" not in target:
        raise TargetError(
            f"unknown target {target!r}: use one of {', '.join(EXAMPLES)} "
            f"or path/to/file.py:factory"
        )
    file, _, name = target.rpartition(":")
    path = Path(file)
    if not path.is_file():
        raise TargetError(f"no such file: {file}")
    spec = importlib.util.spec_from_file_location(f"autoremat_target_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise TargetError(f"cannot import {file} as a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise TargetError(f"importing {file} failed: {type(exc).__name__}: {exc}") from exc
    factory = getattr(module, name, None)
    if not callable(factory):
        raise TargetError(f"{file} has no callable {name!r}")
    result = factory()
    if not (
        isinstance(result, tuple)
        and len(result) == 3
        and isinstance(result[0], nn.Module)
        and isinstance(result[1], tuple)
        and isinstance(result[2], dict)
    ):
        raise TargetError(f"{target} must return (model: nn.Module, args: tuple, kwargs: dict)")
    return result


def _step(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int) -> float:
    from autoremat.step import default_loss

    torch.manual_seed(seed)
    loss = default_loss(model(*args, **kwargs))
    loss.backward()
    return float(loss.detach())


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    diffs = [0.0]
    for (_, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if p.grad is not None or q.grad is not None:
            diffs.append(float((p.grad - q.grad).abs().max()))
    for x, y in zip(a.buffers(), b.buffers(), strict=True):
        diffs.append(float((x.double() - y.double()).abs().max()) if x.numel() else 0.0)
    return max(diffs)


def demo(target: str, segments: int, budget: str) -> int:
    """Plan and apply on an example with both strategies; show the tree, the choices, what
    each saved (measured) and that one training step is identical to the unwrapped model's."""
    from autoremat.measurement import measure

    model, args, kwargs = load_target(target)
    levels = plan(model, args, kwargs, segments=segments)
    print(levels)
    budgeted = plan(model, args, kwargs, budget=budget)
    print()
    print(budgeted.summary())
    print()
    rows = [("no recompute", None, measure(model, args, kwargs, repeats=3))]
    identical = True
    for label, chosen in [(f"levels, {segments}", levels), (f"budget {budget}", budgeted)]:
        wrapped = chosen.apply(copy.deepcopy(model))
        rows.append((label, chosen, measure(wrapped, args, kwargs, repeats=3)))
        reference = copy.deepcopy(model)
        same = _step(reference, args, kwargs, 1) == _step(wrapped, args, kwargs, 1)
        identical = identical and same and _max_diff(reference, wrapped) == 0.0
    base = rows[0][2]
    mib = 2**20
    print(f"{'':18}{'peak MiB':>10}{'predicted':>10}{'saved MiB':>10}{'GFLOP':>8}{'ms/step':>9}")
    for label, chosen, m in rows:
        predicted = chosen.estimated_peak if chosen is not None else None
        print(
            f"{label:18}{m.peak / mib:>10.2f}"
            f"{(f'{predicted / mib:.2f}' if predicted else '-'):>10}"
            f"{m.saved / mib:>10.2f}{m.flops / 1e9:>8.2f}{m.seconds * 1e3:>9.1f}"
        )
    for label, _, m in rows[1:]:
        print(
            f"{label}: peak x{m.peak / base.peak:.2f}, FLOPs x{m.flops / base.flops:.2f}, "
            f"time x{m.seconds / base.seconds:.2f}"
        )
    print()
    print(
        "one training step of each wrapped model vs the unwrapped one (same seed, dropout on): "
        f"loss, gradients and buffers {'identical' if identical else 'DIFFERENT'}"
    )
    return 0 if identical else 1


def _measured(chosen: Plan, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The measured step peak of ``chosen`` applied to a copy of ``model``, against its
    prediction."""
    from autoremat.measurement import measure

    wrapped = chosen.apply(copy.deepcopy(model))
    peak = measure(wrapped, args, kwargs).peak
    line = f"measured peak {peak / 2**20:.2f} MiB"
    if chosen.estimated_peak is not None:
        error = (chosen.estimated_peak - peak) / peak
        line += f" (predicted {chosen.estimated_peak / 2**20:.2f} MiB, error {error:+.1%})"
    if chosen.budget is not None:
        line += f"; {'within' if peak <= chosen.budget else 'OVER'} the budget"
    return line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autoremat", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_tree = sub.add_parser("tree", help="print the module tree with paths and I/O shapes")
    p_tree.add_argument("target")
    p_plan = sub.add_parser("plan", help="print the modules chosen for recompute")
    p_plan.add_argument("target")
    how = p_plan.add_mutually_exclusive_group()
    how.add_argument("--segments", type=int, help="preset split-point count (levels; default 3)")
    how.add_argument(
        "--budget",
        help="step-peak budget: a percentage of the peak without recompute (50%%) "
        "or a size (2GiB, 800MB, bytes)",
    )
    p_plan.add_argument(
        "--objective",
        choices=("time", "flops"),
        default="time",
        help="what a budget plan minimises: the recompute's profiled time (default) or its FLOPs",
    )
    p_plan.add_argument(
        "--measure", action="store_true", help="apply the plan to a copy and measure its peak"
    )
    p_demo = sub.add_parser("demo", help="plan, apply, check gradients and show the savings")
    p_demo.add_argument("target", nargs="?", default="gpt2")
    p_demo.add_argument("--segments", type=int, default=3)
    p_demo.add_argument("--budget", default="50%")
    sub.add_parser("examples", help="list the built-in example models")
    p_bench = sub.add_parser("bench", help="compare recompute strategies side by side")
    p_bench.add_argument("target")
    p_bench.add_argument("--repeats", type=int, default=3, help="timed steps per strategy")
    p_bench.add_argument(
        "--compile", action="store_true", help="also torch.compile at memory budgets (slow)"
    )
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        if ns.command == "examples":
            for name, factory in EXAMPLES.items():
                print(f"{name:10} {factory.__doc__}")
            return 0
        if ns.command == "demo":
            return demo(ns.target, ns.segments, ns.budget)
        if ns.command == "bench":
            from autoremat.bench import bench_target, to_markdown

            model, args, kwargs = load_target(ns.target)
            rows = bench_target(
                model, args, kwargs, compile=ns.compile, repeats=ns.repeats, name=ns.target
            )
            print(to_markdown(rows))
            return 0
        model, args, kwargs = load_target(ns.target)
        if ns.command == "tree":
            print(build_tree(model, args, kwargs))
        else:
            if ns.budget is None and ns.objective != "time":
                raise ValueError("--objective applies to budget plans: add --budget")
            extra = {} if ns.budget is None else {"objective": ns.objective}
            chosen = plan(model, args, kwargs, segments=ns.segments, budget=ns.budget, **extra)
            print(chosen.summary() if chosen.strategy == "budget" else chosen)
            if ns.measure:
                print(_measured(chosen, model, args, kwargs))
        return 0
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"autoremat: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

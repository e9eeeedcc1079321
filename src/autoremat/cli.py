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
from autoremat.plan import plan
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
    from autoremat.measure import default_loss

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


def demo(target: str, segments: int) -> int:
    """Plan and apply on an example, then show the tree, the choice and what it saved."""
    from autoremat.measure import measure

    model, args, kwargs = load_target(target)
    reference = copy.deepcopy(model)
    chosen = plan(model, args, kwargs, segments=segments)
    print(chosen)
    before = measure(model, args, kwargs, repeats=3)
    chosen.apply(model)
    after = measure(model, args, kwargs, repeats=3)
    loss_ref = _step(reference, args, kwargs, seed=1)
    loss_new = _step(model, args, kwargs, seed=1)
    diff = _max_diff(reference, model)
    mib = 2**20
    print()
    print(f"{'':24}{'no recompute':>14}{'with plan':>14}{'ratio':>8}")
    for label, x, y, unit in [
        ("step peak (MiB)", before.peak / mib, after.peak / mib, ""),
        ("saved for backward (MiB)", before.saved / mib, after.saved / mib, ""),
        ("FLOPs (G)", before.flops / 1e9, after.flops / 1e9, ""),
        ("step time (ms)", before.seconds * 1e3, after.seconds * 1e3, ""),
    ]:
        print(f"{label:24}{x:>14.2f}{y:>14.2f}{y / x if x else float('nan'):>8.2f}{unit}")
    print()
    print(f"one training step, unwrapped vs wrapped: loss {loss_ref:.6f} vs {loss_new:.6f}")
    ok = loss_ref == loss_new and diff == 0.0
    print(
        f"largest difference in gradients and buffers: {diff:.3g} -> "
        f"{'identical' if ok else 'DIFFERENT'}"
    )
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autoremat", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_tree = sub.add_parser("tree", help="print the module tree with paths and I/O shapes")
    p_tree.add_argument("target")
    p_plan = sub.add_parser("plan", help="print the modules chosen for recompute")
    p_plan.add_argument("target")
    p_plan.add_argument("--segments", type=int, default=3, help="preset split-point count")
    p_demo = sub.add_parser("demo", help="plan, apply, check gradients and show the savings")
    p_demo.add_argument("target", nargs="?", default="gpt2")
    p_demo.add_argument("--segments", type=int, default=3)
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
            return demo(ns.target, ns.segments)
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
            print(plan(model, args, kwargs, segments=ns.segments))
        return 0
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"autoremat: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

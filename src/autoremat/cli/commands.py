"""The autoremat command: look at a model's module tree, plan which modules to recompute,
and try a plan out on an example.

Subcommands: tree, plan, demo, bench, fit and examples; ``autoremat --help`` describes them
(:mod:`autoremat.cli.parser`). Every error is one line, ``autoremat: error: ...``, with exit
status 2 (a step that does not fit the device memory shows its memory breakdown under it, one
part a line); warnings go to stderr as ``autoremat: ...``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from torch import nn

from autoremat.cli.arguments import (
    AUTOCAST,
    at_least,
    below_lowest,
    check_segments,
    joined_values,
    loss_from_output,
    parse_budget_arg,
    sharding_arg,
)
from autoremat.cli.demo import demo
from autoremat.cli.parser import VALUE_OPTIONS, parser
from autoremat.cli.targets import CliError, load_target
from autoremat.comparison.harness import bench_target
from autoremat.comparison.report import to_markdown
from autoremat.core.sizes import format_size
from autoremat.examples import EXAMPLES
from autoremat.picture.draw import plot
from autoremat.picture.page import writable
from autoremat.planning.plans import Plan
from autoremat.planning.strategies.budget import BudgetTooLow
from autoremat.record.measure import measure
from autoremat.record.step import LossFn
from autoremat.record.tree import build_tree
from autoremat.training.fit import fit
from autoremat.training.plan import plan
from autoremat.training.scale_batch import batch_size_of, scale_batch

__all__ = ["main"]


def _budget_plan(
    model: nn.Module, args: Any, kwargs: Any, ns: argparse.Namespace, loss_fn: LossFn | None
) -> Plan:
    """``plan(budget=...)`` for ``--budget``; a budget below the lowest reachable peak is an
    error that suggests one that works."""
    value = parse_budget_arg(ns.budget)
    try:
        return plan(model, args, kwargs, budget=value, objective=ns.objective, loss_fn=loss_fn,
                    autocast=AUTOCAST.get(ns.autocast or ""))  # fmt: skip
    except BudgetTooLow as exc:
        start = below_lowest(exc, ns.budget, value, type(model).__name__)
        raise CliError(f"{start}; try --budget {at_least(exc.lowest)}") from None


def _measured(
    chosen: Plan, model: nn.Module, args: Any, kwargs: Any, loss_fn: Any, autocast: Any
) -> str:
    """The measured step peak of ``chosen`` applied to a copy of ``model`` (under
    ``autocast``), against its prediction; a levels plan's (it predicts none) against the
    step's without recompute, which it may not lower (its split points are counted, not
    priced)."""
    wrapped = chosen.apply(copy.deepcopy(model))
    peak = measure(wrapped, args, kwargs, loss_fn=loss_fn, autocast=autocast).peak
    line = f"measured peak {format_size(peak)}"
    if chosen.strategy == "levels":
        without = measure(model, args, kwargs, loss_fn=loss_fn, autocast=autocast).peak
        lowered = f"{1 - peak / without:.0%} lower" if peak < without else "the plan lowers nothing"
        line += f" (without recompute {format_size(without)}: {lowered})"
    if chosen.estimated_peak is not None:
        error = (chosen.estimated_peak - peak) / peak
        line += f" (predicted {format_size(chosen.estimated_peak)}, error {error:+.1%})"
    if chosen.budget is not None:
        line += f"; {'within' if peak <= chosen.budget else 'OVER'} the budget"
    return line


def _plan_command(ns: argparse.Namespace) -> int:
    """``autoremat plan``: print the plan (and, with --measure, its measured peak)."""
    check_segments(ns.segments)
    if ns.budget is None and ns.device_memory is None and ns.objective != "time":
        raise CliError("--objective applies to budget and device plans: add --budget")
    sharding = sharding_arg(ns.sharding, ns.world_size, ns.fsdp_units)
    if ns.device_memory is None and (sharding or ns.optimizer):
        raise CliError("--optimizer and --sharding size the whole step: add --device-memory")
    if ns.loss and ns.budget is None and ns.device_memory is None and not (ns.measure or ns.plot):
        raise CliError("--loss applies to the steps that run: add --budget, --device-memory, "
                       "--measure or --plot (a --segments plan runs no step)")  # fmt: skip
    loss_fn = loss_from_output(ns.loss)
    _writable_outputs(ns)
    model, args, kwargs = load_target(ns.target)
    if ns.device_memory is not None:
        optimizer = None if ns.optimizer == "none" else (ns.optimizer or "adamw")
        chosen = plan(model, args, kwargs, device_memory=_device_memory(ns.device_memory),
                      optimizer=optimizer, sharding=sharding, objective=ns.objective,
                      loss_fn=loss_fn, autocast=AUTOCAST.get(ns.autocast or ""))  # fmt: skip
        print(chosen.summary())
    elif ns.budget is None:
        chosen = plan(model, args, kwargs, segments=ns.segments, loss_fn=loss_fn)
        print(chosen)
    else:
        chosen = _budget_plan(model, args, kwargs, ns, loss_fn)
        print(chosen.summary())
    autocast = AUTOCAST.get(ns.autocast or "")
    if ns.measure:
        print(_measured(chosen, model, args, kwargs, loss_fn, autocast))
    if ns.plot:
        written = plot(chosen, ns.plot, model, args, kwargs, loss_fn=loss_fn, autocast=autocast,
                       measure=ns.measure)  # fmt: skip
        print(f"picture: {written}")
    _save(chosen, ns.save)
    return 0


def _writable_outputs(ns: argparse.Namespace) -> None:
    """``--plot`` and ``--save`` checked before planning: a path that cannot be written fails
    at once (:func:`~autoremat.picture.page.writable`)."""
    for path in (ns.plot, ns.save):
        if path:
            writable(path)


def _save(chosen: Plan, path: str | None) -> None:
    """With ``--save PATH``: the plan written to ``PATH``, said in one line."""
    if path:
        chosen.save(path)
        print(f"plan saved: {path} (autoremat.Plan.load({path!r}).apply(model))")


def _device_memory(text: str) -> int | float | str:
    """What ``--device-memory TEXT`` asks for (as :func:`autoremat.plan` takes it)."""
    try:
        return parse_budget_arg(text)
    except CliError:
        raise CliError(
            f"--device-memory {text} is not understood: give a size (24GiB, 800MB), "
            f"whole bytes, or a percentage of the device's memory (90%)"
        ) from None


def _fit_command(ns: argparse.Namespace) -> int:
    """``autoremat fit``: the batch of TARGET's inputs scaled along ``--batch-dim``."""
    device_memory = _device_memory(ns.device_memory)
    sharding = sharding_arg(ns.sharding, ns.world_size, ns.fsdp_units)
    loss_fn = loss_from_output(ns.loss)
    _writable_outputs(ns)
    model, args, kwargs = load_target(ns.target)
    if ns.device is not None:
        try:
            model.to(ns.device)
        except (AssertionError, RuntimeError) as exc:  # (no CUDA in this torch, no such device)
            raise CliError(f"--device {ns.device}: {str(exc).splitlines()[0]}") from None
    found = fit(
        model,
        lambda b: scale_batch(args, kwargs, b, ns.batch_dim),
        device_memory=device_memory,
        optimizer=None if ns.optimizer == "none" else ns.optimizer,
        loss_fn=loss_fn,
        objective=ns.objective,
        max_batch=ns.max_batch,
        verify=not ns.no_verify,
        reserve=int(ns.reserve) if ns.reserve.isdigit() else ns.reserve,
        autocast=AUTOCAST.get(ns.autocast or ""),
        sharding=sharding,
    )
    example = batch_size_of(args, kwargs, ns.batch_dim)
    print(f"{ns.target} (example batch {example} along dimension {ns.batch_dim}, ", end="")
    print(f"optimizer {ns.optimizer})")
    print(found)
    print(found.plan.summary())
    if ns.plot:
        print(f"picture: {plot(found, ns.plot)}")
    _save(found.plan, ns.save)
    return 1 if found.fits is False else 0


def _run(ns: argparse.Namespace) -> int:
    if ns.command == "examples":
        for name, factory in EXAMPLES.items():
            print(f"{name:10} {' '.join((factory.__doc__ or '').split())}")
        return 0
    if ns.command == "demo":
        return demo(ns.target, ns.segments, ns.budget, ns.rounds, ns.loss)
    if ns.command == "plan":
        return _plan_command(ns)
    if ns.command == "fit":
        return _fit_command(ns)
    model, args, kwargs = load_target(ns.target)
    if ns.command == "tree":
        print(build_tree(model, args, kwargs))
        return 0
    rows = bench_target(
        model,
        args,
        kwargs,
        compile=ns.compile,
        repeats=ns.repeats,
        name=ns.target,
        loss_fn=loss_from_output(ns.loss),
    )
    print(to_markdown(rows))
    return 0


class _Prefixed(logging.Handler):
    """Writes the package's warnings to stderr as ``autoremat: message``."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"autoremat: {record.getMessage()}", file=sys.stderr)


def _warnings_to_stderr() -> None:
    package = logging.getLogger("autoremat")
    if not any(isinstance(h, _Prefixed) for h in package.handlers):
        package.addHandler(_Prefixed(logging.WARNING))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``autoremat`` command with ``argv`` (default ``sys.argv[1:]``); returns the exit
    status: 0, 2 after an error (printed as one line, :func:`_error_text`), 1 when the demo
    finds a step that differs or ``fit``'s batch does not fit when run, or when the reader of
    its output left (``| head``: no traceback)."""
    _warnings_to_stderr()
    tokens = sys.argv[1:] if argv is None else argv
    try:
        status = _run(parser().parse_args(joined_values(tokens, VALUE_OPTIONS)))
        sys.stdout.flush()  # (a reader that left is met here, not in the flush at exit)
        return status
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"autoremat: error: {_error_text(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # (`autoremat ... | head`: the reader left; no traceback)
        # what is still buffered goes nowhere, so the flush at exit raises nothing either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _error_text(exc: Exception) -> str:
    """The error on one line; but a :class:`BudgetTooLow`'s memory breakdown (its indented
    lines, as :class:`~autoremat.training.step_memory.StepMemory` writes them) keeps a line
    per part, and the advice after it its own line."""
    text = str(exc)
    if not isinstance(exc, BudgetTooLow) or "\n  " not in text:
        return " ".join(text.split())
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    return "\n".join(line if line.startswith("  ") else " ".join(line.split()) for line in lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

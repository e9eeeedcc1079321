"""Choosing the modules to recompute: a :class:`Plan`, made by :func:`plan`.

Two strategies: ``levels`` (claims 2-3 of the method, a preset count of split points, from the
tree alone) and ``budget`` (the cheapest recompute whose predicted step peak fits a memory
budget, from a profile of the step).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoremat import wrap
from autoremat.profile import NodeCost, Profile, profile
from autoremat.selective import DEFAULT_SAVE_OPS, POLICIES, check_names
from autoremat.strategies.budget import (
    Infeasible,
    Item,
    min_peak,
    parse_budget,
    predict_peak,
    solve,
)
from autoremat.strategies.levels import choose_levels
from autoremat.tree import Node, build_tree

logger = logging.getLogger("autoremat")

try:
    from torch.distributed.fsdp import FSDPModule as _FSDP_MODULE
except ImportError:  # torch built without distributed support
    _FSDP_MODULE = None

_MiB = 2**20
# The "format" of a saved plan; Plan.load refuses others.
FORMAT = "autoremat.plan/1"
# Bytes a budget plan keeps free below the budget for what the cost model does not see: the
# recompute's copies of small buffers and statistics, measured at up to a few hundred bytes.
HEADROOM = 1024
# A budget this close (a fraction of it) above the lowest reachable peak gets a warning.
NEAR_LOWEST = 0.02
# What a budget plan minimises (plan's ``objective``).
OBJECTIVES = ("time", "flops")


def _own_class(module: nn.Module) -> type:
    """The module's class before autoremat or FSDP2 (``fully_shard``) swapped it for a
    subclass of their own (``CheckpointedBlock``, ``FSDPBlock``)."""
    cls = type(module)
    while True:
        if "_autoremat_base" in cls.__dict__:
            cls = cls._autoremat_base
        elif _FSDP_MODULE is not None and _FSDP_MODULE in cls.__bases__ and len(cls.__bases__) == 2:
            cls = next(b for b in cls.__bases__ if b is not _FSDP_MODULE)
        else:
            return cls


def structure(model: nn.Module) -> tuple[str, ...]:
    """The module structure of ``model``: ``"path Class"`` for every module in
    ``named_modules()`` order (``""`` is the root), with the classes modules had before
    autoremat wrapped them or ``fully_shard`` sharded them."""
    return tuple(f"{path} {_own_class(m).__qualname__}" for path, m in model.named_modules())


def fingerprint(model: nn.Module) -> str:
    """A short hash of :func:`structure`: equal for models built the same way."""
    return hashlib.sha256("\n".join(structure(model)).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Choice:
    """One chosen module of a budget plan: bytes its recompute frees, FLOPs and seconds (as
    profiled) it adds, and how
    it is recomputed (``"full"``, or a selective way: a key of
    :data:`autoremat.selective.POLICIES`)."""

    path: str
    freed: int
    flops: int
    mode: str = "full"
    seconds: float | None = None


@dataclass(frozen=True)
class Plan:
    """Which modules of a model to recompute in backward, and how they were chosen.

    ``modules`` are qualified names as in ``model.named_modules()`` (``""`` is the model
    itself), never one inside another; those also in ``selective`` are recomputed
    selectively: ``selective`` maps each to the ops whose outputs it keeps
    (:mod:`autoremat.selective`).
    A budget plan also predicts the step peak with and without it (bytes, as
    :func:`autoremat.measure` defines ``peak``), and the FLOPs and seconds its recomputes add
    (seconds as profiled: the recomputed ops' time plus checkpoint's per-op overheads); its
    ``objective`` is what it minimised (``"time"`` or ``"flops"``).
    ``print(plan)`` shows the choice and the tree with it marked ``*``.
    """

    modules: tuple[str, ...]
    strategy: str
    model_class: str
    segments: int | None = None
    budget: int | None = None
    estimated_peak: int | None = None
    baseline_peak: int | None = None
    recompute_flops: int | None = None
    objective: str | None = None
    recompute_seconds: float | None = None
    choices: tuple[Choice, ...] = ()
    selective: dict[str, tuple[str, ...]] = field(default_factory=dict, hash=False)
    fingerprint: str | None = None
    structure: tuple[str, ...] = field(default=(), repr=False)
    tree: Node | None = field(default=None, repr=False, compare=False)

    def apply(self, model: nn.Module) -> nn.Module:
        """Wrap the plan's modules of ``model`` in place (claim 4) and return ``model``.

        Raises:
            ValueError: ``model``'s module structure is not the one the plan was made for
                (the message names the modules that no longer exist), or see
                :func:`autoremat.wrap.apply`. The model is unchanged when it raises.
        """
        self.check(model)
        return wrap.apply(model, self.modules, selective=self.selective)

    def check(self, model: nn.Module) -> None:
        """Raise ``ValueError`` unless ``model`` has the module structure the plan was made
        for (same :func:`fingerprint`); the message names the modules that no longer exist
        and the ones that are new."""
        if self.fingerprint is None or fingerprint(model) == self.fingerprint:
            return
        now = structure(model)
        have = {line.split(" ", 1)[0] for line in now}
        wanted = {e for m in self.modules for e in wrap.covered(m)}
        missing = sorted(p for p in wanted if p not in have)
        gone = sorted(set(self.structure) - set(now))
        new = sorted(set(now) - set(self.structure))

        def names(lines: list[str]) -> str:
            shown = ", ".join(repr(x if x[:1] != " " else "(root)" + x) for x in lines[:5])
            return shown + (f" and {len(lines) - 5} more" if len(lines) > 5 else "")

        detail = []
        if missing:
            detail.append(f"the plan's modules {names(missing)} no longer exist")
        if gone:
            detail.append(f"modules no longer there: {names(gone)}")
        if new:
            detail.append(f"new modules: {names(new)}")
        other = type(model).__name__
        if other != self.model_class:
            raise ValueError(
                f"this plan was made for a {self.model_class}, not a {other}: "
                f"{'; '.join(detail[:1])}. Make a plan from this model "
                f"(autoremat.plan(model, ...))"
            )
        raise ValueError(
            f"this plan was made for a {self.model_class} with another module structure "
            f"(fingerprint {self.fingerprint}, the model's is {fingerprint(model)}): "
            f"{'; '.join(detail) or 'the structure differs'}. Make a new plan from this model "
            f"(autoremat.plan(model, ...))"
        )

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON data (what :meth:`save` writes; no tree)."""
        return {
            "format": FORMAT,
            "model_class": self.model_class,
            "fingerprint": self.fingerprint,
            "strategy": self.strategy,
            "modules": list(self.modules),
            "segments": self.segments,
            "budget": self.budget,
            "estimated_peak": self.estimated_peak,
            "baseline_peak": self.baseline_peak,
            "recompute_flops": self.recompute_flops,
            "objective": self.objective,
            "recompute_seconds": self.recompute_seconds,
            "choices": [
                {
                    "path": c.path,
                    "freed": c.freed,
                    "flops": c.flops,
                    "mode": c.mode,
                    "seconds": c.seconds,
                }
                for c in self.choices
            ],
            "selective": {path: list(ops) for path, ops in self.selective.items()},
            "structure": list(self.structure),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """The plan :meth:`to_dict` gave. Raises ``ValueError`` naming the field that is
        missing or of the wrong type."""
        return _plan_from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan to ``path`` as indented JSON (see :meth:`to_dict`)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan :meth:`save` wrote. :meth:`apply` then refuses a model whose module
        structure changed since the plan was made.

        Raises:
            ValueError: the file is not JSON, or not a plan of this format (the message names
                the field).
        """
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{os.fspath(path)!r} is not a saved plan: not JSON ({e})") from None
        return _plan_from_dict(data, where=repr(os.fspath(path)))

    def table(self) -> str:
        """The chosen modules with what each frees and adds, and the predicted peak."""
        if self.strategy != "budget":
            return "\n".join(f"  {p or '(root)'}" for p in self.modules)
        width = max([len(c.path or "(root)") for c in self.choices] + [6])
        rows = [
            f"  {'module':{width}}  {'how':13}  {'frees MiB':>10}  {'adds GFLOP':>10}  "
            f"{'adds ms':>8}"
        ]
        rows += [
            f"  {c.path or '(root)':{width}}  {c.mode:13}  {c.freed / _MiB:>10.2f}  "
            f"{c.flops / 1e9:>10.3f}  " + ("" if c.seconds is None else f"{c.seconds * 1e3:>8.1f}")
            for c in self.choices
        ]
        assert self.estimated_peak is not None and self.baseline_peak is not None
        assert self.budget is not None and self.recompute_flops is not None
        rows.append(
            f"predicted peak {self.estimated_peak / _MiB:.2f} MiB (budget "
            f"{self.budget / _MiB:.2f} MiB, no recompute {self.baseline_peak / _MiB:.2f} MiB, "
            f"{self.estimated_peak / self.baseline_peak:.0%}), recompute adds "
            f"{self.recompute_flops / 1e9:.3f} GFLOP"
            + (
                ""
                if self.recompute_seconds is None
                else f" and {self.recompute_seconds * 1e3:.1f} ms (as profiled)"
            )
            + ("" if self.objective is None else f"; minimised {self.objective}")
        )
        for mode in dict.fromkeys(c.mode for c in self.choices if c.mode != "full"):
            ops = next(
                (self.selective[c.path] for c in self.choices if c.mode == mode), POLICIES[mode]
            )
            rows.append(f"{mode} keeps the outputs of: {', '.join(ops)}")
        return "\n".join(rows)

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.tree is not None:
            lines += ["", self.tree.render(marked=frozenset(self.modules))]
        return "\n".join(lines)

    def summary(self) -> str:
        """The header and :meth:`table`, without the tree."""
        how = {
            "levels": f"levels, segments={self.segments}",
            "budget": f"budget {self.budget / _MiB:.2f} MiB" if self.budget else "budget",
        }.get(self.strategy, self.strategy)
        head = (
            f"Plan for {self.model_class} ({how}): recompute {len(self.modules)} module"
            f"{'' if len(self.modules) == 1 else 's'}"
        )
        lines = [head, self.table()] if self.modules or self.strategy == "budget" else [head]
        return "\n".join(lines)


def plan(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    segments: int | None = None,
    budget: int | float | str | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    selective: bool = True,
    objective: str = "time",
) -> Plan:
    """Choose the modules of ``model`` to recompute.

    With ``segments`` (default 3 when no budget is given), the levels strategy of the method
    (claims 2-3): the tree is walked level by level until the scheme holds more than
    ``segments`` modules (:func:`autoremat.strategies.choose_levels`).

    With ``budget``, the budget strategy: profile one training step (``loss_fn`` as in
    :func:`autoremat.measure`), then choose the modules, anywhere in the tree and never one
    inside another, whose recompute costs least while the predicted step peak stays within the
    budget (:mod:`autoremat.strategies.budget`). ``budget`` is bytes (int), a fraction of the
    no-recompute peak (float, ``0 < f <= 1``), a percentage (``"50%"``) or a size string
    (``"800MB"``, ``"6GiB"``). A budget at or above the no-recompute peak gives an empty plan.
    Each chosen module is recomputed whole, or, with ``selective`` (the default), possibly
    selectively: the outputs of its matrix products, convolutions and attention kernels are
    kept and only the other ops are recomputed (:mod:`autoremat.selective`); the planner picks
    whichever fits the budget at the least cost. ``objective`` says what cost is: ``"time"``
    (the default), the recompute's time as profiled (its ops timed one by one, pointwise ops
    included, plus checkpoint's and selective checkpointing's measured per-op overheads), or
    ``"flops"``, its FLOPs as ``FlopCounterMode`` counts them (pointwise ops free; bytes written
    break ties; the plan is the same on every machine).

    Both run the model on the example inputs and leave it as they found it.

    Raises:
        ValueError: ``segments`` negative; both ``segments`` and ``budget``; a malformed or
            non-positive budget (the message lists the accepted forms); a budget below the
            lowest peak any plan reaches (the message states that peak); no submodule ran.
        TypeError: ``segments`` not an int, ``budget`` of another type, or ``model`` not an
            ``nn.Module``.
        ExampleInputsError: (a ValueError) the example inputs fail in forward; the message
            names the module.
    """
    if segments is not None and budget is not None:
        raise ValueError(
            "segments and budget are mutually exclusive: pass segments=K for the levels "
            "strategy, or budget=... for the memory-budget strategy"
        )
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
            parse_budget(budget, 1)  # raises the TypeError that lists the forms
        parse_budget(budget, 1)  # malformed budgets fail before the model runs
        if objective not in OBJECTIVES:
            raise ValueError(
                f"objective must be one of {', '.join(map(repr, OBJECTIVES))}, got {objective!r}"
            )
        return _budget_plan(model, args, kwargs, budget, loss_fn, selective, objective)
    segments = 3 if segments is None else segments
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError(f"segments must be an int, got {type(segments).__name__}")
    if segments < 0:
        raise ValueError(f"segments must be >= 0, got {segments}; try segments=3")
    tree = build_tree(model, args, kwargs)
    _require_submodules(model, tree)
    chosen = choose_levels(tree, segments)
    return Plan(
        modules=tuple(n.path for n in chosen),
        strategy="levels",
        model_class=type(model).__name__,
        segments=segments,
        fingerprint=fingerprint(model),
        structure=structure(model),
        tree=tree,
    )


def _plan_from_dict(data: Any, where: str = "the data") -> Plan:
    """Validate ``data`` field by field and build the :class:`Plan` (see :meth:`Plan.load`)."""

    def bad(why: str) -> ValueError:
        return ValueError(f"{where} is not a saved autoremat plan: {why}")

    if not isinstance(data, dict):
        raise bad(f"expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise bad(f"'format' is {data.get('format')!r}, expected {FORMAT!r}")

    def get(key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
        if key not in data:
            raise bad(f"field {key!r} is missing")
        value = data[key]
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, kind):
            raise bad(f"field {key!r} is {value!r}, expected {_kind_name(kind)}")
        return value

    def strings(key: str) -> tuple[str, ...]:
        value = get(key, list)
        if not all(isinstance(x, str) for x in value):
            raise bad(f"field {key!r} must be a list of strings")
        return tuple(value)

    def count(key: str) -> int | None:
        value = get(key, int, optional=True)
        if value is not None and value < 0:
            raise bad(f"field {key!r} is {value}, expected a count >= 0")
        return value

    strategy = get("strategy", str)
    if strategy not in ("levels", "budget"):
        raise bad(f"field 'strategy' is {strategy!r}, expected 'levels' or 'budget'")
    modules = strings("modules")
    for entry in modules:
        if not _ENTRY.fullmatch(entry):
            raise bad(f"module entry {entry!r} is not a module path or path[i:j]")
    choices = []
    for c in get("choices", list):
        if not (
            isinstance(c, dict)
            and isinstance(c.get("path"), str)
            and all(
                isinstance(c.get(k), int) and not isinstance(c.get(k), bool)
                for k in ("freed", "flops")
            )
            and c.get("mode", "full") in ("full", *POLICIES)
        ):
            raise bad(
                f"choice {c!r} must be an object with path (str), freed and flops (int), "
                f"mode ({', '.join(map(repr, ('full', *POLICIES)))})"
            )
        seconds = c.get("seconds")
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0
        ):
            raise bad(f"choice {c!r}: seconds must be a number >= 0 or null")
        choices.append(Choice(c["path"], c["freed"], c["flops"], c.get("mode", "full"), seconds))
    raw = get("selective", (dict, list))
    if isinstance(raw, list):  # the first form: a list of paths, all keeping 'save_ops'
        ops = list(data.get("save_ops", DEFAULT_SAVE_OPS))
        raw = {path: ops for path in strings("selective")}
    selective = {}
    for entry, ops in raw.items():
        if not isinstance(ops, list):
            raise bad(f"field 'selective' maps {entry!r} to {ops!r}, expected a list of op names")
        try:
            selective[entry] = check_names(ops)
        except (TypeError, ValueError) as e:
            raise bad(f"field 'selective', entry {entry!r}: {e}") from None
    odd = [e for e in selective if e not in modules]
    if odd:
        raise bad(f"selective entries {odd[:5]!r} are not among 'modules'")
    fp = get("fingerprint", str, optional=True)
    objective = data.get("objective")
    if objective is not None and objective not in OBJECTIVES:
        raise bad(f"field 'objective' is {objective!r}, expected one of {OBJECTIVES} or null")
    total_seconds = data.get("recompute_seconds")
    if total_seconds is not None and (
        isinstance(total_seconds, bool)
        or not isinstance(total_seconds, (int, float))
        or not total_seconds >= 0
    ):
        raise bad(f"field 'recompute_seconds' is {total_seconds!r}, expected a number >= 0")
    return Plan(
        modules=modules,
        strategy=strategy,
        model_class=get("model_class", str),
        segments=count("segments"),
        budget=count("budget"),
        estimated_peak=count("estimated_peak"),
        baseline_peak=count("baseline_peak"),
        recompute_flops=count("recompute_flops"),
        objective=objective,
        recompute_seconds=total_seconds,
        choices=tuple(choices),
        selective=selective,
        fingerprint=fp,
        structure=strings("structure"),
    )


_ENTRY = re.compile(r"[^\s\[\]]*(\[\d+:\d+\])?")


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(
        {"str": "a string", "int": "an integer", "list": "a list", "dict": "an object"}.get(
            k.__name__, k.__name__
        )
        for k in kinds
    )


def _require_submodules(model: nn.Module, tree: Node) -> None:
    if tree.is_leaf:
        raise ValueError(
            f"{type(model).__name__} has no submodules that ran on the example inputs: there "
            f"is nothing to recompute; wrap it in a model with submodules, or check the inputs"
        )


def planning_tree(
    prof: Profile,
    selective: bool = True,
    skipped: dict[str, str] | None = None,
    objective: str = "time",
) -> Item:
    """The budget strategy's view of a profile: one :class:`Item` per node, children in the
    order they ended. A module called several times whose calls interleave with a sibling's
    (a dropout used after attention and after the MLP), and its descendants, are not
    candidates: the cost model places each node at one span. Modules that cannot be wrapped
    are not candidates either. With ``selective``, each candidate has a second way to be
    recomputed: selectively, in each way of :data:`autoremat.selective.POLICIES` that differs
    (its options, :class:`Item` ``mode="selective"``...). With ``objective="time"`` each way is
    priced by its measured time (:class:`~autoremat.profile.NodeCost` ``op_seconds`` and the
    profile's per-op overheads), so cheap in FLOPs is not taken for free in time; with
    ``"flops"``, by FLOPs (:attr:`Item.cost`). The modules left
    out that would have freed memory are written to ``skipped``, with the reason."""
    skipped = {} if skipped is None else skipped

    def timed(seconds: float) -> float | None:
        return seconds if objective == "time" else None

    def buffer_bytes(module: nn.Module) -> int:
        # the wrap copies the module's buffers around each recompute (wrap.py)
        return sum(b.numel() * b.element_size() for b in module.buffers())

    def wrappable(module: nn.Module) -> bool:
        return not isinstance(module, torch.jit.ScriptModule) and "forward" not in vars(module)

    def build(node: Node, allowed: bool, why: str = "") -> Item:
        cost = prof[node.path]
        if not allowed and why and cost.freeable > 0:
            skipped[node.path] = why
        elif allowed and not wrappable(node.module) and cost.freeable > 0:
            skipped[node.path] = (
                "it is a TorchScript module"
                if isinstance(node.module, torch.jit.ScriptModule)
                else "its forward was replaced on the instance"
            )
        kids = sorted(node.children, key=lambda c: prof[c.path].end)
        clash = set()
        for k, after in enumerate(kids):
            for before in kids[:k]:
                if prof[after.path].start <= prof[before.path].end:
                    # interleaved calls: the module called several times is left out (the
                    # solver then only checks the points after its sibling); if neither was
                    # called several times, both
                    shared = {c.path for c in (before, after) if c.calls > 1}
                    clash.update(shared or {before.path, after.path})
        recompute_peak = cost.recompute_peak + buffer_bytes(node.module)
        options: list[Item] = []
        for way in cost.selective_ways if selective else ():
            if way.freeable <= 0 or way.flops >= cost.flops:
                continue  # frees nothing, or keeps nothing worth keeping
            if any(
                (o.freed, o.flops, o.inside, o.inside_from)
                == (way.freeable, way.flops, way.held, way.held_from)
                for o in options
            ):
                continue  # the same as a way already offered (no batched matmuls here)
            options.append(
                Item(
                    path=node.path,
                    start=cost.start,
                    end=cost.end,
                    freed=way.freeable,
                    flops=way.flops,
                    recompute_peak=way.recompute_peak + buffer_bytes(node.module),
                    written=way.written,
                    inside=way.held,
                    inside_from=way.held_from,
                    mode=way.mode,
                    seconds=timed(_way_seconds(prof, cost, way.mode)),
                )
            )
        return Item(
            path=node.path,
            start=cost.start,
            end=cost.end,
            freed=cost.freeable,
            flops=cost.flops,
            candidate=allowed and wrappable(node.module),
            children=tuple(
                build(
                    c,
                    allowed and c.path not in clash,
                    "it runs several times, interleaved with a sibling's calls"
                    if allowed and c.path in clash
                    else "",
                )
                for c in kids
            ),
            recompute_peak=recompute_peak,
            runs=tuple(
                (
                    i,
                    j,
                    freed,
                    sum(prof[c.path].flops for c in kids[i:j]),
                    peak + sum(buffer_bytes(c.module) for c in kids[i:j]),
                )
                for i, j, freed, peak in cost.runs
            )
            if allowed
            else (),
            written=cost.written,
            inside=cost.held,
            inside_from=cost.held_from,
            options=tuple(options),
            seconds=timed(_way_seconds(prof, cost, "full")),
        )

    return build(prof.tree, True)


def recompute_seconds(prof: Profile, item: Item) -> float:
    """The seconds recomputing ``item`` (a node of :func:`planning_tree`, in its ``mode``, or a
    run ``path[i:j]``) adds, as ``prof`` timed it (:attr:`Item.seconds` with
    ``objective="time"``)."""
    match = wrap._RUN.fullmatch(item.path)
    if match is not None:
        return sum(
            recompute_seconds(prof, Item(path, 0, 0, 0, 0)) for path in wrap.covered(item.path)
        )
    return _way_seconds(prof, prof[item.path], item.mode)


def _way_seconds(prof: Profile, cost: NodeCost, mode: str) -> float:
    if mode == "full":
        return cost.op_seconds + cost.ops * prof.op_overhead
    way = next(w for w in cost.selective_ways if w.mode == mode)
    return way.op_seconds + cost.ops * prof.selective_op_overhead


def _budget_plan(
    model: nn.Module,
    args: tuple[Any, ...] | Any,
    kwargs: dict[str, Any] | None,
    budget: int | float | str,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    selective: bool,
    objective: str,
) -> Plan:
    prof = profile(model, args, kwargs, loss_fn=loss_fn)
    _require_submodules(model, prof.tree)
    limit = parse_budget(budget, prof.peak)
    skipped: dict[str, str] = {}
    root = planning_tree(prof, selective, skipped, objective)
    forward, after = prof.forward_points, prof.backward_points
    if skipped:
        logger.warning(
            "%d module(s) of %s cannot be recomputed on their own and were left out of the "
            "plan (their parents can still be chosen): %s",
            len(skipped),
            type(model).__name__,
            "; ".join(f"{p!r}: {why}" for p, why in list(skipped.items())[:5])
            + (" ..." if len(skipped) > 5 else ""),
        )
    try:
        chosen = [] if limit >= prof.peak else solve(root, after, limit - HEADROOM, forward)
    except Infeasible:
        lowest = min_peak(root, after, forward) + HEADROOM
        raise ValueError(
            f"budget {limit / _MiB:.2f} MiB ({budget!r}) is below the lowest peak that "
            f"recomputing modules of {type(model).__name__} reaches, {lowest / _MiB:.2f} MiB "
            f"({lowest / prof.peak:.0%} of the {prof.peak / _MiB:.2f} MiB peak without "
            f"recompute; about {lowest} bytes). Try budget={lowest}, a smaller batch, or "
            f"mixed precision."
        ) from None
    seconds = {i.path: recompute_seconds(prof, i) for i in chosen}
    if chosen and limit < prof.peak:
        try:
            solve(root, after, int(limit * (1 - NEAR_LOWEST)) - HEADROOM, forward)
        except Infeasible:
            logger.warning(
                "budget %.2f MiB is within %.0f%% of the lowest peak recomputing modules of %s "
                "reaches: the plan recomputes about all it can (%d entries, %.3f GFLOP more); a "
                "slightly larger budget may cost much less",
                limit / _MiB,
                NEAR_LOWEST * 100,
                type(model).__name__,
                len(chosen),
                sum(i.flops for i in chosen) / 1e9,
            )
    return Plan(
        modules=tuple(i.path for i in chosen),
        strategy="budget",
        model_class=type(model).__name__,
        budget=limit,
        estimated_peak=predict_peak(after, chosen, forward),
        baseline_peak=prof.peak,
        recompute_flops=sum(i.flops for i in chosen),
        objective=objective,
        recompute_seconds=sum(seconds.values()),
        choices=tuple(Choice(i.path, i.freed, i.flops, i.mode, seconds[i.path]) for i in chosen),
        selective={i.path: POLICIES[i.mode] for i in chosen if i.mode in POLICIES},
        fingerprint=fingerprint(model),
        structure=structure(model),
        tree=prof.tree,
    )

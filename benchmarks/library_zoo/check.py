"""The library zoo's checks of one architecture in one configuration (precision, the model's
own checkpointing on or off): :func:`check` gives one :class:`ZooRow`.

For the configuration it profiles the model once, makes two budget plans from the profile (a
mid-range one: 50% of the no-recompute peak, or halfway between the lowest budget and the peak
when 50% is below the lowest; and the lowest), and for each plan, on a fresh copy:

- trains two steps (SGD, dropout on, the same seeds) and compares loss, every gradient, every
  parameter and buffer afterwards bit for bit with the model trained without recompute (and
  without its own checkpointing: the training autoremat reproduces, ``docs/guide.md``);
- proves that every entry was recomputed (:class:`autoremat.comparison.RecomputeCounter`);
- measures the step's peak (:func:`autoremat.measure`) against the budget and the estimate.

The user's model is checked to be left as found (:mod:`library_zoo.state`) after each call
that runs it. Every stage catches its error into the row, so one model never stops the zoo.
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch
from torch import nn

import autoremat
from autoremat.comparison.applied import as_applied
from autoremat.comparison.contenders import every_block
from autoremat.comparison.recomputed import RecomputeCounter
from autoremat.core import huggingface
from autoremat.core.host_rng import get_host_rng, set_host_rng
from autoremat.core.own_checkpointing import switched_off, switched_on
from autoremat.planning.plan import plan_from_profile, profile_lowest
from autoremat.record.step import default_loss
from autoremat.training.scale_batch import scale_batch
from library_zoo import ZooModel, own_checkpointing_on
from library_zoo.state import changes, probe, state_of

__all__ = [
    "ESTIMATE_BOUNDS",
    "CallsCheck",
    "PlanCheck",
    "ZooRow",
    "check",
    "check_calls",
    "trajectory",
]

STEPS = 2
LR = 1e-2
# (estimated - measured) / measured allowed for the mid and the lowest plan: the memory
# prediction's promise (docs/cost-model.md)
ESTIMATE_BOUNDS = {"mid": (-0.005, 0.02), "lowest": (-0.005, 0.05)}


@dataclass
class PlanCheck:
    """One plan on a fresh copy: what it chose and what was measured of it."""

    budget: int
    estimated: int | None = None
    measured: int | None = None
    entries: int = 0
    selective: int = 0
    exact: bool = False
    recomputed: bool = False
    switch_restored: bool = True
    error: str = ""

    @property
    def held(self) -> bool:
        return self.measured is not None and self.measured <= self.budget

    @property
    def estimate_error(self) -> float | None:
        if self.estimated is None or not self.measured:
            return None
        return (self.estimated - self.measured) / self.measured


@dataclass
class ZooRow:
    """One architecture in one configuration."""

    model: str
    library: str
    precision: str
    own: bool
    peak: int | None = None
    lowest: int | None = None
    every_block: int | None = None
    plan_seconds: float | None = None
    mid: PlanCheck | None = None
    low: PlanCheck | None = None
    left_as_found: list[str] = field(default_factory=list)
    error: str = ""

    def failures(self) -> list[str]:
        """What breaks the zoo's promise: a crash; a plan that did not train exactly, was not
        recomputed, measured over its budget (fp32 and bf16: every plan held in both since
        autocast's cast cache is priced) or estimated outside :data:`ESTIMATE_BOUNDS`; a lowest
        plan with no entry (every zoo model has something worth recomputing: with checkpoint
        made a plain call, no run saves memory, every plan is empty, and each check above
        passes); the user's model left changed."""
        where = f"{self.model} {self.precision} own={self.own}"
        found = [f"{where}: {self.error}"] if self.error else []
        found += [f"{where}: {c}" for c in self.left_as_found]
        for name, c in (("mid", self.mid), ("lowest", self.low)):
            if c is None:
                continue
            bad = [c.error] if c.error else []
            bad += [] if c.exact or c.error else ["not exact"]
            bad += [] if c.recomputed or c.error else ["not recomputed"]
            bad += ["recomputes nothing"] if name == "lowest" and not (c.entries or c.error) else []
            over = not c.held and not c.error
            bad += ["over budget"] if over else []
            bad += _estimate_outside(c, name)
            bad += [] if c.switch_restored else ["own checkpointing not off while applied"]
            found += [f"{where} {name}: {b}" for b in bad]
        return found


def _estimate_outside(c: PlanCheck, name: str) -> list[str]:
    """The estimate error of plan ``name`` (mid, lowest) when outside its bounds."""
    under, over = ESTIMATE_BOUNDS[name]
    err = c.estimate_error
    if err is None or under <= err <= over:
        return []
    return [f"estimate {err:+.2%} (bounds {under:+.1%} to {over:+.1%})"]


def _dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (``None``: fp32, no autocast)."""
    return torch.bfloat16 if precision == "bf16" else None


def _autocast(precision: str) -> Any:
    dtype = _dtype(precision)
    return contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)


def trajectory(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], precision: str
) -> list[torch.Tensor]:
    """Train ``STEPS`` SGD steps (torch's, Python's and NumPy's generators seeded ``k`` before
    step ``k``: Wav2Vec2's SpecAugment masks are NumPy's; Python's and NumPy's put back after);
    every loss and gradient on the way and every parameter and buffer after, in order."""
    seen: list[torch.Tensor] = []
    params = [p for p in model.parameters() if p.requires_grad]
    host = get_host_rng()
    for k in range(STEPS):
        for p in params:
            p.grad = None
        torch.manual_seed(k)
        random.seed(k)
        numpy.random.seed(k)
        with _autocast(precision):
            loss = default_loss(model(*args, **kwargs))
        loss.backward()
        seen.append(loss.detach().clone())
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    seen.append(p.grad.clone())
                    p.sub_(LR * p.grad)
    seen += [t.detach().clone() for t in model.state_dict().values()]
    set_host_rng(host)
    return seen


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


def _reference(model: nn.Module, args: Any, kwargs: Any, precision: str) -> list[torch.Tensor]:
    """The training autoremat reproduces: no recompute, the model's own checkpointing off, a
    Hugging Face model's key/value cache off in training (as every plan runs it)."""
    plain = copy.deepcopy(model)
    huggingface.turn_cache_off_in_training(plain, warn=False)
    with switched_off(plain), torch.random.fork_rng(devices=[]):
        return trajectory(plain, args, kwargs, precision)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def _check_plan(
    model: nn.Module, chosen: autoremat.Plan, args: Any, kwargs: Any, precision: str,
    reference: list[torch.Tensor],
) -> PlanCheck:
    """``chosen`` applied to a fresh copy of ``model``: trained, proved, measured."""
    assert chosen.budget is not None
    result = PlanCheck(budget=chosen.budget, estimated=chosen.estimated_peak,
                       entries=len(chosen.modules), selective=len(chosen.selective))
    try:
        applied = copy.deepcopy(model)
        own = len(switched_on(applied))
        chosen.apply(applied)
        off_while_applied = not switched_on(applied)
        entries = autoremat.wrap.wrapped_paths(applied)
        with torch.random.fork_rng(devices=[]), RecomputeCounter() as seen:
            got = trajectory(applied, args, kwargs, precision)
        result.recomputed = not seen.missing(entries)
        result.exact = _same(reference, got)
        measured = autoremat.measure(applied, args, kwargs, autocast=_dtype(precision))
        result.measured = measured.peak
        autoremat.remove(applied)
        result.switch_restored = off_while_applied and len(switched_on(applied)) == own
    except Exception as exc:  # one plan's failure is a cell of the table, not the zoo's end
        result.error = _error(exc)
    return result


def _left_as_found(model: nn.Module, call: str, work: Callable[[], Any], row: ZooRow) -> Any:
    """``work()``, noting in ``row`` what it left changed in ``model``."""
    before = state_of(model)
    try:
        return work()
    finally:
        row.left_as_found += [f"{call}: {c}" for c in changes(before, state_of(model))]


def _mid_budget(peak: int, lowest: int) -> int:
    return peak // 2 if peak // 2 >= lowest else (peak + lowest) // 2


def _every_block_peak(model: nn.Module, args: Any, kwargs: Any, precision: str) -> int | None:
    applied = as_applied(every_block().apply(copy.deepcopy(model), args, kwargs))
    if applied is None:
        return None
    return autoremat.measure(applied.model, args, kwargs, autocast=_dtype(precision)).peak


def check(entry: ZooModel, precision: str, own: bool, objective: str = "time") -> ZooRow:
    """One architecture in one configuration (module docstring). ``objective``: the plans'
    (``"time"``, the default, prices recompute by measured op times, so two runs may choose
    differently; ``"flops"`` chooses the same plan on every run)."""
    row = ZooRow(entry.name, entry.library, precision, own)
    try:
        model, args, kwargs = entry.build()
        if own and not own_checkpointing_on(model):
            row.error = "no own checkpointing switch"
            return row
        reference = _reference(model, args, kwargs, precision)
        started = time.perf_counter()
        prof = _left_as_found(model, "profile", lambda: autoremat.profile(
            model, args, kwargs, autocast=_dtype(precision)), row)
        row.lowest = profile_lowest(prof, objective=objective)
        row.peak = prof.peak
        budgets = {"mid": _mid_budget(row.peak, row.lowest), "low": row.lowest}
        plans = {
            k: plan_from_profile(model, prof, b, objective=objective) for k, b in budgets.items()
        }
        row.plan_seconds = time.perf_counter() - started
        row.mid = _check_plan(model, plans["mid"], args, kwargs, precision, reference)
        row.low = _check_plan(model, plans["low"], args, kwargs, precision, reference)
        row.every_block = _every_block_peak(model, args, kwargs, precision)
    except Exception as exc:
        row.error = _error(exc)
    return row


@dataclass
class CallsCheck:
    """The user's own model after ``plan``, ``measure`` and ``fit`` (fp32): what they left
    changed, whether a forward still gives what a fresh model gives (hooks, hidden states),
    and the batch ``fit`` found (or why not)."""

    model: str
    left_as_found: list[str] = field(default_factory=list)
    probe_same: bool | None = None
    fit: str = ""
    error: str = ""

    def failures(self) -> list[str]:
        """A crash, the user's model left changed, or its forward no longer a fresh one's."""
        found = [f"{self.model} calls: {self.error}"] if self.error else []
        found += [f"{self.model}: {x}" for x in self.left_as_found]
        if self.probe_same is False:
            found.append(f"{self.model}: forward differs from a fresh model's after the calls")
        return found


def _fit(model: nn.Module, args: Any, kwargs: Any, row: ZooRow) -> str:
    """``fit`` at twice the example batch's no-recompute training memory: the batch found."""
    need = autoremat.predict_memory(model, args, kwargs, optimizer="sgd").device
    make = lambda b: scale_batch(args, kwargs, b)  # noqa: E731
    found = autoremat.fit(model, make, device_memory=2 * need, optimizer="sgd", max_batch=64,
                          verify=False)
    return f"batch {found.batch} ({len(found.plan.modules)} entries)"


def check_calls(entry: ZooModel) -> CallsCheck:
    """``plan``, ``measure`` and ``fit`` on the user's model leave it as found (module
    docstring), and its forward (``output_hidden_states=True`` on Hugging Face models) gives
    what a fresh copy's gives."""
    result = CallsCheck(entry.name)
    row = ZooRow(entry.name, entry.library, "fp32", False)
    try:
        model, args, kwargs = entry.build()
        lowest = _left_as_found(model, "lowest_budget", lambda: autoremat.lowest_budget(
            model, args, kwargs), row)
        _left_as_found(model, "plan", lambda: autoremat.plan(model, args, kwargs,
                                                             budget=lowest), row)
        _left_as_found(model, "measure", lambda: autoremat.measure(model, args, kwargs), row)
        try:
            result.fit = _left_as_found(model, "fit", lambda: _fit(model, args, kwargs, row), row)
        except Exception as exc:
            result.fit = f"refused: {_error(exc)}"
        fresh, _, _ = entry.build()
        got, expected = probe(model, args, kwargs), probe(fresh, args, kwargs)
        result.probe_same = _same(expected, got)
    except Exception as exc:
        result.error = _error(exc)
    result.left_as_found = row.left_as_found
    return result

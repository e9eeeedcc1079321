"""Running contenders side by side: :func:`compare` (and :func:`bench_target`, the ``autoremat
bench`` set of contenders) applies each contender to a fresh copy of the model, measures one
step, checks its gradients against the baseline's, times interleaved steps, and makes the
:class:`~autoremat.comparison.Row` objects."""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoremat.comparison.applied import BASELINE, Applied, Args, Contender, Kwargs, MiB, as_applied
from autoremat.comparison.contenders import (
    budget_plan,
    describe_paths,
    every_block,
    levels_plan,
    no_recompute,
    plan_without_tree,
    sqrt_segments,
    unwrap,
)
from autoremat.comparison.gradients import StepResult, check_grads, identical, one_step, worst_error
from autoremat.comparison.inductor import compiled
from autoremat.comparison.row import Row
from autoremat.comparison.saved import saved_by_autograd
from autoremat.core.clock import timed
from autoremat.core.progress import Progress
from autoremat.record.measure import measure
from autoremat.record.snapshot import preserved
from autoremat.record.step import LossFn, default_loss, train_step
from autoremat.wrap.checkpointed import selective_paths, wrapped_paths

__all__ = ["bench_target", "compare"]


@dataclass
class _Entry:
    """One contender while it is compared: what it made, and what was measured of it."""

    contender: Contender
    applied: Applied | None
    modules: frozenset[str] = frozenset()
    selective: frozenset[str] = frozenset()  # the modules recomputed selectively
    notes: list[str] = dataclasses.field(default_factory=list)
    error: str = ""
    peak: int | None = None
    saved: int | None = None
    autograd_saved: int | None = None
    flops: int | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    grads_match: bool = False
    grads_error: float | None = None
    identical: bool = False
    duplicates: list[str] = dataclasses.field(default_factory=list)
    # the model to run: applied.model, None once its step failed (then neither timed nor
    # counted as compiled)
    model: nn.Module | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        self.model = None if self.applied is None else self.applied.model

    @property
    def compiled(self) -> bool:
        """Its model runs through ``torch.compile`` (and its step did not fail)."""
        info = None if self.applied is None else self.applied.compile_info
        return self.model is not None and info is not None


def _prepare(
    contender: Contender, model: nn.Module, args: Args, kwargs: Kwargs, earlier: list[_Entry]
) -> _Entry | None:
    """Apply ``contender`` to a deep copy; ``None`` when it does not apply or is a duplicate."""
    try:
        with torch.random.fork_rng(devices=[]):
            applied = as_applied(contender.apply(copy.deepcopy(model), args, kwargs))
    except Exception as exc:
        if contender.name == BASELINE:
            raise
        return _Entry(contender, None, error=f"{type(exc).__name__}: {exc}")
    if applied is None:
        return None
    entry = _Entry(contender, applied)
    entry.modules = frozenset(wrapped_paths(unwrap(applied.model)))
    entry.selective = frozenset(selective_paths(unwrap(applied.model)))
    for other in earlier:
        if not entry.modules or (other.modules, other.selective) != (
            entry.modules,
            entry.selective,
        ):
            continue
        if contender.dedupe:
            other.duplicates.append(contender.name)
            return None
        entry.notes.append(f"same modules as {other.contender.name}")
    entry.notes[:0] = _first_notes(entry, applied)
    return entry


def _first_notes(entry: _Entry, applied: Applied) -> list[str]:
    """What a row's note says first: how it was compiled, then what it wraps."""
    notes = []
    info = applied.compile_info
    if info is not None:
        notes.append(f"compile {info.compile_seconds:.0f} s, {info.graphs} graphs")
    if applied.note is not None:
        notes.append(applied.note)
    elif entry.modules:
        notes.append(describe_paths(sorted(entry.modules, key=_path_order(applied.model))))
    return notes


def _path_order(model: nn.Module) -> Callable[[str], int]:
    order = {p: i for i, (p, _) in enumerate(unwrap(model).named_modules())}
    return lambda p: order.get(p, len(order))


def _measure(entry: _Entry, args: Args, kwargs: Kwargs, loss_fn: LossFn, memory: str) -> None:
    """Peak, saved bytes, FLOPs and autograd-saved bytes of one step of ``entry``'s model
    (``memory`` as in :func:`autoremat.measure`; a compiled model always by the allocator, its
    FLOPs those of the graphs inductor compiled)."""
    assert entry.model is not None and entry.applied is not None
    entry.autograd_saved = saved_by_autograd(entry.model, args, kwargs, loss_fn=loss_fn)
    info = entry.applied.compile_info
    if info is not None:
        memory = "allocator"
    m = measure(entry.model, args, kwargs, loss_fn=loss_fn, repeats=1, memory=memory)
    entry.peak, entry.saved, entry.flops = m.peak, m.saved, m.flops
    if info is not None:
        entry.flops = info.warm_flops


def _timed_step(entry: _Entry, args: Args, kwargs: Kwargs, loss_fn: LossFn) -> float:
    """Seconds of one training step of ``entry``'s model, which is left as found."""
    assert entry.model is not None
    model = entry.model
    with preserved(unwrap(model)):
        # (CUDA kernels run asynchronously: the timer waits for the GPU on both sides)
        step = lambda: train_step(model, args, kwargs, loss_fn)  # noqa: E731
        return timed(step, torch.cuda.is_initialized())[1]


def _ratio(x: float | None, base: float | None) -> float | None:
    if x is None or base is None:
        return None
    if base == 0:
        return 1.0 if x == 0 else math.inf
    return x / base


def _note(e: _Entry) -> str:
    """The row's note: the entry's notes, then duplicates and failure; a budget plan's
    predicted peak and its error against the measured one first."""
    notes = list(e.notes)
    if e.duplicates:
        notes.append(f"same plan as {', '.join(e.duplicates)}")
    if e.error:
        notes.append(f"failed: {e.error}")
    predicted = e.applied.predicted_peak if e.model is not None and e.applied else None
    if predicted is not None and e.peak:
        notes.insert(
            0,
            f"predicted peak {predicted / MiB:.1f} MiB ({(predicted - e.peak) / e.peak:+.1%})",
        )
    return "; ".join(notes)


def _rows(label: str, entries: list[_Entry]) -> list[Row]:
    """One row per entry, ratios to the first entry (the baseline)."""
    base = entries[0]
    base_seconds = statistics.median(base.times) if base.times else None
    rows = []
    for e in entries:
        seconds = statistics.median(e.times) if e.times else None
        spread = (max(e.times) - min(e.times)) / seconds if seconds else None
        rows.append(
            Row(
                model=label,
                strategy=e.contender.name,
                peak=e.peak,
                saved=e.saved,
                autograd_saved=e.autograd_saved,
                flops=e.flops,
                seconds=seconds,
                time_spread=spread,
                peak_ratio=_ratio(e.peak, base.peak),
                saved_ratio=_ratio(e.saved, base.saved),
                autograd_saved_ratio=_ratio(e.autograd_saved, base.autograd_saved),
                flops_ratio=_ratio(e.flops, base.flops),
                time_ratio=_ratio(seconds, base_seconds),
                grads_match=e.grads_match,
                grads_error=e.grads_error,
                identical=e.identical,
                note=_note(e),
                compiled=e.compiled,
                plan=plan_without_tree(e.applied.plan) if e.applied else None,
            )
        )
    return rows


def _check(
    entry: _Entry,
    args: Args,
    kwargs: Kwargs,
    loss_fn: LossFn,
    reference: StepResult | None,
    label: str,
    memory: str,
) -> StepResult | None:
    """Measure ``entry`` and check its gradients against ``reference`` (none yet: this is the
    baseline, whose result becomes the reference). Returns the reference. A failure goes to the
    entry's error and drops its model, except the baseline's, which raises ``ValueError``."""
    model = entry.model
    assert model is not None
    try:
        _measure(entry, args, kwargs, loss_fn, memory)
        result = one_step(model, args, kwargs, loss_fn)
        if reference is None:
            reference = result
        entry.grads_match, notes = check_grads(reference, result)
        entry.grads_error = worst_error(reference, result)
        entry.identical = identical(reference, result)
        entry.notes += notes
    except Exception as exc:
        if entry.contender.name == BASELINE:
            raise ValueError(f"the baseline step of {label} failed: {exc}") from exc
        entry.error = f"{type(exc).__name__}: {exc}"
        entry.model = None
    return reference


class _Stages:
    """The stages of one comparison (each contender, each timing round) as they go: a line
    ``"{label}: {stage}"`` to ``progress`` as each begins when it is given, else a
    :class:`autoremat.core.progress.Progress` bar of ``total`` stages on stderr (drawn only on a
    terminal), stepped as each ends, its note naming the stage under way."""

    def __init__(self, label: str, total: int, progress: Callable[[str], None] | None) -> None:
        self.label, self.progress = label, progress
        self.bar = None if progress is not None else Progress(label, total, "stages")
        self.started = False

    def begin(self, stage: str) -> None:
        """``stage`` begins (and the one before it, if any, has ended)."""
        if self.progress is not None:
            self.progress(f"{self.label}: {stage}")
        elif self.bar is not None and self.started:
            self.bar.step(stage)
        self.started = True

    def end(self) -> None:
        """The last stage has ended."""
        if self.bar is not None and self.started:
            self.bar.step("done")


def _time(
    entries: list[_Entry],
    args: Args,
    kwargs: Kwargs,
    loss_fn: LossFn,
    repeats: int,
    stages: _Stages,
) -> None:
    """``repeats`` rounds of one timed step of each runnable entry, the order reversed every
    other round; then notes on compiled models that recompiled while timed."""
    runnable = [e for e in entries if e.model is not None]
    for r in range(repeats):
        stages.begin(f"timing round {r + 1}/{repeats}")
        gc.collect()
        for entry in runnable if r % 2 == 0 else runnable[::-1]:
            entry.times.append(_timed_step(entry, args, kwargs, loss_fn))
    for entry in runnable:
        info = entry.applied.compile_info if entry.applied else None
        if info is not None and info.graphs != info.calls_after_warmup:
            entry.notes.append(f"recompiled while timing ({info.graphs} graphs)")


def _ordered(contenders: Iterable[Contender]) -> list[Contender]:
    """The contenders, the baseline first (:func:`no_recompute` added when none is named
    ``none``), the others in the order given."""
    ordered = list(contenders)
    if not any(s.name == BASELINE for s in ordered):
        ordered.insert(0, no_recompute())
    # The baseline runs first so that every other contender can be checked against it.
    ordered.sort(key=lambda s: s.name != BASELINE)
    return ordered


def compare(
    model: nn.Module,
    args: Args | Any = (),
    kwargs: Kwargs | None = None,
    contenders: Iterable[Contender] = (),
    *,
    loss_fn: LossFn | None = None,
    repeats: int = 5,
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
    memory: str = "tensors",
) -> list[Row]:
    """Run each contender on a fresh deep copy of ``model`` and measure one training step.

    Returns one :class:`Row` per contender that applies, in the order given, the baseline
    (:func:`no_recompute`, added first when ``contenders`` has no contender named ``none``)
    included; a contender whose ``apply`` or step raises gets one with the error in its note.
    ``model`` itself is never run or changed. ``name`` labels the rows (default: the class).
    ``progress`` receives a line per stage (each contender, each timing round); without it, a
    :class:`autoremat.core.progress.Progress` bar on stderr (on a terminal) counts the stages.

    ``repeats`` timed steps per contender (0: none, ``seconds`` is then ``None``) are
    interleaved (one step of each contender per round, the order reversed every other round),
    so that a noisy machine disturbs every contender alike. ``memory`` says how eager
    contenders' memory is measured (:func:`autoremat.measure`: ``"tensors"``, or
    ``"allocator"`` to compare them with compiled ones, which are always measured by the
    allocator). Compiled contenders leave dynamo's caches filled;
    :func:`torch._dynamo.reset` is called at the end when any contender was compiled.

    Raises:
        ValueError: ``repeats`` is negative, or the baseline itself fails.
    """
    if not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"repeats must be an int >= 0, got {repeats!r}")
    if not isinstance(args, tuple):
        args = (args,)
    kwargs = {} if kwargs is None else kwargs
    loss_fn = default_loss if loss_fn is None else loss_fn
    label = name or type(model).__name__
    ordered = _ordered(contenders)
    stages = _Stages(label, len(ordered) + repeats, progress)

    entries: list[_Entry] = []
    reference, compiled_any = None, False
    try:
        for contender in ordered:
            stages.begin(contender.name)
            entry = _prepare(contender, model, args, kwargs, entries)
            if entry is None:
                continue
            compiled_any = compiled_any or entry.compiled
            if entry.model is not None:
                reference = _check(entry, args, kwargs, loss_fn, reference, label, memory)
            entries.append(entry)
        _time(entries, args, kwargs, loss_fn, repeats, stages)
        stages.end()
    finally:
        if compiled_any:
            torch._dynamo.reset()
    return _rows(label, entries)


def bench_target(
    model: nn.Module,
    args: Args | Any = (),
    kwargs: Kwargs | None = None,
    *,
    compile: bool = False,
    budgets: Sequence[float] = (1.0, 0.5, 0.0),
    repeats: int = 3,
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
    loss_fn: LossFn | None = None,
) -> list[Row]:
    """The ``autoremat bench`` comparison: none, every block, sqrt segments (chains only),
    levels at segments 1, 4 and 16 (a plan identical to an earlier row's is dropped), budget
    plans at 75%, 50%, 25% and the lowest budget and, with ``compile=True``, ``torch.compile``
    at each of ``budgets`` (a cold compile takes up to a minute each). See :func:`compare`."""
    contenders = [no_recompute(), every_block(), sqrt_segments()]
    contenders += [levels_plan(k) for k in (1, 4, 16)]
    contenders += [budget_plan(f) for f in (0.75, 0.5, 0.25)] + [budget_plan("min")]
    if compile:
        contenders += [compiled(b) for b in budgets]
    return compare(
        model, args, kwargs, contenders, loss_fn=loss_fn, repeats=repeats, name=name,
        progress=progress,
    )

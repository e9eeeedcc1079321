"""A plan's step, run before it is taken: its peak is measured, not derived.

:class:`Rehearsal` applies a plan and runs one training step under the live-storage tracker
(:class:`~autoremat.record.memory.LiveMemory`): PyTorch's own checkpoint, the selective
policy's cache, autocast's cast cache, the RNG states checkpoint keeps (on the CPU) and every
tensor the step makes count as they will on the device, because they run.
:attr:`autoremat.Plan.estimated_peak` is this figure. The four ways the step runs
(:data:`WAYS`: ``"meta"``, ``"fake"``, ``"real"``, ``"allocator"``; :func:`way_for` chooses),
and the model's own step (``peak(None)``), are in docs/cost-model.md, "Running a plan's step".
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from autoremat.core import huggingface
from autoremat.core.host_rng import generators_kept
from autoremat.core.huggingface import mask_answers, ordinary_positions_on_meta
from autoremat.core.nested import iter_tensors
from autoremat.costs.profile import Profile
from autoremat.record.compiled import running_eagerly
from autoremat.record.memory import CpuAllocatorMemory, LiveMemory
from autoremat.record.shadow import meta_shadow
from autoremat.record.snapshot import preserved
from autoremat.record.step import Step, leaf_inputs, no_ambient_autocast, train_step
from autoremat.wrap import wrapping
from autoremat.wrap.checkpointed import wrapped_paths
from autoremat.wrap.wrapping import apply, remove

__all__ = [
    "WAYS",
    "CannotRun",
    "CpuStatistics",
    "PlanFields",
    "Rehearsal",
    "Watch",
    "quiet",
    "rehearsal_for",
    "way_for",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanFields:
    """What a rehearsal applies: a plan's ``modules`` (entries), its ``selective`` entries and
    their ops, and the ``calls`` each call entry's module was planned for (as
    :class:`autoremat.Plan` has them)."""

    modules: tuple[str, ...] = ()
    selective: Mapping[str, tuple[str, ...]] | None = None
    calls: Mapping[str, int] | None = None

    def key(self) -> tuple[Any, ...]:
        return (
            tuple(sorted(self.modules)),
            tuple(sorted((self.selective or {}).items())),
            tuple(sorted((self.calls or {}).items())),
        )


# How a rehearsal runs the step (docs/cost-model.md).
WAYS = ("meta", "fake", "real", "allocator")
# A step on the CPU is run for real when its forward's ops took less than this each, as the
# profile timed them (docs/cost-model.md, "real"; fake tensors' forward, backward and
# bookkeeping measured on the examples, 2 cores).
REAL_SECONDS_PER_OP = 4.5e-4


# What watches a traced run (:meth:`Rehearsal.traced`): given the model the step runs (a shadow,
# or the model itself) and the tracker, a context entered around the step.
Watch = Callable[[nn.Module, LiveMemory], contextlib.AbstractContextManager[Any]]


class CannotRun(ValueError):
    """A plan's step cannot be run where it is asked (a batch no step ran at, whose plans
    do not scale): the planner prices that plan by its walk instead, a guess, and
    says so (:attr:`autoremat.Plan.estimated_by`)."""


class Rehearsal:
    """Runs planned steps of ``step`` (docs/cost-model.md) the ``way`` given (one of
    :data:`WAYS`), each plan once (remembered). ``device``: where the step will train, for how
    it is counted (:meth:`LiveMemory.counting_as`; by default the step's own device; give the
    target's for a model on ``meta``)."""

    def __init__(self, step: Step, way: str, device: torch.device | str | None = None) -> None:
        if way not in WAYS:
            raise ValueError(f"way must be one of {WAYS}, got {way!r}")
        self.step, self.way = step, way
        found = [*step.model.parameters(), *(t for _, t in iter_tensors((step.args, step.kwargs)))]
        self.where = found[0].device if found else torch.device("cpu")  # (the step's device)
        self.counted_as = self.where if device is None else torch.device(device)
        self.seen: dict[tuple[Any, ...], int] = {}
        self.eager = True  # (the step the profile ran: an empty plan's peak is the profile's)
        self.why_real = ""  # why a fake step could not run, once it could not
        self._shadow: tuple[nn.Module, Any, Any, Any] | None = None

    @property
    def rng_state(self) -> int:
        """The bytes of an RNG state a checkpoint keeps, as the step is counted (on the CPU:
        its generator's state; elsewhere 0: host memory)."""
        return int(torch.get_rng_state().numel()) if self.counted_as.type == "cpu" else 0

    @property
    def how(self) -> str:
        """How the plans' steps ran, in words (:attr:`autoremat.Plan.estimated_by`)."""
        return {
            "meta": "on meta",
            "fake": "on fake tensors",
            "real": f"on {self.where.type}" + (f" ({self.why_real})" if self.why_real else ""),
            "allocator": f"on {self.where.type}, by its allocator",
        }[self.way]

    def peak(self, plan: PlanFields | None) -> int:
        """The step's peak (bytes above what was live before it) with ``plan`` applied;
        ``None``: the model's own step, as it trains without a plan."""
        key = ("own",) if plan is None else plan.key()
        if key not in self.seen:
            self.seen[key] = self._run(plan).peak
        return self.seen[key]

    def traced(self, plan: PlanFields | None, watch: Watch) -> LiveMemory:
        """``plan``'s step run as :meth:`peak` runs it, its tracker (returned) keeping its
        ``events`` (``trace``) and ``watch(model run, tracker)`` entered around the step; a
        step :meth:`peak` counts by the CPU allocator is counted by the tracker here."""
        tracked = self._run(plan, watch)
        assert isinstance(tracked, LiveMemory), "a traced run is counted by the tracker"
        return tracked

    def _run(self, plan: PlanFields | None, watch: Watch | None = None) -> Any:
        if self.way in ("real", "allocator"):
            return self._real(plan, watch)
        try:
            return self._on_shadow(plan, watch)
        except Exception as exc:
            if self.way == "meta":
                raise
            why = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
            self.way, self.why_real = "real", f"fake tensors cannot run it: {why}"
            logger.info("rehearsing plans of %s %s", type(self.step.model).__name__, self.how)
            return self._real(plan, watch)

    def _on_shadow(self, plan: PlanFields | None, watch: Watch | None) -> LiveMemory:
        shadow, args, kwargs, mode = self._shadow or self._made()
        with (
            mask_answers(list(self.step.mask_answers), replay=True),
            quiet(),
            mode or contextlib.nullcontext(),
            ordinary_positions_on_meta(),
            CpuStatistics() if self.way == "fake" else contextlib.nullcontext(),
            _applied(shadow, plan),
            LiveMemory.counting_as(self.counted_as, trace=watch is not None) as tracked,
            contextlib.nullcontext() if watch is None else watch(shadow, tracked),
        ):
            train_step(shadow, args, kwargs, self.step.loss_fn, autocast=self._autocast())
        return tracked

    def _made(self) -> tuple[nn.Module, Any, Any, Any]:
        """The shadow, its inputs and the fake mode they live in (``None`` on ``meta``)."""
        step = self.step
        if self.way == "meta":
            self._shadow = (meta_shadow(step.model), step.args, step.kwargs, None)
            return self._shadow
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            shadow = meta_shadow(step.model, device=self.where.type)
            args, kwargs = tree_map(_fake, (step.args, step.kwargs))
        self._shadow = (shadow, args, kwargs, mode)
        return self._shadow

    def _autocast(self) -> Any:
        cast = self.step.autocast
        return cast if cast is None or self.where.type == "meta" else (self.where.type, cast[1])

    def _real(self, plan: PlanFields | None, watch: Watch | None) -> Any:
        """The step of the model itself, ``plan`` applied and removed, left as found."""
        model, args, kwargs = self.step.model, self.step.args, self.step.kwargs
        tracker: Any = (
            CpuAllocatorMemory()
            if self.way == "allocator" and watch is None
            else LiveMemory.counting_as(self.counted_as, trace=watch is not None)
        )
        with (
            preserved(model, leaf_inputs(args, kwargs)),
            running_eagerly(model),
            quiet(),
            no_ambient_autocast(),
            _applied(model, plan),
            tracker as tracked,
            contextlib.nullcontext() if watch is None else watch(model, tracked),
        ):
            train_step(model, args, kwargs, self.step.loss_fn, autocast=self.step.autocast)
        return tracked


class CpuStatistics(TorchDispatchMode):
    """Fake CPU kernels made to return what the real ones do: a layer, batch or group norm of
    a bfloat16 or float16 input with float32 weights (autocast's mixed precision) keeps its
    mean and inverse deviation in float32 on the CPU, where PyTorch's fake kernels give them
    in the input's dtype; a group norm's backward gives its input's gradient in the input's
    dtype, where the fake kernel gives float32 (bytes off the real step's, measured on the
    examples and on diffusers' VAE)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        fix = _RECAST.get(func)
        if fix is None or not _mixed(args[fix[0]], args[fix[1]]):
            return out
        dtype = fix[3] or args[fix[0]].dtype
        return tuple(o.to(dtype) if k in fix[2] and o is not None else o for k, o in enumerate(out))


# op -> the indexes of its input and of its weight among its arguments, of its outputs to
# recast, and their dtype (None: the input's). A norm's outputs 1 and 2 are its statistics;
# a group norm backward's first output is the input's gradient.
_RECAST: dict[Any, tuple[int, int, tuple[int, ...], torch.dtype | None]] = {
    torch.ops.aten.native_layer_norm.default: (0, 2, (1, 2), torch.float32),
    torch.ops.aten.native_batch_norm.default: (0, 1, (1, 2), torch.float32),
    torch.ops.aten.native_group_norm.default: (0, 1, (1, 2), torch.float32),
    torch.ops.aten.native_group_norm_backward.default: (1, 4, (0,), None),
}
_HALF_FLOATS = (torch.bfloat16, torch.float16)


def _mixed(x: Any, weight: Any) -> bool:
    low_on_cpu = isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dtype in _HALF_FLOATS
    return low_on_cpu and isinstance(weight, torch.Tensor) and weight.dtype == torch.float32


def _fake(value: Any) -> Any:
    """A fake copy of an input tensor (inside the fake mode), leaves requiring grad kept so."""
    if not isinstance(value, torch.Tensor):
        return value
    fake = torch.empty_like(value)
    return fake.requires_grad_() if value.requires_grad and value.is_leaf else fake


@contextlib.contextmanager
def _applied(model: nn.Module, plan: PlanFields | None) -> Iterator[None]:
    """``plan`` applied to ``model`` for the block (nothing for ``None``, or when ``model``
    has the plan's entries wrapped already); the global and host random generators put back
    after it.

    Raises:
        ValueError: ``model`` has other entries wrapped (the message names them).
    """
    already = wrapped_paths(model)
    if plan is not None and already and set(already) != set(plan.modules):
        raise ValueError(
            f"{type(model).__name__} has other entries wrapped ({', '.join(already[:3])}) "
            f"than the plan's: remove them (autoremat.remove) or pass the plan they were "
            f"applied from"
        )
    ours = plan is not None and not already
    with generators_kept(), no_ambient_autocast():
        if ours:
            apply(model, plan.modules, selective=plan.selective or {}, calls=plan.calls)  # type: ignore[union-attr]
        try:
            yield
        finally:
            if ours:
                remove(model)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The notes a planned step gives (Hugging Face's ``use_cache`` note, the wrap's note on a
    model's own checkpointing, warnings about fake tensors) kept off the user's screen:
    :func:`autoremat.plan` says what matters."""
    levels = {q: q.level for q in (huggingface.logger, wrapping.logger)}
    for q in levels:
        q.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for q, level in levels.items():
            q.setLevel(level)


# a profile's step -> its rehearsals, by (device counted as, memory): plans made from one
# profile (a budget and its lowest, fit's candidates) share the runs already made
_rehearsals: weakref.WeakKeyDictionary[Step, dict[tuple[str, str], Rehearsal]]
_rehearsals = weakref.WeakKeyDictionary()


def rehearsal_for(
    prof: Profile, device: torch.device | str | None = None, memory: str = "tensors"
) -> Rehearsal:
    """The :class:`Rehearsal` of ``prof``'s step (one per profile, device and memory), run
    the way :func:`way_for` chooses (``memory="allocator"``: by the CPU allocator).

    Raises:
        ValueError: ``prof`` has no step (a profile scaled from others): give the plan a
            rehearsal of its own.
    """
    if prof.step is None:
        raise ValueError(
            "this profile was not made by a step (it was scaled from others), so no plan's "
            "step can be run from it: pass a rehearsal of the real steps"
        )
    known = _rehearsals.setdefault(prof.step, {})
    key = (str(device), memory)
    if key not in known:
        way = "allocator" if memory == "allocator" else way_for(prof)
        known[key] = Rehearsal(prof.step, way, device)
    return known[key]


def way_for(prof: Profile) -> str:
    """How to rehearse plans of ``prof``'s step: on ``meta`` for a model there; for real on
    CUDA (its kernels cost less than fake tensors' bookkeeping, and the profile ran it at this
    size already) and on a CPU when its forward's ops are quick
    (:data:`REAL_SECONDS_PER_OP`); on fake tensors otherwise. Both give the same bytes but
    where fake tensors cannot know a value (docs/cost-model.md)."""
    if prof.device == "meta":
        return "meta"
    root = prof[prof.tree.path]
    cheap = root.op_seconds <= REAL_SECONDS_PER_OP * root.ops
    return "real" if prof.device == "cuda" or cheap else "fake"

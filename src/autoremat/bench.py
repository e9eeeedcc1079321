"""Compare recompute strategies side by side on one model: memory, FLOPs, time, gradients.

A :class:`Strategy` turns a fresh copy of the model into the model to train (the same object
with modules wrapped, a wrapper module, or a compiled module). :func:`compare` runs every
strategy on the same inputs and returns one :class:`Row` per strategy that applies::

    rows = compare(model, args, kwargs, [no_recompute(), every_block(), levels(4)])
    print(to_markdown(rows))

Built-in strategies:

* :func:`no_recompute` (``none``): the baseline; every ratio is relative to it.
* :func:`every_block`: what users do by hand. A Hugging Face model that supports it gets its own
  ``activation_checkpointing_enable`` (non-reentrant); any other model has its "blocks" wrapped
  (:func:`find_blocks`: the largest group of same-class, non-leaf siblings in the module tree).
* :func:`sqrt_segments`: ``torch.utils.checkpoint.checkpoint_sequential`` with
  ``round(sqrt(n))`` segments (Chen et al. 2016); only for an ``nn.Sequential``.
* :func:`levels`: :func:`autoremat.plan` with ``segments=k``, applied.
* :func:`compiled`: ``torch.compile`` (inductor) with
  ``torch._functorch.config.activation_memory_budget``; the min-cut partitioner then decides
  what to recompute.

How the figures are obtained (see :class:`Row`):

* ``peak``, ``saved``, ``flops`` of eager strategies come from :func:`autoremat.measure`
  (a dispatch-level storage tracker and ``FlopCounterMode``).
* ``autograd_saved`` (:func:`saved_by_autograd`) is the bytes of the distinct storages packed by
  ``torch.autograd.graph.saved_tensors_hooks`` during the forward and the loss, plus those kept
  in the cache of selective checkpointing (which the hooks do not see), parameters, buffers and
  inputs left out. Those hooks also fire under ``torch.compile``, so this is the one figure on
  which compiled and eager strategies (selective recompute included) compare directly.
* A compiled model cannot be measured by a dispatch mode (dynamo runs the original Python code
  eagerly when a ``TorchDispatchMode`` is active, so the figures would be those of the eager
  model): its ``peak`` is ``None``, its ``saved`` is its ``autograd_saved``, and its ``flops`` are
  counted on the forward and backward graphs inductor compiled (recompute included) with the
  formulas of ``FlopCounterMode``.
* ``seconds`` is the median of ``repeats`` timed steps, interleaved across strategies (one step
  of each strategy per round, the order reversed every other round) so that a noisy machine
  disturbs every strategy alike.
* ``grads_match``: one step of each strategy from the same seed gives the loss and every
  parameter's gradient of the baseline within ``rtol=1e-5, atol=1e-6`` (parameters compared by
  name, wrapper prefixes such as ``_orig_mod.`` removed).
"""

from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import gc
import math
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from autoremat import huggingface, wrap
from autoremat.measurement import measure
from autoremat.nested import iter_tensors, run_model
from autoremat.planner import lowest_budget, plan
from autoremat.snapshot import preserved
from autoremat.step import default_loss
from autoremat.tree import Node, build_tree

__all__ = [
    "Row",
    "SqrtSegments",
    "Strategy",
    "bench_target",
    "compare",
    "compiled",
    "every_block",
    "find_blocks",
    "levels",
    "no_recompute",
    "plot",
    "saved_by_autograd",
    "sqrt_segments",
    "to_csv",
    "to_markdown",
]

_MiB = 2**20
RTOL = 1e-5
ATOL = 1e-6
BASELINE = "none"

Args = tuple[Any, ...]
Kwargs = dict[str, Any]


@dataclass
class Strategy:
    """A way to train a model with less activation memory.

    ``apply(model, args, kwargs)`` receives a fresh deep copy of the model and returns the model
    to run (the same object changed in place, or a wrapper module), or ``None`` when the
    strategy does not apply to this model (its row is then left out).

    ``dedupe``: a strategy with ``dedupe=True`` that wraps exactly the same set of modules as
    an earlier row is dropped (the kept row's note names it).
    """

    name: str
    apply: Callable[[nn.Module, Args, Kwargs], nn.Module | None]
    dedupe: bool = False


@dataclass
class Row:
    """One strategy on one model. Byte counts are ints, ratios are relative to the ``none`` row
    of the same model; ``None`` where a figure is unknown (``peak`` of a compiled model, every
    figure of a strategy that failed).

    Attributes:
        peak: bytes alive at most during the step, above what existed before it
            (:class:`autoremat.Measurement`); ``None`` for compiled models.
        saved: bytes created by the forward and still alive before backward
            (:class:`autoremat.Measurement`); for compiled models, ``autograd_saved``.
        autograd_saved: bytes of the distinct storages kept from the forward for backward:
            autograd's saved tensors plus selective checkpointing's cache
            (:func:`saved_by_autograd`); the basis on which eager and compiled strategies
            compare.
        flops: FLOPs of one step, recompute included.
        seconds: median wall time of one step.
        time_spread: (slowest - fastest) / median of the timed steps: how noisy ``seconds``
            is.
        saved_ratio: ``saved`` over the baseline's ``saved``; for compiled models over the
            baseline's ``autograd_saved`` (the same basis).
        grads_match: loss and every parameter gradient equal to the baseline's within
            ``rtol=1e-5, atol=1e-6`` after one step from the same seed.
        compiled: the strategy ran through ``torch.compile``.
    """

    model: str
    strategy: str
    peak: int | None
    saved: int | None
    autograd_saved: int | None
    flops: int | None
    seconds: float | None
    time_spread: float | None
    peak_ratio: float | None
    saved_ratio: float | None
    autograd_saved_ratio: float | None
    flops_ratio: float | None
    time_ratio: float | None
    grads_match: bool
    note: str = ""
    compiled: bool = False


# --------------------------------------------------------------------------- strategies


def no_recompute() -> Strategy:
    """The baseline: the model as it is, except that Hugging Face models run with their
    key/value cache off while training, as every autoremat plan runs them (and Hugging Face's
    own gradient checkpointing): the ratios then compare the same step with and without
    recompute, not one that also fills a cache."""

    def apply(model: nn.Module, args: Args, kwargs: Kwargs) -> nn.Module:
        huggingface.turn_cache_off_in_training(model, warn=False)
        return model

    return Strategy(BASELINE, apply)


def find_blocks(tree: Node) -> list[str]:
    """The paths of the model's "blocks": the largest group of sibling nodes of ``tree`` that
    have the same class and are not leaves.

    Siblings are the children of one node (containers such as ``nn.ModuleList`` that never
    ran are dissolved by :func:`autoremat.build_tree`, so ``h.0 .. h.11`` are siblings). Ties
    go to the shallower group, then to the group met first (depth first, registration order).
    A group needs at least two members; returns ``[]`` when there is none (a plain chain of
    leaves, a model without repeated structure). Pure: reads the tree only.
    """
    best: list[Node] = []
    best_depth = 0
    stack: list[tuple[Node, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        groups: dict[str, list[Node]] = {}
        for child in node.children:
            if not child.is_leaf:
                groups.setdefault(child.type_name, []).append(child)
        for group in groups.values():
            size = len(group)
            if size >= 2 and (size > len(best) or (size == len(best) and depth + 1 < best_depth)):
                best, best_depth = group, depth + 1
        stack.extend((child, depth + 1) for child in reversed(node.children))
    return [n.path for n in best]


def _hf_model(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _every_block(model: nn.Module, args: Args, kwargs: Kwargs) -> nn.Module | None:
    if _hf_model(model) and getattr(model, "supports_gradient_checkpointing", False):
        checkpoint_kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
        else:  # pragma: no cover - older transformers
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
        _NOTES[model] = "HF activation_checkpointing_enable"
        return model
    paths = find_blocks(build_tree(model, args, kwargs))
    if not paths:
        return None
    return wrap.apply(model, paths)


def every_block() -> Strategy:
    """Checkpoint every block: Hugging Face's own activation checkpointing (non-reentrant) for a
    ``PreTrainedModel`` that supports it, else :func:`autoremat.wrap.apply` on
    :func:`find_blocks`. Does not apply when the model has no blocks."""
    return Strategy("every block", _every_block)


class SqrtSegments(nn.Module):
    """Runs an ``nn.Sequential`` through ``checkpoint_sequential`` (non-reentrant) with
    ``round(sqrt(len(seq)))`` segments when gradients are enabled. The last segment is not
    checkpointed (``checkpoint_sequential`` runs it plainly)."""

    def __init__(self, seq: nn.Sequential) -> None:
        super().__init__()
        self.seq = seq
        self.segments = max(1, round(math.sqrt(len(seq))))

    def forward(self, x: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.seq(x)
        return checkpoint_sequential(self.seq, self.segments, x, use_reentrant=False)


def _sqrt_segments(model: nn.Module, args: Args, kwargs: Kwargs) -> nn.Module | None:
    if not isinstance(model, nn.Sequential) or kwargs or len(args) != 1 or len(model) < 2:
        return None
    wrapped = SqrtSegments(model)
    _NOTES[wrapped] = f"checkpoint_sequential, {wrapped.segments} segments of {len(model)}"
    return wrapped


def sqrt_segments() -> Strategy:
    """``checkpoint_sequential`` with ``round(sqrt(n))`` segments; only for an ``nn.Sequential``
    called with one positional argument."""
    return Strategy("sqrt segments", _sqrt_segments)


def levels(segments: int) -> Strategy:
    """:func:`autoremat.plan` with ``segments``, applied. A plan that wraps the same modules as
    an earlier row (another ``levels`` count, or ``every block``) is dropped by
    :func:`compare`."""

    def apply(model: nn.Module, args: Args, kwargs: Kwargs) -> nn.Module | None:
        try:
            chosen = plan(model, args, kwargs, segments=segments)
        except ValueError:  # no submodule ran: nothing to recompute
            return None
        return chosen.apply(model)

    return Strategy(f"levels s={segments}", apply, dedupe=True)


_PREDICTED: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
# the plan each budget strategy applied (for benchmarks that report more of it)
_PLANS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def budget(target: float | str, *, selective: bool = True, objective: str = "time") -> Strategy:
    """:func:`autoremat.plan` with ``budget=target`` (a fraction of the peak without
    recompute), ``selective`` and ``objective``, applied; ``target="min"`` plans at the lowest
    budget the planner can meet (the one its error message for an infeasible budget states).
    The row is named ``budget 50%`` (``budget min``), with `` (module)`` appended for
    ``selective=False`` (module-level recompute only) and `` (flops)`` for
    ``objective="flops"``. Its note gives the predicted peak and its error against the measured
    one, and how many entries are recomputed selectively."""

    def apply(model: nn.Module, args: Args, kwargs: Kwargs) -> nn.Module | None:
        spec: float | int | str = target
        if target == "min":
            spec = lowest_budget(model, args, kwargs, selective=selective)
        chosen = plan(model, args, kwargs, budget=spec, selective=selective, objective=objective)
        applied = chosen.apply(model)
        assert chosen.estimated_peak is not None and chosen.budget is not None
        _PREDICTED[applied] = chosen.estimated_peak
        _PLANS[applied] = chosen
        _NOTES[applied] = (
            f"budget {chosen.budget / _MiB:.1f} MiB, {len(chosen.modules)} entries "
            f"({len(chosen.selective)} selective): {_describe(chosen.modules)}"
        )
        return applied

    name = "budget min" if target == "min" else f"budget {float(target):.0%}"
    name += "" if selective else " (module)"
    return Strategy(name + ("" if objective == "time" else f" ({objective})"), apply)


@dataclass
class _CompileInfo:
    budget: float
    graphs: int = 0
    flops: int | None = 0
    compile_seconds: float = 0.0
    calls_after_warmup: int = 0
    warm_flops: int | None = None


_COMPILE_INFO: weakref.WeakKeyDictionary[nn.Module, _CompileInfo] = weakref.WeakKeyDictionary()
_NOTES: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


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


def _counting_inductor(info: _CompileInfo) -> Callable[..., Any]:
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
    budget: float,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    fallback_random: bool = True,
) -> Strategy:
    """``torch.compile(model)`` (inductor) with ``activation_memory_budget=budget`` while it
    compiles: one warm-up step (forward and backward) runs in ``apply``, so the cold compile is
    not timed (its seconds go to the row's note).

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

    def apply(model: nn.Module, args: Args, kwargs: Kwargs) -> nn.Module:
        info = _CompileInfo(budget)
        optimized = torch.compile(model, backend=_counting_inductor(info))
        start = time.perf_counter()
        with (
            torch._functorch.config.patch(
                activation_memory_budget=budget, enable_autograd_cache=False
            ),
            torch._inductor.config.patch(fallback_random=fallback_random),
            preserved(model),
        ):
            _train_step(optimized, args, kwargs, loss_fn)
        info.compile_seconds = time.perf_counter() - start
        info.calls_after_warmup = info.graphs
        info.warm_flops = info.flops
        _COMPILE_INFO[optimized] = info
        return optimized

    return Strategy(f"compile b={budget:g}", apply)


# --------------------------------------------------------------------------- measuring


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a compiled or ``SqrtSegments`` wrapper (names as the original)."""
    # Only torch.compile makes an OptimizedModule, and it imports torch._dynamo first.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    while True:
        if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, SqrtSegments):
            model = model.seq
        else:
            return model


def _param_name(name: str) -> str:
    while name.startswith("_orig_mod."):
        name = name.removeprefix("_orig_mod.")
    return name


def _train_step(
    model: nn.Module, args: Args, kwargs: Kwargs, loss_fn: Callable[[Any], torch.Tensor]
) -> torch.Tensor:
    """``.grad = None``, forward, loss, backward; returns the detached loss."""
    for p in model.parameters():
        p.grad = None
    for _, t in iter_tensors((args, kwargs)):
        if t.requires_grad and t.is_leaf:
            t.grad = None
    with torch.enable_grad():
        loss = loss_fn(run_model(model, args, kwargs))
        loss.backward()
    return loss.detach()


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage.data_ptr() or None


def saved_by_autograd(
    model: nn.Module,
    args: Args | Any = (),
    kwargs: Kwargs | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    selective_cache: bool = True,
) -> int:
    """Bytes of the distinct tensor storages autograd saves for backward during the forward
    and the loss of one training step, as packed by
    ``torch.autograd.graph.saved_tensors_hooks``.

    Storages of the model's parameters and buffers and of the input tensors are left out (a
    weight saved for a matmul's backward costs nothing extra), and each storage counts once
    however many tensors view it. The hooks also fire for the tensors a graph compiled by
    ``torch.compile`` saves, so compiled and eager models are measured alike; they do not see
    what a non-reentrant checkpoint recomputes (it stores placeholders).

    They do not see the cache of selective checkpointing either (the op outputs its policy
    keeps for backward, held by ``torch.utils.checkpoint``'s caching dispatch mode): with
    ``selective_cache`` (the default) the storages in those caches count too, each storage
    still once, so that an eager model recomputed selectively is measured on the same basis
    as a compiled one (everything kept from the forward for backward, less parameters and
    inputs). No backward runs; the model is left as found (see
    :func:`autoremat.snapshot.preserved`).
    """
    loss_fn = default_loss if loss_fn is None else loss_fn
    known = {
        _storage_key(t)
        for t in [*model.parameters(), *model.buffers()]
        + [t for _, t in iter_tensors((args, kwargs))]
    }
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key not in known:
            sizes[key] = max(sizes.get(key, 0), t.untyped_storage().nbytes())
        return t

    caches: list[Any] = []
    with preserved(model), torch.enable_grad():
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            _selective_caches(caches) if selective_cache else contextlib.nullcontext(),
        ):
            loss = loss_fn(run_model(model, args, kwargs))
        for t in _cached_tensors(caches):
            pack(t)
        del loss, caches
    return sum(sizes.values())


@contextlib.contextmanager
def _selective_caches(caches: list[Any]) -> Iterator[None]:
    """Append to ``caches`` the cache of every selective checkpoint that begins inside: the
    ``storage`` of ``torch.utils.checkpoint._CachingTorchDispatchMode`` (torch 2.4+), where the
    outputs its policy saves are kept (as ``_VersionWrapper``s) until backward. Collects nothing
    on a torch without that class."""
    from torch.utils import checkpoint

    cls = getattr(checkpoint, "_CachingTorchDispatchMode", None)
    if cls is None:  # pragma: no cover - other torch versions
        yield
        return
    original = cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        caches.append(getattr(self, "storage", None))

    cls.__init__ = init
    try:
        yield
    finally:
        cls.__init__ = original


def _cached_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in selective checkpoint caches (dicts, lists, tuples, wrappers with
    ``.val``)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _cached_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _cached_tensors(v)
    elif isinstance(getattr(obj, "val", None), torch.Tensor):
        yield obj.val


def _one_step(
    model: nn.Module, args: Args, kwargs: Kwargs, loss_fn: Callable[[Any], torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None], dict[str, torch.Tensor]]:
    """Loss, gradients and buffers after one step from seed 0; the model is left as found."""
    inner = _unwrap(model)
    with torch.random.fork_rng(devices=[]), preserved(inner):
        torch.manual_seed(0)
        loss = _train_step(model, args, kwargs, loss_fn)
        grads = {
            _param_name(n): None if p.grad is None else p.grad.detach().clone()
            for n, p in inner.named_parameters()
        }
        buffers = {_param_name(n): b.detach().clone() for n, b in inner.named_buffers()}
    return loss, grads, buffers


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=RTOL, atol=ATOL))


def _relative_error(g: torch.Tensor | None, reference: torch.Tensor | None) -> float:
    """``||g - reference|| / ||reference||`` (Frobenius); ``inf`` when only one is None."""
    if g is None or reference is None or g.shape != reference.shape:
        return math.inf
    norm = float(reference.double().norm())
    diff = float((g.double() - reference.double()).norm())
    return diff / norm if norm else (0.0 if diff == 0 else math.inf)


def _check_grads(
    reference: tuple[torch.Tensor, dict[str, Any], dict[str, torch.Tensor]],
    result: tuple[torch.Tensor, dict[str, Any], dict[str, torch.Tensor]],
) -> tuple[bool, list[str]]:
    """Whether ``result`` matches ``reference`` (loss and gradients), and notes on what
    differs (buffers included)."""
    loss0, grads0, buffers0 = reference
    loss1, grads1, buffers1 = result
    notes: list[str] = []
    ok = _close(loss1.float(), loss0.float())
    if not ok:
        notes.append(f"loss differs by {float(loss1) - float(loss0):.2g}")
    bad: list[tuple[float, str]] = []
    for name in grads0.keys() | grads1.keys():
        g0, g1 = grads0.get(name), grads1.get(name)
        if g0 is None and g1 is None:
            continue
        if g0 is None or g1 is None or not _close(g1, g0):
            bad.append((_relative_error(g1, g0), name))
    if bad:
        ok = False
        worst = max(bad)
        notes.append(
            f"{len(bad)}/{len(grads0)} grads differ (worst {worst[1]}: "
            f"|g - g_none| / |g_none| = {worst[0]:.2g})"
        )
    moved = [
        name
        for name in buffers0
        if name in buffers1
        and not (
            torch.equal(buffers1[name], buffers0[name])
            or (buffers0[name].is_floating_point() and _close(buffers1[name], buffers0[name]))
        )
    ]
    if moved:
        notes.append(f"{len(moved)} buffers differ after a step (e.g. {moved[0]})")
    return ok, notes


def _describe(paths: Sequence[str]) -> str:
    shown = [p or "(root)" for p in paths]
    if len(shown) > 3:
        shown = [shown[0], shown[1], "...", shown[-1]]
    return f"wraps {len(paths)}: {', '.join(shown)}"


@dataclass
class _Entry:
    strategy: Strategy
    model: nn.Module | None
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
    duplicates: list[str] = dataclasses.field(default_factory=list)

    @property
    def compiled(self) -> bool:
        return self.model is not None and self.model in _COMPILE_INFO


def _ratio(x: float | None, base: float | None) -> float | None:
    if x is None or base is None:
        return None
    if base == 0:
        return 1.0 if x == 0 else math.inf
    return x / base


def compare(
    model: nn.Module,
    args: Args | Any = (),
    kwargs: Kwargs | None = None,
    strategies: Iterable[Strategy] = (),
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    repeats: int = 5,
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Run each strategy on a fresh deep copy of ``model`` and measure one training step.

    Returns one :class:`Row` per strategy that applies, in the order given, the baseline
    (:func:`no_recompute`, added first when ``strategies`` has no strategy named ``none``)
    included. A strategy whose ``apply`` or step raises gets a row with no figures and the
    error in its note. ``model`` itself is never run or changed. ``name`` labels the rows
    (default: the model's class name); ``progress`` receives a line per stage.

    ``repeats`` timed steps per strategy are interleaved (see the module docstring). Compiled
    strategies leave dynamo's caches filled; :func:`torch._dynamo.reset` is called at the end
    when any strategy was compiled.

    Raises:
        ValueError: ``repeats`` is below 1, or the baseline itself fails.
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not isinstance(args, tuple):
        args = (args,)
    kwargs = {} if kwargs is None else kwargs
    loss_fn = default_loss if loss_fn is None else loss_fn
    label = name or type(model).__name__
    say = progress or (lambda line: None)
    strategies = list(strategies)
    if not any(s.name == BASELINE for s in strategies):
        strategies.insert(0, no_recompute())
    # The baseline runs first so that every other strategy can be checked against it.
    strategies.sort(key=lambda s: s.name != BASELINE)

    entries: list[_Entry] = []
    reference = None
    compiled_any = False
    try:
        for strategy in strategies:
            say(f"{label}: {strategy.name}")
            entry = _prepare(strategy, model, args, kwargs, entries)
            if entry is None:
                continue
            compiled_any = compiled_any or entry.compiled
            if entry.model is not None:
                try:
                    _measure_entry(entry, args, kwargs, loss_fn)
                    result = _one_step(entry.model, args, kwargs, loss_fn)
                    if reference is None:
                        reference = result
                    entry.grads_match, notes = _check_grads(reference, result)
                    entry.notes += notes
                except Exception as exc:
                    if strategy.name == BASELINE:
                        raise ValueError(f"the baseline step of {label} failed: {exc}") from exc
                    entry.error = f"{type(exc).__name__}: {exc}"
                    entry.model = None
            entries.append(entry)

        runnable = [e for e in entries if e.model is not None]
        for r in range(repeats):
            say(f"{label}: timing round {r + 1}/{repeats}")
            gc.collect()
            for entry in runnable if r % 2 == 0 else runnable[::-1]:
                entry.times.append(_timed_step(entry, args, kwargs, loss_fn))
        for entry in runnable:
            info = _COMPILE_INFO.get(entry.model)
            if info is not None and info.graphs != info.calls_after_warmup:
                entry.notes.append(f"recompiled while timing ({info.graphs} graphs)")
    finally:
        if compiled_any:
            torch._dynamo.reset()
    return _rows(label, entries)


def _prepare(
    strategy: Strategy, model: nn.Module, args: Args, kwargs: Kwargs, earlier: list[_Entry]
) -> _Entry | None:
    """Apply ``strategy`` to a deep copy; ``None`` when it does not apply or is a duplicate."""
    try:
        with torch.random.fork_rng(devices=[]):
            applied = strategy.apply(copy.deepcopy(model), args, kwargs)
    except Exception as exc:
        if strategy.name == BASELINE:
            raise
        return _Entry(strategy, None, error=f"{type(exc).__name__}: {exc}")
    if applied is None:
        return None
    entry = _Entry(strategy, applied)
    entry.modules = frozenset(wrap.wrapped_paths(_unwrap(applied)))
    entry.selective = frozenset(wrap.selective_paths(_unwrap(applied)))
    for other in earlier:
        if not entry.modules or (other.modules, other.selective) != (
            entry.modules,
            entry.selective,
        ):
            continue
        if strategy.dedupe:
            other.duplicates.append(strategy.name)
            return None
        entry.notes.append(f"same modules as {other.strategy.name}")
    if applied in _NOTES:
        entry.notes.insert(0, _NOTES[applied])
    elif entry.modules:
        entry.notes.insert(0, _describe(sorted(entry.modules, key=_path_order(applied))))
    info = _COMPILE_INFO.get(applied)
    if info is not None:
        entry.notes.insert(
            0,
            f"compile {info.compile_seconds:.0f} s, {info.graphs} graphs; "
            f"peak n/a, saved = autograd-saved",
        )
    return entry


def _path_order(model: nn.Module) -> Callable[[str], int]:
    order = {p: i for i, (p, _) in enumerate(_unwrap(model).named_modules())}
    return lambda p: order.get(p, len(order))


def _measure_entry(
    entry: _Entry, args: Args, kwargs: Kwargs, loss_fn: Callable[[Any], torch.Tensor]
) -> None:
    assert entry.model is not None
    entry.autograd_saved = saved_by_autograd(entry.model, args, kwargs, loss_fn=loss_fn)
    info = _COMPILE_INFO.get(entry.model)
    if info is not None:
        entry.peak = None
        entry.saved = entry.autograd_saved
        entry.flops = info.warm_flops
        return
    m = measure(entry.model, args, kwargs, loss_fn=loss_fn, repeats=1)
    entry.peak, entry.saved, entry.flops = m.peak, m.saved, m.flops


def _timed_step(
    entry: _Entry, args: Args, kwargs: Kwargs, loss_fn: Callable[[Any], torch.Tensor]
) -> float:
    assert entry.model is not None
    inner = _unwrap(entry.model)
    # CUDA kernels run asynchronously: wait for the GPU on both sides of the timed step.
    cuda = torch.cuda.is_initialized()
    with preserved(inner):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        _train_step(entry.model, args, kwargs, loss_fn)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def _rows(label: str, entries: list[_Entry]) -> list[Row]:
    base = entries[0]
    rows = []
    for e in entries:
        seconds = statistics.median(e.times) if e.times else None
        spread = (max(e.times) - min(e.times)) / seconds if seconds else None
        base_seconds = statistics.median(base.times) if base.times else None
        saved_base = base.autograd_saved if e.compiled else base.saved
        notes = list(e.notes)
        if e.duplicates:
            notes.append(f"same plan as {', '.join(e.duplicates)}")
        if e.error:
            notes.append(f"failed: {e.error}")
        predicted = _PREDICTED.get(e.model) if e.model is not None else None
        if predicted is not None and e.peak:
            notes.insert(
                0,
                f"predicted peak {predicted / _MiB:.1f} MiB ({(predicted - e.peak) / e.peak:+.1%})",
            )
        note = "; ".join(notes)
        rows.append(
            Row(
                model=label,
                strategy=e.strategy.name,
                peak=e.peak,
                saved=e.saved,
                autograd_saved=e.autograd_saved,
                flops=e.flops,
                seconds=seconds,
                time_spread=spread,
                peak_ratio=_ratio(e.peak, base.peak),
                saved_ratio=_ratio(e.saved, saved_base),
                autograd_saved_ratio=_ratio(e.autograd_saved, base.autograd_saved),
                flops_ratio=_ratio(e.flops, base.flops),
                time_ratio=_ratio(seconds, base_seconds),
                grads_match=e.grads_match,
                note=note,
                compiled=e.compiled,
            )
        )
    return rows


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
) -> list[Row]:
    """The ``autoremat bench`` comparison: none, every block, sqrt segments (chains only),
    levels at segments 1, 4 and 16 (a plan identical to an earlier row's is dropped) and,
    with ``compile=True``, ``torch.compile`` at each of ``budgets`` (a cold compile takes up to
    a minute each)."""
    strategies = [no_recompute(), every_block(), sqrt_segments()]
    strategies += [levels(k) for k in (1, 4, 16)]
    strategies += [budget(f) for f in (0.75, 0.5, 0.25)] + [budget("min")]
    if compile:
        strategies += [compiled(b) for b in budgets]
    return compare(model, args, kwargs, strategies, repeats=repeats, name=name, progress=progress)


# --------------------------------------------------------------------------- reporting


def _mib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / _MiB:.1f}"


def _ms(seconds: float | None, spread: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds * 1e3:.0f}" + ("" if spread is None else f" ±{50 * spread:.0f}%")


def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}"


MARKDOWN_COLUMNS = (
    "model",
    "strategy",
    "peak MiB",
    "peak x",
    "saved MiB",
    "saved x",
    "autograd-saved MiB",
    "autograd-saved x",
    "GFLOP",
    "FLOPs x",
    "ms/step",
    "time x",
    "grads",
    "note",
)


def to_markdown(rows: Sequence[Row]) -> str:
    """A Markdown table: one line per row; sizes in MiB, ratios to the model's ``none`` row."""
    lines = [
        "| " + " | ".join(MARKDOWN_COLUMNS) + " |",
        "|" + "|".join("---" if i < 2 or i >= 12 else "---:" for i in range(14)) + "|",
    ]
    for r in rows:
        cells = [
            r.model,
            r.strategy,
            _mib(r.peak),
            _x(r.peak_ratio),
            _mib(r.saved),
            _x(r.saved_ratio),
            _mib(r.autograd_saved),
            _x(r.autograd_saved_ratio),
            "n/a" if r.flops is None else f"{r.flops / 1e9:.2f}",
            _x(r.flops_ratio),
            _ms(r.seconds, r.time_spread),
            _x(r.time_ratio),
            "n/a" if r.flops is None else "ok" if r.grads_match else "DIFFER",
            r.note.replace("|", "\\|"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def to_csv(rows: Sequence[Row], path: str | Path) -> None:
    """Write the rows to a CSV file, one column per :class:`Row` field; ``None`` is empty."""
    names = [f.name for f in dataclasses.fields(Row)]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for row in rows:
            values = dataclasses.asdict(row)
            writer.writerow({k: "" if v is None else v for k, v in values.items()})


def from_csv(path: str | Path) -> list[Row]:
    """The rows :func:`to_csv` wrote (to redraw a plot without rerunning)."""
    fields = {f.name: f for f in dataclasses.fields(Row)}
    rows = []
    with open(path, newline="") as f:
        for record in csv.DictReader(f):
            values: dict[str, Any] = {}
            for name, text in record.items():
                kind = str(fields[name].type)
                if name in ("model", "strategy", "note"):
                    values[name] = text
                elif name in ("grads_match", "compiled"):
                    values[name] = text == "True"
                elif text == "":
                    values[name] = None
                elif "int" in kind:
                    values[name] = int(text)
                else:
                    values[name] = float(text)
            rows.append(Row(**values))
    return rows


def _family(strategy: str) -> str:
    for prefix in ("none", "every block", "sqrt", "levels", "budget", "compile"):
        if strategy.startswith(prefix):
            return prefix
    return "other"


_MARKERS = {
    "none": "*",
    "every block": "s",
    "sqrt": "D",
    "levels": "o",
    "budget": "X",
    "compile": "^",
    "other": "P",
}


def _short(strategy: str) -> str:
    if strategy == "every block":
        return "every"
    if strategy == "sqrt segments":
        return "sqrt"
    if strategy.startswith("levels s="):
        return "L" + strategy.removeprefix("levels s=")
    if strategy.startswith("compile b="):
        return "C" + strategy.removeprefix("compile b=")
    if strategy.startswith("budget "):
        return "B" + strategy.removeprefix("budget ")
    return strategy


_FAMILIES = ("none", "every block", "sqrt", "levels", "budget", "compile", "other")


def _legend_key(strategy: str) -> tuple[int, float, str]:
    """Families in a fixed order; levels by segment count, compile by decreasing budget."""
    family = _family(strategy)
    number = 0.0
    with contextlib.suppress(ValueError):
        number = float(strategy.rsplit("=", 1)[-1])
    return _FAMILIES.index(family), -number if family == "compile" else number, strategy


def _colors(names: Sequence[str]) -> dict[str, Any]:
    """A colour per strategy: black baseline, one hue per family, shades within a family."""
    import matplotlib.pyplot as plt

    fixed = {"none": "black", "every block": "tab:orange", "sqrt": "tab:brown", "other": "0.5"}
    ramps = {"levels": plt.get_cmap("viridis"), "compile": plt.get_cmap("autumn")}
    colors: dict[str, Any] = {}
    for family, ramp in ramps.items():
        members = [n for n in names if _family(n) == family]
        for i, n in enumerate(members):
            colors[n] = ramp(0.85 * i / max(1, len(members) - 1))
    for n in names:
        colors.setdefault(n, fixed.get(_family(n), "0.5"))
    return colors


def plot(rows: Sequence[Row], path: str | Path, *, title: str | None = None) -> None:
    """A PNG with one panel per model in three sections: peak ratio (y) against step time
    ratio (x), then against FLOP ratio; then autograd-saved ratio (y, the same basis for every
    strategy, compiled ones included) against FLOP ratio: the Pareto view of saved bytes vs
    FLOPs. Each point is a strategy, the baseline at (1, 1). Compiled strategies (open
    triangles) have no peak: in the first two sections their y is the autograd-saved ratio."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    models = list(dict.fromkeys(r.model for r in rows))
    names = sorted(dict.fromkeys(r.strategy for r in rows), key=_legend_key)
    colors = _colors(names)
    cols = min(4, max(1, len(models)))
    grid_rows = math.ceil(len(models) / cols)
    legend_rows = math.ceil(len(names) / 7)
    top_in, bottom_in = 0.25 + 0.25 * legend_rows, 0.55 if title else 0.1
    panel_w, panel_h = 4.2, 3.4
    sections = [
        ("time_ratio", "step time / no recompute", "peak"),
        ("flops_ratio", "FLOPs / no recompute", "peak"),
        ("flops_ratio", "FLOPs / no recompute", "saved"),
    ]
    height = panel_h * len(sections) * grid_rows + top_in + bottom_in
    fig, axes = plt.subplots(
        len(sections) * grid_rows, cols, figsize=(panel_w * cols, height), squeeze=False
    )
    for section, (xfield, xlabel, yfield) in enumerate(sections):
        for i in range(grid_rows * cols):
            ax = axes[section * grid_rows + i // cols][i % cols]
            if i >= len(models):
                ax.axis("off")
                continue
            model = models[i]
            ax.axhline(1.0, color="0.75", lw=0.8, zorder=0)
            ax.axvline(1.0, color="0.75", lw=0.8, zorder=0)
            for r in rows:
                if r.model != model:
                    continue
                x = getattr(r, xfield)
                saved_basis = r.compiled or yfield == "saved"
                y = r.autograd_saved_ratio if saved_basis else r.peak_ratio
                if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
                    continue
                family = _family(r.strategy)
                ax.scatter(
                    [x],
                    [y],
                    marker=_MARKERS[family],
                    s=110 if family == "none" else 60,
                    facecolors="none" if r.compiled else [colors[r.strategy]],
                    edgecolors=[colors[r.strategy]],
                    linewidths=1.8,
                    zorder=3,
                )
                ax.annotate(
                    _short(r.strategy),
                    (x, y),
                    xytext=(5, 3),
                    textcoords="offset points",
                    fontsize=7,
                    color="0.2",
                )
            what = "peak" if yfield == "peak" else "saved bytes"
            ax.set_title(f"{model}: {what} vs {xlabel.split(' /')[0]}", fontsize=9)
            ax.set_xlabel(xlabel, fontsize=8)
            if i % cols == 0:
                ax.set_ylabel(
                    "peak / no recompute\n(open triangles: autograd-saved)"
                    if yfield == "peak"
                    else "autograd-saved / no recompute",
                    fontsize=8,
                )
            ax.tick_params(labelsize=7)
            ax.margins(x=0.15)
            ax.set_ylim(bottom=-0.05, top=max(1.1, ax.get_ylim()[1]))
            ax.grid(True, alpha=0.3)
    handles = [
        Line2D(
            [],
            [],
            ls="",
            marker=_MARKERS[_family(n)],
            markersize=8,
            markeredgewidth=1.6,
            markerfacecolor="none" if _family(n) == "compile" else colors[n],
            markeredgecolor=colors[n],
            label=n,
        )
        for n in names
    ]
    fig.legend(
        handles=handles,
        loc="upper center",
        ncol=min(len(handles), 7),
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, 1.0),
    )
    if title:
        fig.text(0.5, 0.05 / height, textwrap.fill(title, 45 * cols), ha="center", fontsize=8)
    fig.tight_layout(rect=(0, bottom_in / height, 1, 1 - top_in / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)

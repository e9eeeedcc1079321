"""Per-module costs on the tree: what each module stores for backward and costs to recompute.

:func:`profile` runs the model's forward once with gradients enabled and attributes every cost
to the innermost module of the tree that was running when it arose:

* **saved**: bytes of the tensor storages that autograd saved for backward
  (``torch.autograd.graph.saved_tensors_hooks``). Each storage counts once, for the module that
  saved it first; storages that existed before the step (parameters, buffers, the example
  inputs) do not count: they are not activations and recompute cannot free them.
* **flops**: forward FLOPs, with the formulas of ``torch.utils.flop_counter`` (matmuls,
  convolutions, attention; pointwise ops count zero there).
* **written**: bytes of the new storages its forward's ops wrote (what a recompute writes
  again; pointwise ops cost time for these bytes though they count no FLOPs).
* **selective**: what recomputing the node selectively would free and cost, for each way of
  :data:`autoremat.selective.POLICIES`: the outputs of the ops that way keeps stay in the
  checkpoint's cache, so they are not freed (and cost memory when nothing else kept them),
  and those ops' FLOPs, bytes and time are not spent again.
* **seconds**: forward wall time, measured in separate forwards with only timing hooks; on the
  ``meta`` device, where nothing runs, estimated from FLOPs.
* **op seconds**: the time of the forward's ops themselves (each op timed alone, the fastest
  of two forwards; on CUDA with a synchronize around each op), which is what a recompute runs
  again: pointwise ops count here though they count no FLOPs. With the per-op overheads of
  :func:`overheads` (a recompute's dispatch, selective checkpointing's Python policy) it
  prices recompute in time (:func:`autoremat.plan.planning_tree`). On ``meta``, estimated from
  FLOPs and bytes written.

A node's figures are its own plus its children's, so they reconcile down the tree by
construction. A shared module's costs, whichever parent called it, are counted at its node
(its first path), like its parameters. The model must not be wrapped (profile it before
``plan.apply``, or after ``autoremat.remove``): a checkpointed module saves nothing to see.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from autoremat.memory import LiveMemory
from autoremat.selective import POLICIES, keeps, resolve
from autoremat.snapshot import preserved
from autoremat.strategies.budget import COST_PER_BYTE
from autoremat.tree import Node, build_tree, iter_tensors, run_model
from autoremat.wrap import cache_off_in_training, wrapped_paths

# Forward throughput assumed when the model is on the meta device and nothing can be timed,
# and bytes written per second (the budget strategy's machine balance).
META_FLOPS_PER_SECOND = 1e11
META_BYTES_PER_SECOND = META_FLOPS_PER_SECOND / COST_PER_BYTE


@dataclass(frozen=True)
class SelectiveCost:
    """One way to recompute a node selectively (``mode``, a key of
    :data:`autoremat.selective.POLICIES`, keeping the outputs of ``save_ops``): what it frees,
    the FLOPs, bytes and op seconds it runs again, the bytes it holds during the node's
    forward, and its recompute's peak (as :class:`NodeCost`'s fields of the same names; the
    peak also counts, at each moment of the recompute, the cached outputs nothing saves that
    the recompute has not taken back yet)."""

    mode: str
    save_ops: tuple[str, ...]
    freeable: int
    flops: int
    written: int
    held: int
    op_seconds: float
    held_from: tuple[tuple[int, int], ...] = ()
    recompute_peak: int = 0


@dataclass(frozen=True)
class NodeCost:
    """Costs of one tree node, its subtree included (``own_*``: the node alone).

    ``freeable`` is what recomputing the node would free: the bytes of storages saved for
    backward only inside its subtree, other than its inputs, less the bytes of the inputs
    nothing inside it saved (the checkpoint keeps every input until the node's backward,
    longer than they would otherwise live). It can be negative.
    ``start`` and ``end`` place the node in the step (see :class:`Profile`).
    ``recompute_peak`` is the most live bytes while a checkpoint of the node recomputes: from
    when backward first used what it saved (the live bytes of the step without recompute then,
    less ``freeable``), what its forward had added since it began, up to its last save (where
    checkpoint's early stop ends the recompute); 0 when its backward never ran.
    ``runs`` is set for a plain ``nn.Sequential``: ``(i, j, freeable, recompute_peak)`` for each
    run ``[i:j)`` of two or more consecutive children, which can be recomputed as one.
    ``written`` is the bytes of new storages its forward's ops wrote. ``selective_*`` are
    ``freeable``, ``flops`` and ``written`` for a selective recompute that keeps the outputs
    of the expensive ops (:mod:`autoremat.selective`). ``held`` and ``held_from`` say how many
    bytes more than the step without recompute are live *during* the node's forward when it is
    checkpointed, at each point ``start < p <= end`` of its span: ``held`` (its inputs nothing
    inside saves: the checkpoint holds them from the start) plus the changes ``(q, bytes)`` of
    ``held_from`` with ``q <= p``. Those are negative for what its finished parts saved, which
    a checkpointed forward does not keep (:func:`_released`), and for a selective recompute
    positive for each kept output nothing saves, from the point it was made. ``selective_ways``
    has these figures for every way of :data:`autoremat.selective.POLICIES` (the
    ``selective_*`` fields are its first). ``ops`` is the number of op calls of the node's
    forward and ``op_seconds`` their time (module docstring).
    """

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
    freeable: int = 0
    start: int = 0
    end: int = 0
    recompute_peak: int = 0
    runs: tuple[tuple[int, int, int, int], ...] = ()
    written: int = 0
    selective_freeable: int = 0
    held: int = 0
    held_from: tuple[tuple[int, int], ...] = ()
    selective_flops: int = 0
    selective_written: int = 0
    ops: int = 0
    op_seconds: float = 0.0
    selective_ways: tuple[SelectiveCost, ...] = ()


@dataclass(frozen=True)
class Profile:
    """The tree of a model with a :class:`NodeCost` for every node (``profile[path]``).

    The memory timeline of the step, for the budget planner: nodes are numbered ``0..n-1`` by
    the time their (last) forward call ended, their ``end``; a node's ``start`` is how many
    nodes had ended before its first call began. Each point ``(p, bytes)`` says that
    ``bytes`` were live at some moment when the nodes numbered below ``p`` had ended their
    forward and not yet begun their backward: recomputing any of those would have lowered
    that moment by its ``freeable`` bytes. ``forward_points`` are the moments of the forward
    pass (up to the loss), ``backward_points`` those after it, and :attr:`points` both (the
    most at each ``p``). ``peak`` is the step's peak, as
    :func:`autoremat.measure` defines it. ``op_overhead`` and ``selective_op_overhead`` are the
    seconds a recompute adds per op beyond the op itself, plain and selective
    (:func:`overheads`).
    """

    tree: Node
    costs: dict[str, NodeCost]
    device: str
    peak: int = 0
    forward_points: tuple[tuple[int, int], ...] = ()
    backward_points: tuple[tuple[int, int], ...] = ()
    op_overhead: float = 0.0
    selective_op_overhead: float = 0.0

    def __getitem__(self, path: str) -> NodeCost:
        return self.costs[path]

    @property
    def points(self) -> tuple[tuple[int, int], ...]:
        """The points of the whole step: the most live bytes at each ``p``, in either phase."""
        most: dict[int, int] = {}
        for p, b in (*self.forward_points, *self.backward_points):
            most[p] = max(most.get(p, 0), b)
        return tuple(sorted(most.items()))

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


@dataclass
class _Kept:
    """What the ops one way of selective recompute keeps cost, for one module."""

    flops: int = 0
    written: int = 0
    seconds: float = 0.0
    # the storages it keeps: id -> (storage key, bytes)
    storages: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass
class _OwnOps:
    """What the ops a module ran itself (not in a child) cost, for one module."""

    flops: int = 0
    written: int = 0
    ops: int = 0
    seconds: float = 0.0
    kept: dict[str, _Kept] = field(default_factory=lambda: {m: _Kept() for m in POLICIES})


class _OpCosts(TorchDispatchMode):
    """Adds each forward op's FLOPs (``torch.utils.flop_counter`` formulas) and the bytes of
    the new storages it wrote to the running module, and apart, for each way of selective
    recompute, those of the ops whose outputs it keeps."""

    def __init__(self, stack: list[str], own: dict[str, _OwnOps], clock: Callable[[], int]):
        super().__init__()
        self.stack = stack
        self.own = own
        self.clock = clock
        self.born: dict[int, int] = {}  # kept output id -> the clock when it was made
        self.counting = True
        self.keep = {mode: resolve(ops) for mode, ops in POLICIES.items()}
        # storage key -> id of the kept output that has it now (a key can be reused once the
        # storage is freed: ids tell the storages apart)
        self.current: dict[int, int] = {}
        self.ids = itertools.count()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.counting:
            return out
        own = self.own[self.stack[-1]]
        formula = flop_registry.get(func._overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        seen = {_storage_key(t) for _, t in iter_tensors((args, kwargs))}
        new = {}
        for _, t in iter_tensors(out):
            key = _storage_key(t)
            if key not in seen:
                new[key] = t.untyped_storage().nbytes()
                self.current.pop(key, None)
        written = sum(new.values())
        own.flops += flops
        own.written += written
        own.ops += 1
        uids: dict[int, int] = {}
        for mode, packets in self.keep.items():
            if keeps(func, args, kwargs, packets):
                kept = own.kept[mode]
                kept.flops += flops
                kept.written += written
                for key, size in new.items():
                    if key not in uids:
                        self.current[key] = uids[key] = next(self.ids)
                        self.born[uids[key]] = self.clock()
                    kept.storages[uids[key]] = (key, size)
        return out


class _OpTimes(TorchDispatchMode):
    """Adds the time of each op (the op alone; on CUDA with a synchronize before and after)
    to the running module, and apart for each way of selective recompute that keeps it."""

    def __init__(self, stack: list[str], seconds: dict[tuple[str, str], float], sync: Any):
        super().__init__()
        self.stack, self.seconds, self.sync = stack, seconds, sync
        self.keep = {mode: resolve(ops) for mode, ops in POLICIES.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        self.sync()
        begin = time.perf_counter()
        out = func(*args, **kwargs)
        self.sync()
        took = time.perf_counter() - begin
        path = self.stack[-1]
        self.seconds[path, ""] += took
        for mode, packets in self.keep.items():
            if keeps(func, args, kwargs, packets):
                self.seconds[path, mode] += took
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

    Runs one training step (forward, ``loss_fn`` on the output, backward; ``loss_fn`` defaults
    to :func:`autoremat.measure.default_loss`, and its forward costs go to the root) from
    gradients ``None``, under :class:`~autoremat.memory.LiveMemory`, then, on real tensors, one
    more forward for timing. The model is left as it was found
    (:func:`autoremat.snapshot.preserved`). Shows a progress line on a terminal.

    Raises:
        ValueError: the model has modules wrapped by autoremat (remove them first), or the
            loss is not a scalar that requires grad.
        ExampleInputsError: (a ValueError) the example inputs fail in forward; the message
            names the module.
    """
    from autoremat.measure import _leaf_inputs, _restored, _step, default_loss

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
    own_ops: dict[str, _OwnOps] = defaultdict(_OwnOps)
    savers: dict[int, tuple[int, set[str]]] = {}  # storage -> (bytes, innermost savers)
    input_keys: dict[str, dict[int, int]] = defaultdict(dict)  # node -> {storage: bytes}
    progress = _Progress(sum(n.calls for n in tree.walk()))
    memory = LiveMemory()
    # (kind, path, peak since the previous event, live bytes now)
    events: list[tuple[str, str, int, int]] = []
    grad_hooks: list[Any] = []
    costs_mode = _OpCosts(stack, own_ops, clock=lambda: len(events))
    output_keys: dict[str, set[int]] = defaultdict(set)  # node -> storages of its outputs
    kept_savers: dict[int, set[str]] = defaultdict(set)  # kept output id -> who saved it

    def mark(kind: str, path: str) -> None:
        events.append((kind, path, memory.peak, memory.current))
        memory.reset_peak()

    # node -> (events so far, peak since the last event) when its forward last saved a
    # tensor: checkpoint's early stop ends a recompute of the node there
    last_save: dict[str, tuple[int, int]] = {}

    def pack(t: torch.Tensor) -> tuple[str, torch.Tensor]:
        if costs_mode.counting:
            path: str | None = stack[-1]
            while path is not None:
                last_save[path] = (len(events), memory.peak)
                path = parent.get(path)
        key = _storage_key(t)
        if key in preexisting:
            return stack[-1], t
        if key not in savers:
            savers[key] = (t.untyped_storage().nbytes(), set())
            own_saved[stack[-1]] += t.untyped_storage().nbytes()
        savers[key][1].add(stack[-1])
        uid = costs_mode.current.get(key)
        if uid is not None:
            kept_savers[uid].add(stack[-1])
        return stack[-1], t

    parent = _lineage(tree)[0]
    # node -> (order, live bytes) when backward first used what it saved: when a checkpoint
    # of it would begin its recompute
    unpacked: dict[str, tuple[int, int]] = {}

    def unpack(packed: tuple[str, torch.Tensor]) -> torch.Tensor:
        path: str | None = packed[0]
        while path is not None and path not in unpacked:
            unpacked[path] = (len(unpacked), memory.current)
            path = parent.get(path)
        return packed[1]

    def enter(module: nn.Module, a: tuple[Any, ...], kw: dict[str, Any], path: str) -> None:
        mark("start", path)
        stack.append(path)
        input_keys[path].update(
            (_storage_key(t), t.untyped_storage().nbytes())
            for _, t in iter_tensors((a, kw))
            if _storage_key(t) not in preexisting
        )

    def leave(module: nn.Module, a: Any, kw: Any, out: Any, path: str) -> None:
        stack.pop()
        mark("end", path)
        progress.step()
        output_keys[path].update(_storage_key(t) for _, t in iter_tensors(out))
        needs_grad = [t for _, t in iter_tensors(out) if t.requires_grad]
        if needs_grad:
            grad_hooks.append(
                torch.autograd.graph.register_multi_grad_hook(
                    needs_grad, lambda _g, p=path: mark("backward", p), mode="any"
                )
            )

    def after_forward() -> None:
        costs_mode.counting = False
        mark("loss", "")

    handles = []
    for key, module in modules.items():
        path = nodes[key]
        handles.append(
            module.register_forward_pre_hook(functools.partial(enter, path=path), with_kwargs=True)
        )
        handles.append(
            module.register_forward_hook(functools.partial(leave, path=path), with_kwargs=True)
        )
    leaf_inputs = _leaf_inputs(args, kwargs)
    # The step the wrapped model will run: Hugging Face caches off in training (not on meta,
    # where the cache-less path of their mask code reads tensor values).
    cache_off = contextlib.nullcontext() if meta else cache_off_in_training(model)
    try:
        with _restored(model, leaf_inputs), cache_off, memory, costs_mode:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                _step(model, args, kwargs, loss_fn or default_loss, leaf_inputs, after_forward)
            mark("done", "")
    finally:
        for h in handles + grad_hooks:
            h.remove()

    spans, phases, event_spans, backward_now, ended_before = _timeline(
        tree, events, {path: now for path, (_, now) in unpacked.items()}
    )
    freeable, charged = _freeable(tree, savers, input_keys)
    ends = {path: end for path, (_, end) in spans.items()}
    released = _released(tree, savers, input_keys, output_keys, ends)

    def held_from(path: str, kept: dict[int, tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        """How the bytes a checkpoint of ``path`` holds beyond the step without recompute
        change during its forward (``kept``: the outputs its selective policy keeps): less
        what finished parts saved, which its forward drops; more each kept output nothing
        saves, from when it was made."""
        cached = {key for uid, (key, _) in kept.items() if kept_savers.get(uid)}
        return _steps(
            [(p, -size) for p, key, size in released[path] if key not in cached]
            + [
                (ended_before[costs_mode.born[uid]], size)
                for uid, (_, size) in kept.items()
                if not kept_savers.get(uid)
            ]
        )

    def recompute_peak(path: str, freed: int, kept: dict[int, tuple[int, int]]) -> int:
        """The live bytes at the peak of a recompute of ``path`` that frees ``freed`` and,
        if selective, takes ``kept`` from its cache (0 when its backward never ran): when it
        begins, those of the step without recompute less ``freed``; then, at each moment of
        its forward up to its last save (where checkpoint's early stop ends the recompute),
        plus what the forward had added since the node began, less the kept outputs made
        before that moment (in the cache from the start, so counted already)."""
        if path not in backward_now:
            return 0
        made = sorted((costs_mode.born[uid], size) for uid, (_, size) in kept.items())
        borns = [b for b, _ in made]
        before = [0, *itertools.accumulate(size for _, size in made)]
        first, last = event_spans[path]
        stop, high = last_save.get(path, (first + 1, events[first][3]))
        moments = [(i, events[i][2]) for i in range(first + 1, min(stop, last + 1))]
        began = events[first][3]
        most = max(
            b - began - before[bisect.bisect_left(borns, i)] for i, b in [*moments, (stop, high)]
        )
        return backward_now[path] - freed + most

    runs = _runs(tree, savers, input_keys, events, event_spans, backward_now, unpacked, last_save)
    own_seconds: dict[str, float] = defaultdict(float)
    op_seconds: dict[tuple[str, str], float] = defaultdict(float)
    op_overhead, selective_op_overhead = DEFAULT_OVERHEADS
    if not meta:
        own_seconds, op_seconds = _time_forward(model, args, kwargs, modules, nodes)
        op_overhead, selective_op_overhead = overheads(_device_of(model, inputs))

    costs: dict[str, NodeCost] = {}

    def op_time(path: str, mode: str, flops: int, written: int) -> float:
        if meta:  # estimated
            return flops / META_FLOPS_PER_SECOND + written / META_BYTES_PER_SECOND
        return op_seconds[path, mode]

    def total(node: Node) -> tuple[NodeCost, dict[str, dict[int, tuple[int, int]]]]:
        below = [total(c) for c in node.children]
        kids = [k for k, _ in below]
        own = own_ops[node.path]
        # the storages each way of selective recompute of the node keeps
        kept = {mode: dict(own.kept[mode].storages) for mode in POLICIES}
        for _, k in below:
            for mode in POLICIES:
                kept[mode].update(k[mode])
        params = {id(p): p for p in node.module.parameters()}
        flops = own.flops + sum(k.flops for k in kids)
        written = own.written + sum(k.written for k in kids)
        seconds = op_time(node.path, "", own.flops, own.written) + sum(k.op_seconds for k in kids)
        ways = []
        for m, (mode, save_ops) in enumerate(POLICIES.items()):
            mine = own.kept[mode]
            kept_flops = mine.flops + sum(k.flops - k.selective_ways[m].flops for k in kids)
            kept_written = mine.written + sum(k.written - k.selective_ways[m].written for k in kids)
            kept_seconds = op_time(node.path, mode, mine.flops, mine.written) + sum(
                k.op_seconds - k.selective_ways[m].op_seconds for k in kids
            )
            way_freeable = freeable[node.path] - _kept_cost(
                node.path, kept[mode], kept_savers, input_keys[node.path]
            )
            ways.append(
                SelectiveCost(
                    mode=mode,
                    save_ops=save_ops,
                    freeable=way_freeable,
                    flops=flops - kept_flops,
                    written=written - kept_written,
                    held=charged[node.path],
                    held_from=held_from(node.path, kept[mode]),
                    recompute_peak=recompute_peak(node.path, way_freeable, kept[mode]),
                    op_seconds=max(0.0, seconds - kept_seconds),
                )
            )
        first = ways[0]
        cost = NodeCost(
            path=node.path,
            saved=own_saved[node.path] + sum(k.saved for k in kids),
            own_saved=own_saved[node.path],
            flops=flops,
            own_flops=own.flops,
            seconds=flops / META_FLOPS_PER_SECOND if meta else own_seconds[node.path],
            input_bytes=node.input_bytes,
            output_bytes=node.output_bytes,
            param_bytes=sum(p.numel() * p.element_size() for p in params.values()),
            calls=node.calls,
            freeable=freeable[node.path],
            start=spans[node.path][0],
            end=spans[node.path][1],
            recompute_peak=recompute_peak(node.path, freeable[node.path], {}),
            runs=runs.get(node.path, ()),
            written=written,
            selective_freeable=first.freeable,
            selective_flops=first.flops,
            selective_written=first.written,
            held=charged[node.path],
            held_from=held_from(node.path, {}),
            ops=own.ops + sum(k.ops for k in kids),
            op_seconds=seconds,
            selective_ways=tuple(ways),
        )
        costs[node.path] = cost
        return cost, kept

    total(tree)
    ordered = {n.path: costs[n.path] for n in tree.walk()}
    return Profile(
        tree=tree,
        costs=ordered,
        device="meta" if meta else "real",
        peak=max(v for phase in phases for _, v in phase),
        forward_points=phases[0],
        backward_points=phases[1],
        op_overhead=op_overhead,
        selective_op_overhead=selective_op_overhead,
    )


def _timeline(
    tree: Node, events: list[tuple[str, str, int, int]], unpacked: dict[str, int]
) -> tuple[Any, ...]:
    """Spans of the nodes, the memory points of the step (see :class:`Profile`), each node's
    first and last event, the live bytes when its recompute would begin (``unpacked``: when
    backward first used what it saved, later than its backward's start by the gradients of
    the ops after its last saving one; else when its backward began), and the number of
    nodes that had ended before each event.

    Nodes are numbered by the time their last forward call ended (``end``); ``start`` is the
    number of nodes that had ended before the node's first call began. A point ``(p, bytes)``
    says that at some moment ``bytes`` were live while exactly the nodes numbered below ``p``
    had ended their forward and not begun their backward.
    """
    last_end: dict[str, int] = {}
    first_start: dict[str, int] = {}
    loss_at = next(i for i, e in enumerate(events) if e[0] == "loss")
    for i, (kind, path, _, _) in enumerate(events):
        if kind == "end":
            last_end[path] = i
        elif kind == "start":
            first_start.setdefault(path, i)
    order = sorted(last_end, key=last_end.__getitem__)
    index = {path: k for k, path in enumerate(order)}
    ended_before = [0] * (len(events) + 1)  # ended_before[i]: nodes whose last end is < i
    ends = sorted(last_end.values())
    j = 0
    for i in range(len(events) + 1):
        while j < len(ends) and ends[j] < i:
            j += 1
        ended_before[i] = j
    spans = {
        n.path: (ended_before[first_start[n.path]], index[n.path])
        for n in tree.walk()
        if n.path in last_end
    }
    peaks: tuple[dict[int, int], dict[int, int]] = ({}, {})  # in the forward, after it
    backward_now: dict[str, int] = {}
    started = [False] * len(order)
    prefix = len(order)  # nodes 0..prefix-1 have all not begun their backward
    for i, (kind, path, peak, now) in enumerate(events):
        # the peak was reached in the interval that ends with event i
        p = ended_before[i] if i <= loss_at else prefix
        phase = peaks[0 if i <= loss_at else 1]
        phase[p] = max(phase.get(p, 0), peak)
        if kind == "backward" and path in index and not started[index[path]]:
            started[index[path]] = True
            prefix = min(prefix, index[path])
            backward_now[path] = unpacked.get(path, now)
    event_spans = {path: (first_start[path], last_end[path]) for path in last_end}
    points = tuple(tuple(sorted(phase.items())) for phase in peaks)
    return spans, points, event_spans, backward_now, ended_before


def _inside(path: str, ancestor: str) -> bool:
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def _kept_cost(
    path: str,
    kept: dict[int, tuple[int, int]],
    savers: dict[int, set[str]],
    inputs: dict[int, int],
) -> int:
    """Bytes that a selective recompute of ``path`` frees less than a full one: the kept
    storages the full recompute would have freed (saved only inside it), and those nothing
    saved (the cache holds them until the node's backward, when they would have been gone)."""
    lost = 0
    for uid, (key, size) in kept.items():
        if key in inputs:
            continue
        if all(_inside(p, path) for p in savers.get(uid, ())):
            lost += size
    return lost


def _lineage(tree: Node) -> tuple[dict[str, str | None], dict[str, int]]:
    """Each node's parent (``None`` for the root) and depth."""
    parent: dict[str, str | None] = {tree.path: None}
    depth: dict[str, int] = {tree.path: 0}
    for node in tree.walk():
        for child in node.children:
            parent[child.path] = node.path
            depth[child.path] = depth[node.path] + 1
    return parent, depth


def _lowest_common(paths: set[str], parent: dict[str, str | None], depth: dict[str, int]) -> str:
    """The lowest common ancestor of ``paths`` (paths outside the tree count as its root): the
    smallest subtree that holds them all."""
    root = next(p for p, up in parent.items() if up is None)
    found = [p if p in parent else root for p in paths]
    lca = found[0]
    for other in found[1:]:
        a, b = lca, other
        while depth[a] > depth[b]:
            a = parent[a]  # type: ignore[assignment]
        while depth[b] > depth[a]:
            b = parent[b]  # type: ignore[assignment]
        while a != b:
            a, b = parent[a], parent[b]  # type: ignore[assignment]
        lca = a
    return lca


def _released(
    tree: Node,
    savers: dict[int, tuple[int, set[str]]],
    input_keys: dict[str, dict[int, int]],
    output_keys: dict[str, set[int]],
    ends: dict[str, int],
) -> dict[str, list[tuple[int, int, int]]]:
    """For each node, the storages saved for backward inside it that its forward no longer
    holds, part-way through, when the node is checkpointed: ``(point, storage, bytes)``.

    Checkpointing drops what its forward's ops save. A storage saved only inside a node ``r``
    strictly below, created in ``r`` (not its input) and not part of its output, is held by
    nothing but autograd once ``r`` has ended: from point ``end[r] + 1`` on, a checkpointed
    ancestor's forward runs with those bytes gone (unless a selective recompute keeps them).
    """
    parent, depth = _lineage(tree)
    released: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for key, (size, who) in savers.items():
        r: str | None = _lowest_common(who, parent, depth)
        while r is not None and (key in input_keys[r] or key in output_keys[r]):
            r = parent[r]
        if r is None or r not in ends:
            continue
        point = ends[r] + 1
        above = parent[r]
        while above is not None and key not in input_keys[above]:
            released[above].append((point, key, size))
            above = parent[above]
    return released


def _steps(changes: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``(point, bytes)`` changes summed per point, in point order, zeros left out."""
    total: dict[int, int] = defaultdict(int)
    for point, size in changes:
        total[point] += size
    return tuple((p, b) for p, b in sorted(total.items()) if b)


def _freeable(
    tree: Node, savers: dict[int, tuple[int, set[str]]], input_keys: dict[str, dict[int, int]]
) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes each node's recompute would free (negative: would cost), and the part of the
    cost that is its inputs (charged).

    Freed: storages saved for backward only inside the node's subtree, other than its inputs.
    Cost: its inputs that nothing inside the subtree saved. The checkpoint keeps every input
    until the node's backward; such an input would otherwise have been freed sooner.
    """
    parent, depth = _lineage(tree)
    freeable: dict[str, int] = defaultdict(int)
    charged: dict[str, int] = defaultdict(int)
    for key, (size, who) in savers.items():
        node: str | None = _lowest_common(who, parent, depth)
        while node is not None:
            if key not in input_keys[node]:
                freeable[node] += size
            node = parent[node]
    for node in tree.walk():
        for key, size in input_keys[node.path].items():
            saved_inside = key in savers and any(_inside(p, node.path) for p in savers[key][1])
            if not saved_inside:
                freeable[node.path] -= size
                charged[node.path] += size
    return freeable, charged


MAX_RUN = 64  # longest run of Sequential children considered as one recompute


def _runs(
    tree: Node,
    savers: dict[int, tuple[int, set[str]]],
    input_keys: dict[str, dict[int, int]],
    events: list[tuple[str, str, int, int]],
    event_spans: dict[str, tuple[int, int]],
    backward_now: dict[str, int],
    unpacked: dict[str, tuple[int, int]],
    last_save: dict[str, tuple[int, int]],
) -> dict[str, tuple[tuple[int, int, int, int], ...]]:
    """Costs of recomputing runs of consecutive children of each plain ``nn.Sequential``
    (whose stock forward chains its children), as :func:`_freeable` does for one node (a
    run's recompute begins when backward first uses what any of its children saved, and ends
    at the last save of any)."""
    found: dict[str, tuple[tuple[int, int, int, int], ...]] = {}
    for node in tree.walk():
        module = node.module
        kids = node.children
        if (
            type(module).forward is not nn.Sequential.forward
            or len(kids) < 2
            or [c.module for c in kids] != list(module)
            or any(c.calls != 1 or c.path not in event_spans for c in kids)
        ):
            continue
        prefix = f"{node.path}." if node.path else ""
        index = {c.path: k for k, c in enumerate(kids)}

        def child_of(
            path: str, prefix: str = prefix, index: dict[str, int] = index, own: str = node.path
        ) -> int:
            if path == own or not path.startswith(prefix):
                return -1
            return index.get(prefix + path[len(prefix) :].split(".", 1)[0], -1)

        n = len(kids)
        # freed[i][j]: bytes freed by recomputing run [i:j)
        gain = [[0] * (n + 1) for _ in range(n)]
        for key, (size, who) in savers.items():
            where = [child_of(p) for p in who]
            if min(where) < 0:
                continue
            lo, hi = min(where), max(where)
            for i in range(max(0, hi - MAX_RUN + 1), lo + 1):
                if key not in input_keys[kids[i].path]:
                    gain[i][hi + 1] += size
        runs = []
        for i in range(n):
            # charge inputs of child i that no child in [i:j) saves, for every j
            charges = [0] * (n + 1)
            for key, size in input_keys[kids[i].path].items():
                users = [child_of(p) for p in savers[key][1]] if key in savers else []
                first = min([u for u in users if u >= i], default=n)
                for j in range(i + 1, min(first + 1, n + 1)):
                    charges[j] += size
            start_event = event_spans[kids[i].path][0]
            freed = 0
            first: tuple[int, int] | None = None  # the first use of what the run saved
            stop: tuple[int, int] | None = None  # its last save
            for j in range(i + 1, min(n, i + MAX_RUN) + 1):
                freed += gain[i][j]
                use = unpacked.get(kids[j - 1].path)
                if use is not None and (first is None or use < first):
                    first = use
                stop = max(stop or (0, 0), last_save.get(kids[j - 1].path, (0, 0)))
                if j - i < 2:
                    continue
                last = kids[j - 1].path
                end_event = min(event_spans[last][1], stop[0] - 1)
                high = max([e[2] for e in events[start_event + 1 : end_event + 1]] + [stop[1]])
                added = high - events[start_event][3]
                begins = backward_now.get(last, 0) if first is None else first[1]
                frees = freed - charges[j]
                peak = begins - frees + added if last in backward_now else 0
                runs.append((i, j, frees, peak))
        found[node.path] = tuple(runs)
    return found


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
    runs: int = 2,
) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """Inclusive forward wall time per node (all calls), and the time of each node's own ops
    (``(path, "")``) and of those each way of selective recompute keeps (``(path, mode)``):
    the fastest of ``runs`` forwards, each figure on its own."""
    best_seconds: dict[str, float] = {}
    best_ops: dict[tuple[str, str], float] = {}
    device = _device_of(model, [t for _, t in iter_tensors((args, kwargs))])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(runs):
        starts: dict[str, list[float]] = defaultdict(list)
        seconds: dict[str, float] = defaultdict(float)
        ops: dict[tuple[str, str], float] = defaultdict(float)
        stack = [""]

        def enter(path: str, starts: Any = starts, stack: list[str] = stack) -> None:
            stack.append(path)
            starts[path].append(time.perf_counter())

        def leave(path: str, starts: Any = starts, seconds: Any = seconds, stack: Any = stack):
            stack.pop()
            seconds[path] += time.perf_counter() - starts[path].pop()

        handles = _hooks(modules, nodes, enter, leave)
        try:
            with preserved(model), torch.enable_grad(), _OpTimes(stack, ops, sync):
                run_model(model, args, kwargs)
        finally:
            for h in handles:
                h.remove()
        for path, t in seconds.items():
            best_seconds[path] = min(best_seconds.get(path, math.inf), t)
        for key, t in ops.items():
            best_ops[key] = min(best_ops.get(key, math.inf), t)
    return defaultdict(float, best_seconds), defaultdict(float, best_ops)


def _device_of(model: nn.Module, inputs: list[torch.Tensor]) -> torch.device:
    for t in [*inputs, *model.parameters()]:
        return t.device
    return torch.device("cpu")


# Per-op overheads assumed where nothing can be timed (meta): a recompute's dispatch, and
# selective checkpointing's Python policy and cache, per op (forward and recompute together).
DEFAULT_OVERHEADS = (5e-6, 5e-5)


@functools.cache
def overheads(device: torch.device, ops: int = 64, repeats: int = 5) -> tuple[float, float]:
    """Seconds a recompute adds per op beyond the op's own time, measured once per device on a
    chain of ``ops`` tiny ops (fastest of ``repeats``): ``(checkpoint, selective)``. The first
    is what checkpoint's recompute costs per op in dispatch and autograd; the second what a
    selective checkpoint costs per op, its forward and its recompute together (every op of a
    selectively recomputed module goes through its Python policy twice)."""
    from torch.utils.checkpoint import checkpoint

    from autoremat.selective import context_fn

    if device.type == "meta":
        return DEFAULT_OVERHEADS
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.ones(4, device=device, requires_grad=True)

    def chain(t: torch.Tensor) -> torch.Tensor:
        for _ in range(ops):
            t = torch.sin(t)
        return t

    def step(how: str) -> float:
        sync()
        begin = time.perf_counter()
        if how == "plain":
            y = chain(x)
        elif how == "full":
            y = checkpoint(chain, x, use_reentrant=False)
        else:
            y = checkpoint(chain, x, use_reentrant=False, context_fn=context_fn(("aten.mm",)))
        y.sum().backward()
        sync()
        return time.perf_counter() - begin

    times: dict[str, float] = {}
    with torch.enable_grad():
        for _ in range(repeats):
            for how in ("plain", "full", "selective"):
                times[how] = min(times.get(how, math.inf), step(how))
    x.grad = None
    full = max(0.0, times["full"] - times["plain"]) / ops
    return full, max(full, times["selective"] - times["plain"]) / ops

"""Per-module costs on the tree: what each module stores for backward and costs to recompute.

:func:`profile` records one training step (:mod:`autoremat.record.recording`), places every
node on the step's memory timeline (:mod:`autoremat.costs.timeline`), derives the cost model
(:mod:`autoremat.costs.model`) and times the ops (:mod:`autoremat.record.timing`). Each cost is
attributed to the innermost module of the tree that was running when it arose:

* **saved**: bytes of storages autograd saved for backward, each for the first module to save it.
* **flops**: forward FLOPs, as ``torch.utils.flop_counter`` counts them (pointwise ops: zero).
* **written**: bytes of new storages its forward's ops wrote (what a recompute writes again).
* **ways**: what each selective way would free and cost (a :class:`WayCost` each).
* **seconds** / **op seconds**: forward time / its ops' own (what a recompute runs again).

Storages that existed before the step (parameters, buffers, the example inputs) do not count:
recompute cannot free them. Times are taken in separate forwards (:mod:`autoremat.record.timing`;
on ``meta``, where nothing runs, estimated from FLOPs, op seconds also from bytes written). A
node's figures are its own plus its children's, one node per call (:class:`Profile`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoremat.core.classes import is_wrapped
from autoremat.core.collector import frozen
from autoremat.core.huggingface import ordinary_positions_on_meta
from autoremat.core.nested import iter_tensors, parameter_bytes
from autoremat.core.own_checkpointing import switched_off, turned_off_message
from autoremat.core.selective import WAYS
from autoremat.core.sizes import format_size
from autoremat.costs import inputs
from autoremat.costs import model as cost_model
from autoremat.costs.model import Run, Storages
from autoremat.costs.timeline import Timeline, timeline
from autoremat.record.recording import Recording, record_step
from autoremat.record.step import Autocast, LossFn, Step, no_ambient_autocast, step_autocast
from autoremat.record.timing import DEFAULT_OVERHEADS, overheads, time_forward
from autoremat.record.tree import Node, build_tree

__all__ = ["COST_PER_BYTE", "META_FLOPS_PER_SECOND", "NodeCost", "Profile", "WayCost", "profile"]

logger = logging.getLogger(__name__)

# Where nothing can be timed (the meta device): forward throughput assumed, and what a byte
# written costs in FLOPs (a machine balance: FLOP/s over bytes/s of memory traffic, a written
# byte being read about once too; about 10-30 on the CPUs here, over 100 on a GPU's tensor
# cores), hence the bytes written per second assumed.
META_FLOPS_PER_SECOND = 1e11
COST_PER_BYTE = 32.0
META_BYTES_PER_SECOND = META_FLOPS_PER_SECOND / COST_PER_BYTE


@dataclass(frozen=True)
class WayCost:
    """One way to recompute a node selectively (``way``, a key of
    :data:`autoremat.core.selective.WAYS`): what it frees, the FLOPs, bytes and op seconds it runs
    again, how what it holds during the node's forward changes, and its recompute's peak (as
    :class:`NodeCost`'s fields of the same names; the peak also counts, at each moment of the
    recompute, the cached outputs nothing saves that the recompute has not taken back yet; ``held``
    and ``cached`` are the node's). ``kept_changed``: an output this way keeps was changed in place
    after it was made (an ``LSTMCell``'s ``addmm`` then ``add_``, a ``Linear`` followed by
    ``ReLU(inplace=True)`` inside the node): selective checkpointing would refuse it in the
    recompute ("Tensor cached during selective activation checkpoint has been mutated"), so the
    planner does not offer this way."""

    way: str
    freed: int
    flops: int
    written: int
    op_seconds: float
    held_from: tuple[tuple[int, int], ...] = ()
    recompute_peak: int = 0
    kept_changed: bool = False


@dataclass(frozen=True)
class NodeCost:
    """Costs of one tree node, its subtree included (``own_*``: the node alone).

    ``start`` and ``end`` place the node in the step (:class:`Profile`). ``freed`` (negative
    when recompute costs), ``cached``, ``held``, ``held_from``, ``recompute_peak`` and ``runs``
    (a plain ``nn.Sequential``'s :class:`~autoremat.costs.model.Run` of two or more children)
    are the walk's terms: docs/cost-model.md, "The walk", and :mod:`autoremat.costs.model`
    (``recompute_peak`` is 0 when the node's backward never ran). Checkpointed, the node holds
    ``held`` plus the changes ``(q, bytes)`` of ``held_from`` with ``q <= p`` at each point
    ``start < p <= end`` of its forward. ``ways`` has these figures for every selective way.
    ``written``: bytes of new storages its forward's ops wrote; ``ops``: its forward's op
    calls, ``op_seconds`` their time.
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
    freed: int = 0
    start: int = 0
    end: int = 0
    recompute_peak: int = 0
    runs: tuple[Run, ...] = ()
    written: int = 0
    held: int = 0
    held_from: tuple[tuple[int, int], ...] = ()
    ops: int = 0
    op_seconds: float = 0.0
    ways: tuple[WayCost, ...] = ()
    cached: int = 0

    def way(self, name: str) -> WayCost:
        """The selective way called ``name``; ``KeyError`` naming the ways if none."""
        for w in self.ways:
            if w.way == name:
                return w
        raise KeyError(f"no way {name!r}: the ways are {[w.way for w in self.ways]}")


@dataclass(frozen=True)
class Profile:
    """The calls of a model's modules in one step, with a :class:`NodeCost` for each
    (``profile[path]``).

    ``tree``: one node per call of a module (``path@k`` for a module that ran several times:
    :meth:`calls_of`), its children the calls made while it ran; ``module_tree``: the module
    tree (:func:`autoremat.record.tree.build_tree`). ``forward_points`` and
    ``backward_points``: the step's points ``(p, bytes)`` in and after the forward, both in
    :attr:`points` (:mod:`autoremat.costs.timeline`). ``peak``: the step's peak, as
    :func:`autoremat.measure` defines it, on ``device`` (``"cpu"``, ``"cuda"``, or ``"meta"``:
    times estimated). ``op_overhead`` and ``selective_op_overhead``: the seconds a recompute
    adds per op (:func:`~autoremat.record.timing.overheads`). ``step``: the step it recorded,
    which plans made from it run again (:mod:`autoremat.planning.rehearsal`); ``None`` for a
    profile scaled from others.
    """

    tree: Node
    costs: dict[str, NodeCost]
    device: str
    peak: int = 0
    module_tree: Node | None = None
    forward_points: tuple[tuple[int, int], ...] = ()
    backward_points: tuple[tuple[int, int], ...] = ()
    op_overhead: float = 0.0
    selective_op_overhead: float = 0.0
    step: Step | None = field(default=None, repr=False, compare=False)

    def __getitem__(self, path: str) -> NodeCost:
        """The costs of node ``path``: a module that ran once, or one call ``path@k`` of a
        module that ran several times. ``KeyError`` naming the calls for such a module's path.
        """
        if path in self.costs:
            return self.costs[path]
        calls = self.calls_of(path)
        if calls:
            raise KeyError(
                f"module {path or '(root)'!r} ran {len(calls)} times: its nodes are its calls "
                f"{calls[0]!r} .. {calls[-1]!r}"
            )
        raise KeyError(f"no node {path!r} in the profile")

    def calls_of(self, path: str) -> list[str]:
        """The nodes of the module at ``path``: its calls in order (``[path]`` when it ran
        once; empty when it did not run)."""
        return [n.path for n in self.tree.walk() if n.module_path == path]

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
        rows = [f"{'module':48} {'calls':>5} {'saved':>11} {'GFLOP':>9} {'ms':>9} {'params':>11}"]

        def visit(node: Node, level: int) -> None:
            c = self.costs[node.path]
            label = ("  " * level + (node.path.rsplit(".", 1)[-1] if node.path else "(root)"))[:48]
            rows.append(
                f"{label:48} {c.calls:>5} {format_size(c.saved):>11} {c.flops / 1e9:>9.3f} "
                f"{c.seconds * 1e3:>9.2f} {format_size(c.param_bytes):>11}"
            )
            if level < depth:
                for child in node.children:
                    visit(child, level + 1)

        visit(self.tree, 0)
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.render()


def profile(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: LossFn | None = None,
    autocast: Autocast | torch.dtype | None = None,
    hf_cache: bool = False,
    timed: bool = True,
) -> Profile:
    """Per-node costs of ``model`` on the example inputs (see the module docstring).

    Runs one training step (forward, ``loss_fn`` on the output, backward; ``loss_fn`` defaults
    to :func:`autoremat.record.step.default_loss`, its forward costs going to the root) from
    gradients ``None``, under :class:`~autoremat.record.memory.LiveMemory`, then, on real
    tensors, two more forwards for timing (not with ``timed=False``: times are then estimated
    as on ``meta``). As every applied plan does, it runs without a Hugging Face model's
    key/value cache (with it under ``hf_cache``) and the model's own checkpointing (one warning
    says so); LayerDrop is off (every layer runs). ``autocast`` (a dtype, or ``(device_type,
    dtype)``; by default an enclosing autocast region's): forward and loss under it
    (docs/guide.md). The model is left as found (:func:`autoremat.record.snapshot.preserved`).
    Shows a progress line on a terminal.

    Raises:
        ValueError: the model has modules wrapped by autoremat (remove them first), or the
            loss is not a scalar that requires grad.
        ExampleInputsError: (a ValueError) the example inputs fail in forward; the message
            names the module.
    """
    if any(is_wrapped(m) for m in model.modules()):
        raise ValueError(
            "profile needs the unwrapped model (a checkpointed module saves nothing to "
            "measure): call autoremat.remove(model) first"
        )
    autocast = step_autocast(autocast, model)
    with frozen(), no_ambient_autocast(), switched_off(model) as own:
        if own:
            logger.warning("%s", turned_off_message(model, own, "for the profile"))
        return _profile(model, args, kwargs, loss_fn, autocast, hf_cache, timed)


def _profile(model: nn.Module, args: Any, kwargs: Any, loss_fn: LossFn | None,
             autocast: Autocast | None, hf_cache: bool, timed: bool = True) -> Profile:  # fmt: skip
    tensors = [*(t for _, t in iter_tensors((args, kwargs))), *model.parameters()]
    meta = any(t.device.type == "meta" for t in tensors)
    device = tensors[0].device if tensors else torch.device("cpu")
    with ordinary_positions_on_meta() if meta else contextlib.nullcontext():
        modules = build_tree(model, args, kwargs)  # (with the cache off too: no mask reads)
    rec = record_step(model, args, kwargs, modules, loss_fn, meta, autocast, hf_cache)
    tree = rec.tree
    line = timeline(tree, rec.events, {p: now for p, (_, now) in rec.unpacked.items()})
    times = _Times()
    if not meta and timed:
        nodes = {id(n.module): (n.module_path, n.module, n.calls) for n in tree.walk()}
        times.forward, times.ops = time_forward(
            model, args, kwargs, nodes, device, autocast=autocast
        )
        times.overheads = overheads(device)
    costs = _Assembly(rec, line, times).costs()
    return Profile(
        tree=tree,
        module_tree=modules,
        costs={n.path: costs[n] for n in tree.walk()},
        device="meta" if meta else device.type,
        peak=max(v for phase in (line.forward_points, line.backward_points) for _, v in phase),
        forward_points=line.forward_points,
        backward_points=line.backward_points,
        op_overhead=times.overheads[0],
        selective_op_overhead=times.overheads[1],
        step=Step(model, args, kwargs or {}, loss_fn, autocast, tuple(rec.mask_answers)),
    )


@dataclass
class _Times:
    """What was timed: forward seconds per node, op seconds per (node, way or ""), per-op
    overheads; on ``meta``, estimates from FLOPs and bytes written."""

    forward: dict[str, float] | None = None
    ops: dict[tuple[str, str], float] | None = None
    overheads: tuple[float, float] = DEFAULT_OVERHEADS

    def op_time(self, path: str, way: str, flops: int, written: int) -> float:
        if self.ops is None:  # estimated
            return flops / META_FLOPS_PER_SECOND + written / META_BYTES_PER_SECOND
        return self.ops.get((path, way), 0.0)

    def forward_time(self, path: str, flops: int) -> float:
        if self.forward is None:
            return flops / META_FLOPS_PER_SECOND
        return self.forward.get(path, 0.0)


class _Assembly:
    """Sums the recorded figures up the tree into one :class:`NodeCost` per node."""

    def __init__(self, rec: Recording, line: Timeline, times: _Times) -> None:
        self.rec, self.line, self.times = rec, line, times
        freers = cost_model.freers(rec)
        self.charged = inputs.charged_inputs(rec, line, freers)
        self.freed, self.cached = cost_model.freed_bytes(rec, freers, self.charged)
        self.released = cost_model.released(rec, {n: end for n, (_, end) in line.spans.items()})
        self.runs = cost_model.runs(rec, line, freers)
        self.found: dict[Node, NodeCost] = {}

    def costs(self) -> dict[Node, NodeCost]:
        self.total(self.rec.tree)
        return self.found

    def total(self, node: Node) -> dict[str, Storages]:
        """Fill :attr:`found` for ``node`` and below; return, for each way, the storages a
        selective recompute of ``node`` keeps."""
        below = [self.total(c) for c in node.children]
        kids = [self.found[c] for c in node.children]
        own = self.rec.own_ops[node]
        kept = {way: dict(own.kept[way].storages) for way in WAYS}
        for k in below:
            for way in WAYS:
                kept[way].update(k[way])
        flops = own.flops + sum(k.flops for k in kids)
        written = own.written + sum(k.written for k in kids)
        seconds = self.times.op_time(node.path, "", own.flops, own.written)
        seconds += sum(k.op_seconds for k in kids)
        ways = tuple(self._way(node, w, kept[w], (flops, written, seconds)) for w in WAYS)
        path, line = node.path, self.line
        self.found[node] = NodeCost(
            path=path,
            saved=self.rec.own_saved[node] + sum(k.saved for k in kids),
            own_saved=self.rec.own_saved[node],
            flops=flops,
            own_flops=own.flops,
            seconds=self.times.forward_time(path, flops),
            input_bytes=node.input_bytes,
            output_bytes=node.output_bytes,
            param_bytes=parameter_bytes(node.module),
            calls=node.calls,
            freed=self.freed[node],
            start=self.line.spans[node][0],
            end=self.line.spans[node][1],
            recompute_peak=cost_model.recompute_peak(self.rec, line, node, self.freed[node], {}),
            runs=self.runs.get(node, ()),
            written=written,
            held=self.charged[node],
            held_from=cost_model.held_from(self.rec, self.line, self.released[node], {}),
            ops=own.ops + sum(k.ops for k in kids),
            op_seconds=seconds,
            ways=ways,
            cached=self.cached[node],
        )
        return kept

    def _way(self, node: Node, way: str, kept: Storages, whole: tuple[int, int, float]) -> WayCost:
        """The :class:`WayCost` of way ``way`` for ``node``, given what a whole recompute runs
        (``whole``: FLOPs, bytes written, op seconds)."""
        flops, written, seconds = whole
        kids = [self.found[c] for c in node.children]
        mine = self.rec.own_ops[node].kept[way]
        kept_flops = mine.flops + sum(k.flops - k.way(way).flops for k in kids)
        kept_written = mine.written + sum(k.written - k.way(way).written for k in kids)
        kept_seconds = self.times.op_time(node.path, way, mine.flops, mine.written) + sum(
            k.op_seconds - k.way(way).op_seconds for k in kids
        )
        rec, line = self.rec, self.line
        lost, let_go = cost_model.kept_cost(rec, node, kept)
        freed = self.freed[node] - lost
        return WayCost(
            way=way,
            freed=freed,
            flops=flops - kept_flops,
            written=written - kept_written,
            held_from=cost_model.held_from(rec, line, self.released[node], kept),
            recompute_peak=cost_model.recompute_peak(rec, line, node, freed, kept, let_go),
            op_seconds=max(0.0, seconds - kept_seconds),
            kept_changed=any(key in rec.changed for key in kept),
        )

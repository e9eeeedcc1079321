"""The adapter from a profile to the solver: one planning :class:`~autoremat.planning.solver.Item`
per node of the tree, priced, with the modules that cannot be candidates marked.

This is where the budget strategy's view of a model is decided (:func:`planning_tree`): which
nodes are candidates, which ways each can be recomputed (whole, a run of a Sequential's
children, each selective way that differs), and what each costs.
"""

from __future__ import annotations

from torch import nn

from autoremat.core.entries import parse_run
from autoremat.core.selective import FULL
from autoremat.costs.profile import NodeCost, Profile
from autoremat.planning.solver import Item
from autoremat.record.tree import Node
from autoremat.wrap.wrapping import unwrappable_reason

__all__ = ["planning_tree", "recompute_seconds", "way_seconds"]


def planning_tree(
    prof: Profile,
    selective: bool = True,
    skipped: dict[str, str] | None = None,
    objective: str = "time",
    rng_state: int = 0,
) -> Item:
    """The budget strategy's view of a profile: one :class:`Item` per node (per call of a
    module: a module that ran several times has an item per call, each chosen on its own),
    children in the order they ended. Modules that cannot be wrapped or recomputed exactly
    (``Node.recompute_reason``: Python state their forward changes, an input changed in place;
    a TorchScript module, one whose forward was replaced on the instance) are not candidates,
    nor are runs of a Sequential's children that hold a child whose forward changes Python
    state or start at one whose input is changed in place. With ``selective``, each candidate
    has other ways to be recomputed: selectively, in each way of
    :data:`autoremat.core.selective.WAYS` that differs (:attr:`Item.other_ways`). With
    ``objective="time"`` each way is priced by its measured time
    (:class:`~autoremat.costs.profile.NodeCost` ``op_seconds`` and the profile's per-op overheads),
    so cheap in FLOPs is not taken for free in time; with ``"flops"``, by FLOPs
    (:attr:`Item.cost`). The modules left out that would have freed memory are written to
    ``skipped`` (by module path), with the reason. ``rng_state``: the bytes of the RNG state
    a checkpoint keeps from its forward to the end of its backward, and its recompute once
    more while it runs (on the CPU, :class:`~autoremat.record.memory.LiveMemory` counts
    them): held in each node's span, less freed, twice at its recompute."""
    skipped = {} if skipped is None else skipped
    return _Builder(prof, selective, objective, skipped, rng_state).build(prof.tree)


def recompute_seconds(prof: Profile, item: Item) -> float:
    """The seconds recomputing ``item`` (a node of :func:`planning_tree`, in its ``way``, or a
    run ``path[i:j]``) adds, as ``prof`` timed it (:attr:`Item.seconds` with
    ``objective="time"``)."""
    run = parse_run(item.path)
    if run is not None:  # the Sequential's children i..j-1, named by index or not
        parent, i, j = run
        (node,) = (n for n in prof.tree.walk() if n.path == parent)
        return sum(way_seconds(prof, prof[c.path], FULL) for c in node.children[i:j])
    return way_seconds(prof, prof[item.path], item.way)


def way_seconds(prof: Profile, cost: NodeCost, way: str) -> float:
    """What recomputing the node of ``cost`` in ``way`` costs in seconds: its recomputed ops'
    time plus its op count times the per-op overhead of that way."""
    if way == FULL:
        return cost.op_seconds + cost.ops * prof.op_overhead
    return cost.way(way).op_seconds + cost.ops * prof.selective_op_overhead


class _Builder:
    def __init__(
        self, prof: Profile, selective: bool, objective: str, skipped: dict[str, str], rng: int
    ):
        self.prof, self.selective, self.objective = prof, selective, objective
        self.skipped, self.rng = skipped, rng  # (rng: the RNG state's bytes a checkpoint keeps)

    def peak(self, recompute_peak: int, *modules: nn.Module) -> int:
        """A recompute's peak with the buffers of ``modules``, which the wrap copies around
        each recompute, and its two RNG states (none when its backward never ran)."""
        buffers = sum(b.numel() * b.element_size() for m in modules for b in m.buffers())
        return recompute_peak + buffers + 2 * self.rng if recompute_peak else 0

    def timed(self, cost: NodeCost, way: str) -> float | None:
        return way_seconds(self.prof, cost, way) if self.objective == "time" else None

    def build(self, node: Node) -> Item:
        cost = self.prof[node.path]
        reason = unwrappable_reason(node.module) or node.recompute_reason
        if cost.freed > 0 and reason:
            self.skipped.setdefault(node.module_path, reason)
        kids = sorted(node.children, key=lambda c: self.prof[c.path].end)
        return Item(
            path=node.path,
            start=cost.start,
            end=cost.end,
            freed=cost.freed - self.rng,
            flops=cost.flops,
            candidate=reason is None,
            children=tuple(self.build(c) for c in kids),
            recompute_peak=self.peak(cost.recompute_peak, node.module),
            runs=self.runs(cost, kids),
            written=cost.written,
            held=cost.held + self.rng,
            held_from=cost.held_from,
            cached=cost.cached,
            other_ways=self.other_ways(node, cost),
            seconds=self.timed(cost, FULL),
        )

    def runs(self, cost: NodeCost, kids: list[Node]) -> tuple[tuple[int, int, Item], ...]:
        """The runs of ``cost`` that can be recomputed exactly, as items: none of their
        children changes Python state, and the first one's inputs are not changed in place (the
        run's inputs; the others' are made inside the run)."""
        found = []
        for r in cost.runs:
            run = kids[r.i : r.j]
            if run[0].inplace_reason or any(c.replay_reason for c in run):
                continue
            parts = [self.prof[c.path] for c in run]
            seconds = [self.timed(c, FULL) for c in parts]
            item = Item(
                path=f"{cost.path}[{r.i}:{r.j}]",
                start=parts[0].start,
                end=parts[-1].end,
                freed=r.freed - self.rng,
                flops=sum(c.flops for c in parts),
                recompute_peak=self.peak(r.recompute_peak, *(c.module for c in run)),
                written=sum(c.written for c in parts),
                held=r.held + self.rng,
                cached=r.cached,
                seconds=None if None in seconds else sum(seconds),  # type: ignore[arg-type]
            )
            found.append((r.i, r.j, item))
        return tuple(found)

    def other_ways(self, node: Node, cost: NodeCost) -> tuple[Item, ...]:
        """The selective ways worth offering: each frees something and keeps something, keeps
        no output changed in place later (selective checkpointing would refuse it), and
        differs from those already offered."""
        found: list[Item] = []
        for way in cost.ways if self.selective else ():
            if way.freed <= 0 or way.flops >= cost.flops or way.kept_changed:
                continue  # frees nothing, keeps nothing worth keeping, or would fail
            item = Item(
                path=node.path,
                start=cost.start,
                end=cost.end,
                freed=way.freed - self.rng,
                flops=way.flops,
                recompute_peak=self.peak(way.recompute_peak, node.module),
                written=way.written,
                held=cost.held + self.rng,
                held_from=way.held_from,
                cached=cost.cached,
                way=way.way,
                seconds=self.timed(cost, way.way),
            )
            key = (item.freed, item.flops, item.held_from)
            if all((o.freed, o.flops, o.held_from) != key for o in found):
                found.append(item)  # (else the same as one offered: no batched matmuls here)
        return tuple(found)

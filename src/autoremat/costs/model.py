"""The cost model: from a recorded step, what recomputing each node frees, holds and peaks at.

Every function here is pure: it reads a :class:`~autoremat.record.recording.Recording` and its
:class:`~autoremat.costs.timeline.Timeline` and returns figures. docs/cost-model.md, "The
walk", gives the terms (per node, and for :func:`runs` of a plain ``nn.Sequential``'s
children), the reasoning and the measured error.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from torch import nn

from autoremat.costs.inputs import alive_until_after
from autoremat.costs.timeline import Timeline
from autoremat.record.recording import Recording
from autoremat.record.tree import Node

__all__ = [
    "Run",
    "Storages",
    "freed_bytes",
    "freers",
    "held_from",
    "kept_cost",
    "recompute_peak",
    "released",
    "runs",
]

MAX_RUN = 64  # longest run of Sequential children considered as one recompute

Storages = dict[int, int]  # kept output's storage key -> bytes


@dataclass(frozen=True)
class Run:
    """Recomputing children ``i..j-1`` of a plain ``nn.Sequential`` as one: what it frees,
    its recompute's peak, and what it holds during its forward beyond the step without
    recompute (as :class:`~autoremat.costs.profile.NodeCost` has ``held``: the first child's
    inputs that no child of the run saves, which the checkpoint keeps from the run's start;
    what its finished parts saved, which its forward drops, is not counted: an upper bound)."""

    i: int
    j: int
    freed: int
    recompute_peak: int
    held: int = 0
    cached: int = 0


def _lowest_common(rec: Recording, nodes: set[Node]) -> Node:
    """The lowest common ancestor of ``nodes``: the smallest subtree that holds them all."""
    lca = next(iter(nodes))
    while not all(rec.within(n, lca) for n in nodes):
        lca = rec.family[0][lca]  # type: ignore[assignment]
    return lca


def freed_bytes(
    rec: Recording, freers: dict[int, list[Node]], charged: dict[Node, int]
) -> tuple[dict[Node, int], dict[Node, int]]:
    """Bytes each node's recompute would free (negative: would cost), and the part of them
    that stays live until the forward ends anyway: the casts autocast's cast cache keeps until
    its region ends (:attr:`Recording.cached_casts`; a checkpointed forward casts its weights
    as the step without recompute does), freed when backward begins unless a node that is
    not recomputed saved it.

    Freed: storages saved for backward only inside the node's subtree, other than its inputs
    (``freers``: :func:`freers`), less ``charged``, the inputs its checkpoint keeps longer
    (:func:`autoremat.costs.inputs.charged_inputs`).
    """
    freed: dict[Node, int] = defaultdict(int, {n: -size for n, size in charged.items()})
    cached: dict[Node, int] = defaultdict(int)
    for key, nodes in freers.items():
        for node in nodes:
            freed[node] += rec.savers[key][0]
            cached[node] += rec.savers[key][0] if key in rec.cached_casts else 0
    return freed, cached


def freers(rec: Recording) -> dict[int, list[Node]]:
    """For each storage saved for backward, the nodes whose recompute frees it: those whose
    subtree holds every saver and that did not take it as an input."""
    parent = rec.family[0]
    found: dict[int, list[Node]] = defaultdict(list)
    for key, (_, who) in rec.savers.items():
        node: Node | None = _lowest_common(rec, who)
        while node is not None:
            if key not in rec.input_keys[node]:
                found[key].append(node)
            node = parent[node]
    return found


def released(rec: Recording, ends: dict[Node, int]) -> dict[Node, list[tuple[int, int, int]]]:
    """For each node, the storages saved for backward inside it that its forward no longer
    holds, part-way through, when the node is checkpointed: ``(point, storage, bytes)``.

    Checkpointing drops what its forward's ops save. A storage saved only inside a node ``r``
    strictly below, created in ``r`` (not its input) and not part of its output, is held by
    nothing but autograd once ``r`` has ended: from point ``end[r] + 1`` on, a checkpointed
    ancestor's forward runs with those bytes gone (unless a selective recompute keeps them).
    In ``r``'s own checkpointed forward, such a storage that one child made and only later
    ones took and saved is taken to be let go once the last of them has ended
    (:func:`_passed_between`: its code reassigns its hidden states; a guess, not a bound,
    which the plan's run checks: it found a diffusers UNet's bf16 lowest plan the walk had
    priced 27% over its run).
    """
    parent = rec.family[0]
    found: dict[Node, list[tuple[int, int, int]]] = defaultdict(list)
    for key, (size, who) in rec.savers.items():
        if key in rec.cached_casts:  # autocast's cache keeps it until the forward ends
            continue
        r: Node | None = _lowest_common(rec, who)
        while r is not None and (key in rec.input_keys[r] or key in rec.output_keys[r]):
            r = parent[r]
        if r is None:
            continue
        passed = _passed_between(rec, r, key, who, ends)
        if passed is not None:
            found[r].append((passed, key, size))
        above = parent[r]
        while above is not None and key not in rec.input_keys[above]:
            found[above].append((ends[r] + 1, key, size))
            above = parent[above]
    return found


def _passed_between(
    rec: Recording, r: Node, key: int, who: set[Node], ends: dict[Node, int]
) -> int | None:
    """The point from which ``r``'s checkpointed forward no longer holds storage ``key``, one
    child made and only later ones took and saved: after the last of them ended (``None``:
    not so passed, or ``r``'s own ops saved it too)."""
    kids = r.children
    if r in who or not any(key in rec.output_keys[c] for c in kids):
        return None
    last = max(ends[c] for c in kids if key in rec.input_keys[c] or key in rec.output_keys[c])
    return last + 1 if last < ends[r] else None


def kept_cost(rec: Recording, node: Node, kept: Storages) -> tuple[int, int]:
    """Bytes that a selective recompute of ``node`` frees less than a full one: the kept
    storages the full recompute would have freed (saved only inside it), and those nothing
    saved (the cache holds them until the node's backward, when they would have been gone);
    and the other kept storages it holds in its cache when the recompute begins, where the
    step without recompute had let them go (saved by later ops outside the node only, whose
    backward ran first)."""
    begins = rec.unpack_events.get(node, -1)
    lost = let_go = 0
    for key, size in kept.items():
        if key in rec.input_keys[node]:
            continue
        if all(rec.within(p, node) for p in rec.savers.get(key, (0, ()))[1]):
            lost += size
        elif rec.kept_freed.get(key, begins + 1) <= begins:
            let_go += size
    return lost, let_go


def held_from(
    rec: Recording, line: Timeline, gone: list[tuple[int, int, int]], kept: Storages
) -> tuple[tuple[int, int], ...]:
    """How the bytes a checkpoint of a node holds beyond the step without recompute change
    during its forward (``gone``: its :func:`released` storages; ``kept``: the outputs its
    selective way keeps, empty for a whole recompute): less what finished parts saved, which
    its forward drops; more each kept output nothing saves, from the point it was made (an
    upper bound: the step without recompute may hold it a while too); summed per point, in
    point order, zeros left out."""
    total: dict[int, int] = defaultdict(int)
    for point, key, size in gone:
        if key not in kept:  # (a kept one stays in the cache)
            total[point] -= size
    for key, size in kept.items():
        if key not in rec.savers:
            total[line.ended_before[rec.born[key]]] += size
    return tuple((p, b) for p, b in sorted(total.items()) if b)


def recompute_peak(
    rec: Recording, line: Timeline, node: Node, freed: int, kept: Storages, let_go: int = 0
) -> int:
    """The live bytes at the peak of a recompute of ``node`` that frees ``freed`` and, if
    selective, takes ``kept`` from its cache (0 when its backward never ran): when it begins,
    those of the step without recompute less ``freed``, more ``let_go`` (:func:`kept_cost`);
    then, at each moment of its forward up to its last save (where checkpoint's early stop
    ends the recompute), plus what the forward had added since the node began, less the kept
    outputs made before that moment's stretch (in the cache from the start, so counted
    already; those made in it count twice there: an upper bound)."""
    if node not in line.backward_now:
        return 0
    events = rec.events
    first, last = line.events[node]
    stop, high = rec.last_save.get(node, (first + 1, events[first][3]))
    births = sorted((rec.born[key], size) for key, size in kept.items())
    began = events[first][3]
    stretches = [(i, events[i][2]) for i in range(first + 1, min(stop, last + 1))]
    most, gone, b = 0, 0, 0
    for i, peak in [*stretches, (stop, high)]:
        while b < len(births) and births[b][0] < i:
            gone += births[b][1]
            b += 1
        most = max(most, peak - began - gone)
    return line.backward_now[node] - freed + let_go + most


def _chained_children(node: Node) -> bool:
    """Whether ``node`` is a plain ``nn.Sequential`` that ran once, whose children ran once
    each, in order."""
    kids = node.children
    return (
        node.calls == 1
        and type(node.module).forward is nn.Sequential.forward
        and len(kids) >= 2
        and [c.module for c in kids] == list(node.module._modules.values())
        and all(c.calls == 1 for c in kids)
    )


def runs(
    rec: Recording, line: Timeline, freers: dict[int, list[Node]]
) -> dict[Node, tuple[Run, ...]]:
    """Costs of recomputing runs of two or more consecutive children of each plain
    ``nn.Sequential`` (whose stock forward chains its children), as :func:`freed_bytes`,
    and :func:`recompute_peak` price one node: a run's recompute begins when backward first
    uses what any of its children saved, and ends at the last save of any. ``freers``:
    :func:`freers`."""
    chained = [node for node in rec.tree.walk() if _chained_children(node)]
    return {node: tuple(_runs_of(rec, line, node, freers)) for node in chained}


def _child_of(rec: Recording, node: Node, index: dict[Node, int], inner: Node) -> int:
    """The index of the child of ``node`` (in the tree of calls) whose subtree holds
    ``inner``, -1 if none."""
    parent = rec.family[0]
    here: Node | None = inner
    while here is not None and parent[here] is not node:
        here = parent[here]
    return -1 if here is None else index.get(here, -1)


def _gains(rec: Recording, node: Node) -> tuple[list[list[int]], list[list[int]]]:
    """``gain[i][j]``: bytes saved only inside children ``i..j-1`` that run ``[i:j)`` frees,
    counted at the shortest run that holds every saver; and the part of it that autocast's
    cast cache keeps until the forward ends (:func:`freed_bytes`)."""
    kids, index = node.children, {c: k for k, c in enumerate(node.children)}
    gain = [[0] * (len(kids) + 1) for _ in kids]
    cached = [[0] * (len(kids) + 1) for _ in kids]
    for key, (size, who) in rec.savers.items():
        where = [_child_of(rec, node, index, p) for p in who]
        if min(where) < 0:
            continue
        lo, hi = min(where), max(where)
        for i in range(max(0, hi - MAX_RUN + 1), lo + 1):
            if key not in rec.input_keys[kids[i]]:
                gain[i][hi + 1] += size
                if key in rec.cached_casts:
                    cached[i][hi + 1] += size
    return gain, cached


def _charges(
    rec: Recording, line: Timeline, node: Node, i: int, freers: dict[int, list[Node]]
) -> list[int]:
    """``charges[j]``: inputs of child ``i`` that no child in ``[i:j)`` saves, for every j,
    but those alive until after the run's backward anyway (:func:`alive_until_after`)."""
    kids, index = node.children, {c: k for k, c in enumerate(node.children)}
    n = len(kids)
    charges = [0] * (n + 1)
    for key, size in rec.input_keys[kids[i]].items():
        if alive_until_after(rec, line, kids[i], node, key, freers.get(key, [])):
            continue
        users = [_child_of(rec, node, index, p) for p in rec.savers.get(key, (0, ()))[1]]
        first = min([u for u in users if u >= i], default=n)
        for j in range(i + 1, min(first + 1, n + 1)):
            charges[j] += size
    return charges


def _runs_of(
    rec: Recording, line: Timeline, node: Node, freers: dict[int, list[Node]]
) -> list[Run]:
    kids, events = node.children, rec.events
    gain, cached_gain = _gains(rec, node)
    found = []
    for i in range(len(kids)):
        charges = _charges(rec, line, node, i, freers)
        start_event = line.events[kids[i]][0]
        freed = cached = 0
        first: tuple[int, int] | None = None  # the first use of what the run saved
        stop = (0, 0)  # its last save
        for j in range(i + 1, min(len(kids), i + MAX_RUN) + 1):
            last = kids[j - 1]
            freed += gain[i][j]
            cached += cached_gain[i][j]
            use = rec.unpacked.get(last)
            first = min((u for u in (first, use) if u is not None), default=None)
            stop = max(stop, rec.last_save.get(last, (0, 0)))
            if j - i < 2:
                continue
            end_event = min(line.events[last][1], stop[0] - 1)
            high = max([e[2] for e in events[start_event + 1 : end_event + 1]] + [stop[1]])
            added = high - events[start_event][3]
            begins = line.backward_now.get(last, 0) if first is None else first[1]
            frees = freed - charges[j]
            peak = begins - frees + added if last in line.backward_now else 0
            found.append(Run(i, j, frees, peak, charges[j], cached))
    return found

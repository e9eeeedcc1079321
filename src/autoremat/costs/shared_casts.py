"""Weight casts several nodes saved: a shared module's weights, which autocast casts once per
forward (its cast cache) in the first call and every later call saves too. Such a copy is no
node's alone, so no recompute frees it by itself (:func:`autoremat.costs.model.freers`); these
say when it goes for a plan. With every saver recomputed it dies when the forward ends
(:func:`shared_casts`); with the first one recomputed, once the later savers that are not have
used it, and the first one's recompute makes it again (:func:`late_casts`). Pure functions
over a recording and its timeline, as :mod:`autoremat.costs.model`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from autoremat.costs.model import Groups, lowest_common
from autoremat.costs.timeline import Timeline, backward_stretches, risen
from autoremat.record.recording import Recording
from autoremat.record.tree import Node

__all__ = ["LateGroup", "LateGroups", "late_casts", "shared_casts"]

# (bytes, (start, end) of the later savers by end, per later saver the (point, bytes) the
# step's most live bytes there fall by once its grad_fns have used the copy, whether the
# node's recompute makes the copy again): :func:`late_casts`
LateGroup = tuple[int, tuple[tuple[int, int], ...], tuple[tuple[tuple[int, int], ...], ...], bool]
LateGroups = tuple[LateGroup, ...]


def _shared_cached_casts(
    rec: Recording, line: Timeline
) -> Iterator[tuple[int, int, list[Node], Node | None]]:
    """The casts autocast's cache keeps that two nodes or more saved: their storage keys and
    bytes, those savers (by end) and the savers' lowest common ancestor; in key order."""
    parent, depth = rec.family
    for key in sorted(rec.cached_casts & rec.savers.keys()):
        size, who = rec.savers[key]
        savers = sorted((w for w in who if w in line.spans), key=lambda w: line.spans[w][1])
        if len(savers) >= 2:
            yield key, size, savers, lowest_common(set(savers), parent, depth)


def shared_casts(rec: Recording, line: Timeline) -> dict[Node, Groups]:
    """For each node, the casts autocast's cache keeps that it and nodes before it saved (a
    shared module's weights, cast by its first call and saved by every call), grouped as
    ``(bytes, ends of the other savers)``. Counted in what no node frees but their common
    ancestor (:func:`freed_bytes`), such a cast dies when the forward ends if every saver is
    recomputed: the node whose subtree holds the last saver (and not all) frees it then,
    from its end, once the others (all ended before it began) are recomputed too."""
    parent = rec.family[0]
    found: dict[Node, dict[tuple[int, ...], int]] = defaultdict(lambda: defaultdict(int))
    for _, size, savers, top in _shared_cached_casts(rec, line):
        node: Node | None = savers[-1]
        while node is not None and node is not top:
            others = tuple(sorted(line.spans[w][1] for w in savers if not rec.within(w, node)))
            found[node][others] += size
            node = parent[node]
    return {n: tuple((b, e) for e, b in groups.items()) for n, groups in found.items()}


def late_casts(rec: Recording, line: Timeline) -> dict[Node, LateGroups]:
    """For each node, the casts autocast's cache keeps that it saved and nodes after it saved
    too (a shared module's first call casts its weights, every later call saves the same
    copy), grouped by those later savers as :data:`LateGroup`.

    In the step without recompute such a copy lives until the node's backward. With the node
    recomputed it dies once every later saver that is not recomputed has run the grad_fns that
    used it (a recomputed one uses its recompute's own copy): at the points after the node's
    end and before the first such saver's start, and inside a later saver's span in the
    stretches after those grad_fns ran (``credits``; :meth:`Item.late_freed`). Its recompute
    makes the copy again when the node made it (``remade``), while the step's figure there
    still counts the first one."""
    parent = rec.family[0]
    groups: dict[Node, dict[tuple[tuple[Node, ...], bool], list[int]]] = defaultdict(
        lambda: defaultdict(list)
    )
    makers = _cast_makers(rec)
    for key, _, savers, top in _shared_cached_casts(rec, line):
        node: Node | None = savers[0]
        while node is not None and node is not top:
            later = tuple(w for w in savers if not rec.within(w, node))
            if later and min(line.spans[w][0] for w in later) > line.spans[node][1]:
                remade = key in makers and rec.within(makers[key], node)
                groups[node][later, remade].append(key)
            node = parent[node]
    stretches = backward_stretches(rec.events, line)
    return {
        n: tuple(_late_group(rec, line, stretches, later, keys, remade)
                 for (later, remade), keys in found.items())
        for n, found in groups.items()
    }  # fmt: skip


def _cast_makers(rec: Recording) -> dict[int, Node]:
    """The node whose op made each cast another node read (:attr:`Recording.cast_reads`)."""
    return {key: maker for reads in rec.cast_reads.values() for key, (_, maker) in reads.items()}


def _late_group(
    rec: Recording,
    line: Timeline,
    stretches: dict[int, list[tuple[int, int]]],
    later: tuple[Node, ...],
    keys: list[int],
    remade: bool,
) -> LateGroup:
    """One :data:`LateGroup`: the casts ``keys`` that the nodes ``later`` saved too."""
    size = sum(rec.savers[k][0] for k in keys)
    credits = []
    for saver in later:
        used = [rec.cast_unpacks.get((saver, k)) for k in keys]
        last = None if None in used else max(used)  # type: ignore[type-var]
        credits.append(_credits(stretches, line.spans[saver], last, size))
    return size, tuple(line.spans[w] for w in later), tuple(credits), remade


def _credits(
    stretches: dict[int, list[tuple[int, int]]], span: tuple[int, int], last: int | None, size: int
) -> tuple[tuple[int, int], ...]:
    """At each point of ``span`` after the forward, how much lower its most live bytes are
    with ``size`` bytes gone from the stretches after event ``last`` (``None``: unknown)."""
    if last is None:
        return ()
    return tuple((p, -b) for p, b in risen(stretches, span, lambda j: -size if j > last else 0))

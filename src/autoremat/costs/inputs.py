"""What a checkpoint's inputs cost: the checkpoint keeps every input until the node's
backward, which costs only the inputs that would otherwise have died sooner.

Not charged: an input saved inside the node (freed with it, or kept anyway), one that a node
ended earlier saved (alive until that node's backward, after this one's: a BERT layer's output
block takes the attention output the intermediate block's Linear saved), and one the model
returns (the step holds it: T5's encoder output). An input that earlier nodes took too is
charged once when one of them is recomputed (:func:`shared_inputs`: Falcon's attention and
MLP both take one LayerNorm's output). An input the step holds anyway for a while is charged
only when it would be gone (:func:`alive_inputs`): one a node after it saves (a LoRA layer's
input, which its frozen base layer does not save and its ``lora_A`` does), one nothing saves
until the code lets it go. An input saved inside the node is charged in the node's backward,
once the grad_fns that saved it have run (:func:`kept_inputs`: an LSTM cell's previous cell
state). Pure functions over a recording and its timeline, as
:mod:`autoremat.costs.model`.
"""

from __future__ import annotations

import functools
from collections import defaultdict

from autoremat.costs.timeline import Timeline, backward_stretches, risen
from autoremat.record.recording import Recording
from autoremat.record.tree import Node

__all__ = [
    "NEVER",
    "Released",
    "Spans",
    "alive_inputs",
    "alive_until_after",
    "charged_inputs",
    "consumers",
    "kept_at",
    "kept_inputs",
    "released_inputs",
    "same_storage",
    "shared_inputs",
]

Spans = tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # (bytes, (start, end) of nodes)


def consumers(rec: Recording) -> dict[int, list[Node]]:
    """For each storage, the nodes it is an input of."""
    found: dict[int, list[Node]] = defaultdict(list)
    for n in rec.tree.walk():
        for key in rec.input_keys[n]:
            found[key].append(n)
    return found


def charged_inputs(
    rec: Recording, line: Timeline, freers: dict[int, list[Node]]
) -> dict[Node, dict[int, int]]:
    """For each node, the inputs (storage -> bytes) its checkpoint keeps longer than they
    would otherwise live: those nothing inside it saved, but those alive until after its
    backward anyway (:func:`alive_until_after`; ``freers``:
    :func:`autoremat.costs.model.freers`)."""
    found: dict[Node, dict[int, int]] = defaultdict(dict)
    for n in rec.tree.walk():
        for key, size in rec.input_keys[n].items():
            saved_inside = key in rec.savers and any(rec.within(p, n) for p in rec.savers[key][1])
            if not saved_inside and not alive_until_after(rec, line, n, n, key, freers[key]):
                found[n][key] = size
    return found


def shared_inputs(
    rec: Recording, line: Timeline, charged: dict[Node, dict[int, int]]
) -> dict[Node, Spans]:
    """For each node, its ``charged`` inputs that nodes ended before it began took as inputs
    too, grouped as ``(bytes, spans of those nodes)``: when one of them is recomputed, its
    checkpoint keeps the input until its own backward, after this node's, so this node's
    charge is not paid again (Falcon's attention and MLP both take one LayerNorm's output)."""
    takers = consumers(rec)
    found: dict[Node, Spans] = {}
    for n, keys in charged.items():
        if n not in line.spans:
            continue
        groups: dict[tuple[tuple[int, int], ...], int] = defaultdict(int)
        for key, size in keys.items():
            holders = _earlier_takers(rec, line, takers[key], n, key)
            if holders:
                groups[holders] += size
        if groups:
            found[n] = tuple((b, h) for h, b in groups.items())
    return found


def _earlier_takers(
    rec: Recording, line: Timeline, takers: list[Node], n: Node, key: int
) -> tuple[tuple[int, int], ...]:
    """The spans of the ``takers`` of input ``key`` of ``n`` that ended before ``n`` began,
    taking that very storage (a freed storage's key is reused), in order."""
    begin, here = line.spans[n][0], line.events[n][0]
    return tuple(
        sorted(
            line.spans[c]
            for c in takers
            if c in line.spans
            and line.spans[c][1] < begin
            and same_storage(rec, key, line.events[c][0], here)
        )
    )


def alive_inputs(
    rec: Recording, line: Timeline, charged: dict[Node, dict[int, int]]
) -> dict[Node, tuple[tuple[int, int, int, tuple[tuple[int, int], ...]], ...]]:
    """For each node, its ``charged`` inputs the step without recompute holds anyway for a
    while, grouped as ``(bytes, forward until, backward above, spans of earlier takers)``: at
    the points of the forward before ``forward until`` and at those after it above ``backward
    above``, the checkpoint's keeping them costs nothing, unless an earlier taker is chosen
    (its checkpoint holds them longer: :func:`shared_inputs` credits them then). One a node
    ending after it saved (the same storage: a LoRA layer's input, which its ``lora_A``
    saves) lives through the forward, and after it while that node's backward has not begun
    (above its end); one nothing saves lives until the code lets it go
    (:meth:`Recording.costs_from`), and not after the forward (:data:`NEVER`
    above)."""
    takers = consumers(rec)
    found: dict[Node, tuple[tuple[int, int, int, tuple[tuple[int, int], ...]], ...]] = {}
    for n, keys in charged.items():
        if n not in line.spans:
            continue
        groups: dict[tuple[int, int, tuple[tuple[int, int], ...]], int] = defaultdict(int)
        for key, size in keys.items():
            alive = _alive(rec, line, n, key)
            if alive is not None:
                groups[(*alive, _earlier_takers(rec, line, takers[key], n, key))] += size
        if groups:
            found[n] = tuple((b, u, a, h) for (u, a, h), b in sorted(groups.items()))
    return found


NEVER = 2**62  # a point no step reaches


def _alive(rec: Recording, line: Timeline, n: Node, key: int) -> tuple[int, int] | None:
    """``(forward until, backward above)`` for input ``key`` of ``n`` (:func:`alive_inputs`);
    ``None`` when nothing is known to hold it."""
    end, here = line.spans[n][1], line.events[n][0]
    savers = [  # (those that saved this very storage: a freed storage's key is reused)
        s
        for s in rec.savers.get(key, (0, set()))[1]
        if s in line.spans and same_storage(rec, key, *sorted((here, line.events[s][1])))
    ]
    ends = [line.spans[s][1] for s in savers if line.spans[s][1] > end]
    if ends:
        return NEVER, min(ends)
    if savers:
        return None
    born = max((c for c in rec.made_at.get(key, []) if c <= here), default=None)
    if born is None:
        return None
    costs = rec.costs_from(key, born)
    if costs is None:
        return NEVER, NEVER  # (it outlives the forward: who holds it after is not known)
    return (line.ended_before[costs], NEVER) if costs < len(line.ended_before) else None


def alive_until_after(
    rec: Recording, line: Timeline, first: Node, holder: Node, key: int, freers: list[Node]
) -> bool:
    """Whether storage ``key``, an input of ``first`` (a node, or a run's first child, the
    run inside ``holder``), stays alive until after the checkpoint's backward whatever else
    is recomputed, so a checkpoint keeping it costs nothing: the model returns it (T5's
    decoder takes the encoder's output, which the model returns too); or a node that ended
    before ``first`` began saved it (its backward runs later), and every node whose
    recompute would free it (``freers``, :func:`autoremat.costs.model.freers`) holds
    ``holder`` (it cannot be chosen with the checkpoint): a BERT layer's output block takes
    the attention's output, which the intermediate block's Linear saved."""
    if first not in line.spans:
        return False
    if key in rec.output_keys[rec.tree] and same_storage(rec, key, -1, line.events[first][0]):
        return True  # the model returns it (made before: the same storage) and holds it
    if key not in rec.savers:
        return False
    begin = line.spans[first][0]
    earlier = any(s in line.spans and line.spans[s][1] < begin for s in rec.savers[key][1])
    return earlier and all(rec.within(holder, f) for f in freers)


def same_storage(rec: Recording, key: int, since: int, until: int) -> bool:
    """Whether the storage with ``key`` at event ``until`` is the one made before event
    ``since`` (``-1``: the first made), no storage with that key made in between (a freed
    storage's key can be reused)."""
    made = rec.made_at.get(key, [])
    if since < 0:
        return bool(made) and made[-1] <= until
    return not any(since < c <= until for c in made)


Released = tuple[tuple[tuple[int, int], ...], int]  # ((event, bytes) of each input, done)


def released_inputs(rec: Recording, line: Timeline) -> dict[Node, Released]:
    """For each node, the inputs saved inside it that the step without recompute frees
    part-way through its backward, ``(event, bytes)``: the last grad_fn inside it that saved
    one has run by that event (:attr:`Recording.input_unpacks`; an LSTM cell's previous cell
    state, which its forget gate's product saves: that grad_fn runs first); and the event by
    which every grad_fn of the node that saved anything has run (:attr:`Recording.used_by`):
    until then a checkpoint of it keeps its inputs. Not an input a node outside saved too
    that is not after it (it holds it longer), nor one the model returns."""
    done = _done(rec)
    found = {}
    for n in line.spans:
        gone = tuple(
            (used, size)
            for key, size in rec.input_keys[n].items()
            if (used := _last_use(rec, line, n, key)) is not None and used < done[n]
        )
        if gone:
            found[n] = (gone, done[n])
    return found


def kept_at(released: Released, event: int) -> int:
    """The bytes a checkpoint holds beyond the step without recompute in the stretch of its
    backward that ends with ``event`` (:func:`released_inputs`)."""
    gone, done = released
    return sum(size for e, size in gone if e < event <= done)


def kept_inputs(
    rec: Recording, line: Timeline, released: dict[Node, Released]
) -> dict[Node, tuple[tuple[int, int], ...]]:
    """For each node, ``(point, bytes)``: how much more than the step without recompute its
    checkpoint holds at the points of its backward by keeping its ``released`` inputs
    (:func:`released_inputs`) to its end: the most of any stretch there, less the step's."""
    stretches = backward_stretches(rec.events, line)
    found = {}
    for n, inputs in released.items():
        extra = risen(stretches, line.spans[n], functools.partial(kept_at, inputs))
        if extra:
            found[n] = extra
    return found


def _done(rec: Recording) -> dict[Node, int]:
    """For each node, the event after which every grad_fn inside it that saved something has
    run (-1: none did)."""
    found: dict[Node, int] = {}

    def visit(n: Node) -> int:
        found[n] = max([rec.used_by.get(n, -1), *(visit(c) for c in n.children)])
        return found[n]

    visit(rec.tree)
    return found


def _last_use(rec: Recording, line: Timeline, n: Node, key: int) -> int | None:
    """The event after which the step frees input ``key`` of ``n`` in ``n``'s backward: when
    the last grad_fn inside ``n`` that saved it has run (``None``: it is not so freed, or
    that is not known)."""
    if key not in rec.savers or key in rec.output_keys[rec.tree]:
        return None
    inside = [s for s in rec.savers[key][1] if rec.within(s, n)]
    outside_after = all(
        s in line.spans and line.spans[s][0] > line.spans[n][1]
        for s in rec.savers[key][1]
        if not rec.within(s, n)
    )
    used = [rec.input_unpacks.get((s, key)) for s in inside]
    if not inside or not outside_after or None in used:
        return None
    return max(used)  # type: ignore[type-var]

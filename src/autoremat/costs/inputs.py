"""What a checkpoint's inputs cost: the checkpoint keeps every input until the node's
backward, which costs only the inputs that would otherwise have died sooner.

Not charged: an input saved inside the node (freed with it, or kept anyway), one that a node
ended earlier saved (alive until that node's backward, after this one's: a BERT layer's output
block takes the attention output the intermediate block's Linear saved), and one the model
returns (the step holds it: T5's encoder output). An input saved inside the node is charged
in the node's backward, once the grad_fns that saved it have run (:func:`kept_inputs`: an
LSTM cell's previous cell state). Pure functions over a recording and its timeline, as
:mod:`autoremat.costs.model`.
"""

from __future__ import annotations

import functools
from collections import defaultdict

from autoremat.costs.timeline import Timeline, backward_stretches, risen
from autoremat.record.recording import Recording
from autoremat.record.tree import Node

__all__ = [
    "Released",
    "alive_until_after",
    "charged_inputs",
    "consumers",
    "kept_at",
    "kept_inputs",
    "released_inputs",
    "same_storage",
]


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

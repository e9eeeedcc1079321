"""What a checkpoint's inputs cost: the checkpoint keeps every input until the node's
backward, which costs only the inputs that would otherwise have died sooner
(:func:`charged_inputs`; which would not: :func:`alive_until_after`). Pure functions over a
recording and its timeline, as :mod:`autoremat.costs.model`.
"""

from __future__ import annotations

from collections import defaultdict

from autoremat.costs.timeline import Timeline
from autoremat.record.recording import Recording
from autoremat.record.tree import Node

__all__ = ["alive_until_after", "charged_inputs"]


def charged_inputs(
    rec: Recording, line: Timeline, freers: dict[int, list[Node]]
) -> dict[Node, int]:
    """For each node, the bytes of the inputs its checkpoint keeps longer than they
    would otherwise live: those nothing inside it saved, but those alive until after its
    backward anyway (:func:`alive_until_after`; ``freers``:
    :func:`autoremat.costs.model.freers`)."""
    found: dict[Node, int] = defaultdict(int)
    for n in rec.tree.walk():
        for key, size in rec.input_keys[n].items():
            saved_inside = key in rec.savers and any(rec.within(p, n) for p in rec.savers[key][1])
            if not saved_inside and not alive_until_after(rec, line, n, n, key, freers[key]):
                found[n] += size
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
    if key in rec.output_keys[rec.tree]:
        return True  # the model returns it and holds it
    begin = line.spans[first][0]
    earlier = key in rec.savers and any(line.spans[s][1] < begin for s in rec.savers[key][1])
    return earlier and all(rec.within(holder, f) for f in freers)

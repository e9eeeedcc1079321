"""The step's memory timeline: where each node sits, and the live bytes at each point.

Nodes are numbered ``0..n-1`` by the time their (last) forward call ended, their ``end``; a
node's ``start`` is how many nodes had ended before its first call began. A *point*
``(p, bytes)`` says that at some moment ``bytes`` were live while exactly the nodes numbered
below ``p`` had ended their forward and not begun their backward: recomputing any of those
would have lowered that moment by what it frees. Points of the forward pass (up to the loss)
are kept apart from those after it.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from autoremat.record.recording import Event
from autoremat.record.tree import Node

__all__ = ["Timeline", "timeline"]

Points = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Timeline:
    """``spans``: node -> (start, end); ``forward_points``/``backward_points``; ``events``:
    node -> (index of its first event, of its last); ``backward_now``: node -> live bytes when
    its recompute would begin (when backward first used what it saved, else when its backward
    began); ``ended_before[i]``: how many nodes had ended before event ``i``. Nodes are the
    recording's."""

    spans: dict[Node, tuple[int, int]]
    forward_points: Points
    backward_points: Points
    events: dict[Node, tuple[int, int]]
    backward_now: dict[Node, int]
    ended_before: list[int]


def timeline(tree: Node, events: list[Event], unpacked: dict[Node, int]) -> Timeline:
    """The :class:`Timeline` of a recorded step (``unpacked``: node -> live bytes when
    backward first used what it saved)."""
    last_end: dict[Node, int] = {}
    first_start: dict[Node, int] = {}
    for i, (kind, node, _, _) in enumerate(events):
        if kind == "end":
            last_end[node] = i
        elif kind == "start":
            first_start.setdefault(node, i)
    order = sorted(last_end, key=last_end.__getitem__)
    index = {node: k for k, node in enumerate(order)}
    ends = sorted(last_end.values())
    ended_before = [bisect_left(ends, i) for i in range(len(events) + 1)]
    spans = {n: (ended_before[first_start[n]], index[n]) for n in tree.walk()}
    forward, backward, backward_now = _points(events, index, ended_before, unpacked)
    firsts_lasts = {node: (first_start[node], last_end[node]) for node in last_end}
    return Timeline(spans, forward, backward, firsts_lasts, backward_now, ended_before)


def _points(
    events: list[Event], index: dict[Node, int], ended_before: list[int], unpacked: dict[Node, int]
) -> tuple[Points, Points, dict[Node, int]]:
    """The most live bytes at each point, in the forward and after it; and the live bytes
    when each node's recompute would begin."""
    loss_at = next(i for i, e in enumerate(events) if e[0] == "loss")
    peaks: tuple[dict[int, int], dict[int, int]] = ({}, {})
    backward_now: dict[Node, int] = {}
    prefix = len(index)  # nodes 0..prefix-1 have all not begun their backward
    for i, (kind, node, peak, now) in enumerate(events):
        # the peak was reached in the interval that ends with event i
        p, phase = (ended_before[i], peaks[0]) if i <= loss_at else (prefix, peaks[1])
        phase[p] = max(phase.get(p, 0), peak)
        if kind == "backward" and node in index and node not in backward_now:
            prefix = min(prefix, index[node])
            backward_now[node] = unpacked.get(node, now)
    forward, backward = (tuple(sorted(phase.items())) for phase in peaks)
    return forward, backward, backward_now

"""Kernels' scratch: the transient buffers an op allocates and frees inside itself, which no
op returns and the tensor tracker does not see. With the CPU allocator watching a recorded
step (:func:`autoremat.record.recording.record_step` with ``allocator``), each stretch's peak
is raised to what the allocator saw in it (:func:`with_scratch`).
"""

from __future__ import annotations

from autoremat.record.memory import CpuAllocatorMemory
from autoremat.record.tree import Node

__all__ = ["Highs", "births_with_scratch", "with_scratch"]


class Highs:
    """The CPU allocator's figures at its marks (numbered ``0, 1, ...``), for
    :func:`with_scratch`: ``rise(a, b)``, the most it rose above its figure at mark ``a``
    (``-1``: the start) up to mark ``b``."""

    def __init__(self, allocator: CpuAllocatorMemory, count: int) -> None:
        self.now = [allocator.marks.get(str(k), 0) for k in range(count)]
        self.high = [allocator.highs.get(str(k), 0) for k in range(count)]

    def rise(self, a: int, b: int) -> int:
        start = self.now[a] if a >= 0 else 0
        return max(self.high[a + 1 : b + 1], default=start) - start


def with_scratch(
    events: list[tuple[str, Node, int, int]],
    last_save: dict[Node, tuple[int, int]],
    highs: Highs,
    event_marks: list[int],
    save_marks: dict[Node, int],
) -> None:
    """Raise each peak of a recording (its ``events``, as
    :data:`~autoremat.record.recording.Event`; its nodes' ``last_save``) to what the CPU
    allocator saw in the stretch it ends: the live bytes at the event before plus the
    allocator's rise since (``event_marks``, ``save_marks``: the allocator's marks there). The
    rise counts the transient buffers a kernel allocates and frees inside one op, which no op
    returns and the tracker does not see. Within a stretch a recompute frees the same bytes at
    every moment, so a peak lowered by what it frees stays the device's."""
    before = 0
    for i, (kind, node, peak, now) in enumerate(events):
        rise = highs.rise(event_marks[i - 1] if i else -1, event_marks[i])
        events[i] = (kind, node, max(peak, before + rise), now)
        before = now
    for node, (count, peak) in last_save.items():
        raised = _raised(events, event_marks, highs, count, peak, save_marks[node])
        last_save[node] = (count, raised)


def _raised(
    events: list[tuple[str, Node, int, int]],
    event_marks: list[int],
    highs: Highs,
    count: int,
    peak: int,
    mark: int,
) -> int:
    """``peak``, of a moment at allocator mark ``mark`` in the stretch after event ``count``,
    raised to the live bytes at that event plus the allocator's rise since."""
    since = events[count - 1][3] if count else 0
    return max(peak, since + highs.rise(event_marks[count - 1] if count else -1, mark))


def births_with_scratch(
    events: list[tuple[str, Node, int, int]],
    born: dict[int, int],
    born_after: dict[int, tuple[int, int, int]],
    highs: Highs | None,
    event_marks: list[int],
) -> dict[int, tuple[int, int]]:
    """Each kept output's ``(ops before the op that made it, the stretch's peak before that
    op)``, that peak raised as :func:`with_scratch` raises a stretch's (``born_after``: the
    allocator's mark before the op last; ``highs`` ``None``: no allocator watched)."""
    return {
        uid: (ops, peak if highs is None or mark < 0
              else _raised(events, event_marks, highs, born[uid], peak, mark))
        for uid, (ops, peak, mark) in born_after.items()
    }  # fmt: skip

"""Plan entries: what a plan names, and what each entry covers.

An entry is a module's qualified name as in ``model.named_modules()`` (``""`` is the model
itself), or ``path[i:j]``: the run of children ``i..j-1`` of the plain ``nn.Sequential`` at
``path``, recomputed as one. Run bounds have at most :data:`MAX_BOUND_DIGITS` digits.

Nothing here expands a run into its children unless asked to (:func:`covered`): a run's
bounds are checked arithmetically (:func:`first_nested`), so an entry such as
``"[0:3000000]"`` costs what its text costs.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Sequence

__all__ = [
    "ENTRY",
    "MAX_BOUND_DIGITS",
    "covered",
    "first_nested",
    "inside",
    "parse_run",
    "run_entry",
]

# A run bound fits in 64 bits (and int() never meets Python's limit on digits).
MAX_BOUND_DIGITS = 18
_BOUND = rf"\d{{1,{MAX_BOUND_DIGITS}}}"
# Any entry: a path without spaces or brackets, with an optional [i:j].
ENTRY = re.compile(rf"[^\s\[\]]*(\[{_BOUND}:{_BOUND}\])?")
_RUN = re.compile(rf"(.*)\[({_BOUND}):({_BOUND})\]")
# A child's name as covered() spells its index: decimal, no leading zero.
_INDEX = re.compile(rf"0|[1-9]\d{{0,{MAX_BOUND_DIGITS - 1}}}", re.ASCII)


def parse_run(entry: str) -> tuple[str, int, int] | None:
    """``(path, i, j)`` for a run entry ``path[i:j]``; ``None`` for a module path."""
    match = _RUN.fullmatch(entry)
    if match is None:
        return None
    return match.group(1), int(match.group(2)), int(match.group(3))


def run_entry(path: str, i: int, j: int) -> str:
    """The entry of the run ``[i:j)`` of the children of ``path``."""
    return f"{path}[{i}:{j}]"


def covered(entry: str) -> list[str]:
    """The module paths an entry recomputes (a run covers its children). A run's list is as
    long as the run: use :func:`first_nested` to check entries without expanding them."""
    run = parse_run(entry)
    if run is None:
        return [entry]
    parent, i, j = run
    return [f"{parent}.{k}" if parent else str(k) for k in range(i, j)]


def inside(inner: str, outer: str) -> bool:
    """Whether module path ``inner`` is ``outer`` or inside it (everything is inside the root
    ``""``)."""
    return outer == "" or inner == outer or inner.startswith(outer + ".")


class _Node:
    """A path in the trie of :func:`first_nested`: its children by name, the module entry at
    it, if any, and the runs of its children (``(i, j, entry)``, sorted, disjoint once
    checked). Fields stay ``None`` until needed (a node per entry component)."""

    __slots__ = ("children", "module", "runs", "starts")

    def __init__(self) -> None:
        self.children: dict[str, _Node] | None = None
        self.module: str | None = None
        self.runs: list[tuple[int, int, str]] | None = None
        self.starts: Sequence[int] = ()

    def child(self, name: str) -> _Node:
        if self.children is None:
            self.children = {}
        node = self.children.get(name)
        if node is None:
            node = self.children[name] = _Node()
        return node

    def run_at(self, name: str) -> str | None:
        """The run among :attr:`runs` that covers the child called ``name``, if any."""
        if not self.runs or not _INDEX.fullmatch(name):
            return None
        k = bisect.bisect_right(self.starts, int(name)) - 1
        return self.runs[k][2] if k >= 0 and int(name) < self.runs[k][1] else None


def _anchor(entry: str) -> tuple[list[str], tuple[int, int] | None]:
    """The path components of a module entry, or of a run's parent with the run's bounds."""
    run = parse_run(entry)
    path = entry if run is None else run[0]
    return [] if path == "" else path.split("."), None if run is None else run[1:]


def first_nested(entries: Iterable[str]) -> tuple[str, str] | None:
    """``(inner, outer)``: two distinct entries such that a module ``inner`` recomputes is
    inside (or is) one that ``outer`` recomputes (see :func:`covered` and :func:`inside`), or
    ``None`` when no entry is inside another. ``inner`` is the deeper one; of two entries that
    cover the same module (overlapping runs, a run and one of its children), the one first in
    sorted order. Repeated entries count once; an empty run (``i >= j``) covers nothing.

    Runs are never expanded: time and memory are linear in the entries' total length, plus a
    sort (O(n log n)).
    """
    root = _Node()
    distinct = sorted(set(entries))
    for e in distinct:
        parts, bounds = _anchor(e)
        node = root
        for part in parts:
            node = node.child(part)
        if bounds is None:
            node.module = e
        elif bounds[0] < bounds[1]:
            node.runs = node.runs or []
            node.runs.append((*bounds, e))
    overlap = _overlapping_runs(root)
    if overlap is not None:
        return overlap
    for e in distinct:
        parts, bounds = _anchor(e)
        if bounds is not None and bounds[0] >= bounds[1]:
            continue
        node = root
        for part in parts:
            outer = node.module if node.module is not None else node.run_at(part)
            if outer is not None:
                return e, outer
            node = node.child(part)
        if bounds is not None and node.module is not None:
            return e, node.module
    return None


def _overlapping_runs(root: _Node) -> tuple[str, str] | None:
    """Two runs of the same children that overlap (the one first in sorted order first), or
    ``None``; sorts each node's runs and sets its ``starts``."""
    stack = [root]
    while stack:
        node = stack.pop()
        stack.extend((node.children or {}).values())
        if not node.runs:
            continue
        node.runs.sort()
        widest = node.runs[0]
        for run in node.runs[1:]:
            if run[0] < widest[1]:
                return min(run[2], widest[2]), max(run[2], widest[2])
            widest = run
        node.starts = [i for i, _, _ in node.runs]
    return None

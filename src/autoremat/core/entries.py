"""Plan entries: what a plan names, and what each entry covers.

An entry is a module's qualified name as in ``model.named_modules()`` (``""`` is the model
itself: every call of the module is recomputed), ``path@k``: only the ``k``-th call of that
module in one forward of the model (counted from 0; for a module that runs several times, such
as a shared layer or a cell stepped in a loop), or ``path[i:j]``: the run of children
``i..j-1`` of the plain ``nn.Sequential`` at ``path``, recomputed as one. Run bounds and call
indices have at most :data:`MAX_BOUND_DIGITS` digits.

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
    "call_entry",
    "call_key",
    "covered",
    "first_nested",
    "inside",
    "module_of",
    "parse_call",
    "parse_run",
    "run_entry",
]

# A run bound fits in 64 bits (and int() never meets Python's limit on digits).
MAX_BOUND_DIGITS = 18
_BOUND = rf"\d{{1,{MAX_BOUND_DIGITS}}}"
# Any entry: a path without spaces or brackets, with an optional [i:j] or @k.
ENTRY = re.compile(rf"[^\s\[\]@]*(\[{_BOUND}:{_BOUND}\]|@{_BOUND})?")
_RUN = re.compile(rf"(.*)\[({_BOUND}):({_BOUND})\]")
_CALL = re.compile(rf"([^@]*)@({_BOUND})")
# A child's name as covered() spells its index: decimal, no leading zero.
_INDEX = re.compile(rf"0|[1-9]\d{{0,{MAX_BOUND_DIGITS - 1}}}", re.ASCII)


def parse_run(entry: str) -> tuple[str, int, int] | None:
    """``(path, i, j)`` for a run entry ``path[i:j]``; ``None`` for a module path."""
    match = _RUN.fullmatch(entry)
    if match is None:
        return None
    return match.group(1), int(match.group(2)), int(match.group(3))


def parse_call(entry: str) -> tuple[str, int] | None:
    """``(path, k)`` for a call entry ``path@k``; ``None`` for any other entry."""
    match = _CALL.fullmatch(entry)
    if match is None:
        return None
    return match.group(1), int(match.group(2))


def call_entry(path: str, k: int) -> str:
    """The entry of the ``k``-th call (from 0) of the module at ``path``."""
    return f"{path}@{k}"


def call_key(path: str, k: int, calls: int) -> str:
    """How a profile names the ``k``-th of the ``calls`` calls of the module at ``path``: its
    path when it ran once, else :func:`call_entry`."""
    return path if calls == 1 else call_entry(path, k)


def module_of(entry: str) -> str:
    """The module path an entry names: the module itself, a call's module, or a run's
    Sequential."""
    call = parse_call(entry)
    if call is not None:
        return call[0]
    run = parse_run(entry)
    return entry if run is None else run[0]


def run_entry(path: str, i: int, j: int) -> str:
    """The entry of the run ``[i:j)`` of the children of ``path``."""
    return f"{path}[{i}:{j}]"


def covered(entry: str) -> list[str]:
    """The module paths an entry recomputes (a run covers its children; a call entry, some of
    its module's calls). A run's list is as long as the run: use :func:`first_nested` to check
    entries without expanding them."""
    call = parse_call(entry)
    if call is not None:
        return [call[0]]
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

    A call entry ``path@k`` is inside (or holds) every other kind of entry that covers its
    module, an ancestor or a descendant of it (the call runs inside every call of its
    ancestors, for all the names know); two call entries never nest here: which calls of one
    module run inside which call of another is known only from a profile (a plan made by
    :func:`autoremat.plan` never nests them; nested ones would still train exactly, each
    recompute running its inner checkpoint again).

    Runs are never expanded: time and memory are linear in the entries' total length, plus a
    sort (O(n log n)).
    """
    distinct = sorted(set(entries))
    calls = [e for e in distinct if parse_call(e) is not None]
    root = _Node()
    distinct = [e for e in distinct if parse_call(e) is None]
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
    return _call_nested(root, calls)


def _call_nested(root: _Node, calls: list[str]) -> tuple[str, str] | None:
    """The first call entry among ``calls`` (sorted) that nests with an entry of the trie
    ``root`` (every other kind of entry), as :func:`first_nested` says."""
    for e in calls:
        path = e.rpartition("@")[0]
        node: _Node | None = root
        for part in [] if path == "" else path.split("."):
            assert node is not None
            outer = node.module if node.module is not None else node.run_at(part)
            if outer is not None:
                return e, outer
            node = (node.children or {}).get(part)
            if node is None:
                break
        if node is None:
            continue
        if node.module is not None:
            return e, node.module
        inner = _first_below(node)
        if inner is not None:
            return inner, e
    return None


def _first_below(node: _Node) -> str | None:
    """An entry of the trie strictly below ``node`` (a run of its children included)."""
    stack = [node]
    while stack:
        here = stack.pop()
        if here.runs:
            return here.runs[0][2]
        if here is not node and here.module is not None:
            return here.module
        stack.extend((here.children or {}).values())
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

"""Plan entries: what a plan names, and what each entry covers.

An entry is a module's qualified name as in ``model.named_modules()`` (``""`` is the model
itself), or ``path[i:j]``: the run of children ``i..j-1`` of the plain ``nn.Sequential`` at
``path``, recomputed as one.
"""

from __future__ import annotations

import re

__all__ = ["ENTRY", "covered", "inside", "parse_run", "run_entry"]

# Any entry: a path without spaces or brackets, with an optional [i:j].
ENTRY = re.compile(r"[^\s\[\]]*(\[\d+:\d+\])?")
_RUN = re.compile(r"(.*)\[(\d+):(\d+)\]")


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
    """The module paths an entry recomputes (a run covers its children)."""
    run = parse_run(entry)
    if run is None:
        return [entry]
    parent, i, j = run
    return [f"{parent}.{k}" if parent else str(k) for k in range(i, j)]


def inside(inner: str, outer: str) -> bool:
    """Whether module path ``inner`` is ``outer`` or inside it (everything is inside the root
    ``""``)."""
    return outer == "" or inner == outer or inner.startswith(outer + ".")

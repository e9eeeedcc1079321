"""Claims 2 and 3: choose split points level by level against a preset count.

The walk is docs/method.md's ("Claims 2 and 3"): at each level, from the root's, nodes whose
children are all leaves join the mandatory list; the scheme is that list then the level's other
nodes, returned once it has more than ``segments`` nodes, else the walk descends into the other
nodes (the last scheme when the tree ends). A module that cannot be recomputed exactly
(``Node.recompute_reason``) is dissolved: its children take its place among its parent's; those
the walk met are reported with their reasons (``left_out``).
"""

from __future__ import annotations

from typing import Any

from autoremat.planning.strategy import Request, Strategy, left_out_warning
from autoremat.record.tree import Node

__all__ = ["DEFAULT_SEGMENTS", "STRATEGY", "choose_levels"]

DEFAULT_SEGMENTS = 3


def choose_levels(root: Node, segments: int, left_out: dict[str, str] | None = None) -> list[Node]:
    """The split scheme of claims 2-3 for the tree under ``root`` and a preset ``segments``.

    Returns the nodes of the scheme: the mandatory split points in the order they were met,
    then the other nodes of the level where the walk stopped. Returns an empty list when the
    root is a leaf. Nodes that cannot be recomputed exactly are dissolved (module docstring);
    those the walk met are written to ``left_out`` (path -> reason). Pure otherwise: reads
    the tree, changes nothing.

    Raises:
        ValueError: ``segments`` is negative.
        TypeError: ``segments`` is not an int.
    """
    _check(Request("", segments))
    mandatory: list[Node] = []
    scheme: list[Node] = []
    level = _dissolved([root], left_out)
    while level:
        others: list[Node] = []
        for node in level:
            if node.is_leaf:
                continue
            if all(child.is_leaf for child in _dissolved(node.children)):
                mandatory.append(node)
            else:
                others.append(node)
        scheme = mandatory + others
        if len(scheme) > segments:
            return scheme
        level = _dissolved([child for node in others for child in node.children], left_out)
    return scheme


def _dissolved(nodes: list[Node], met: dict[str, str] | None = None) -> list[Node]:
    """``nodes`` with each non-leaf that cannot be recomputed replaced by its children, in
    place, recursively; the replaced ones written to ``met`` with their reasons."""
    found: list[Node] = []
    for node in nodes:
        reason = node.recompute_reason
        if reason is None or node.is_leaf:
            found.append(node)
            continue
        if met is not None:
            met.setdefault(node.path, reason)
        found.extend(_dissolved(node.children, met))
    return found


def _check(request: Request) -> Request:
    segments = request.segments
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError(f"segments must be an int, got {type(segments).__name__}")
    if segments < 0:
        raise ValueError(f"segments must be >= 0, got {segments}; try segments=3")
    return request


def _choose(tree: Node, request: Request) -> dict[str, Any]:
    assert request.segments is not None
    left_out: dict[str, str] = {}
    chosen = choose_levels(tree, request.segments, left_out)
    warnings = {"left_out": left_out_warning(left_out, request.model_name)}
    if [n.path for n in chosen] == [""]:
        warnings["whole_model"] = (
            f"segments={request.segments} recomputes the whole {request.model_name} as one "
            f"piece: backward runs its whole forward again and keeps all of it, so the step "
            f"peaks no lower than without a plan, and takes longer; "
            + ("use segments=1 or more (or budget=...)" if request.segments == 0 else
               "its children are all leaves, so no count splits it further: use budget=... "
               "(which can recompute runs of its children)")
        )  # fmt: skip
    return {
        "modules": tuple(n.path for n in chosen),
        "segments": request.segments,
        "left_out": left_out,
        "warnings": {kind: text for kind, text in warnings.items() if text},
    }


STRATEGY = Strategy(name="levels", keyword="segments", needs="tree", check=_check, choose=_choose)

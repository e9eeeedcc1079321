"""Claims 2 and 3: choose split points level by level against a preset count.

The walk, exactly as the method page states it:

1. Start with the level made of the root.
2. At a level, every node whose children are *all leaves* is a split point and is appended to
   the *mandatory list*, which is kept from then on. The level's *other nodes* are its nodes whose
   children include a non-leaf. Leaves met on a level are neither: they stay unwrapped.
3. The candidate scheme is the mandatory list followed by the level's other nodes.
4. If the scheme has **more than** ``segments`` nodes, return it. Otherwise the next level is the
   children of this level's other nodes; go to 2.
5. When there is no next level, return the last scheme.

The chosen nodes are never nested: a mandatory node is never descended into, and the other
nodes of a level are replaced by their children when the walk descends.
"""

from __future__ import annotations

from typing import Any

from autoremat.strategies import Request, Strategy
from autoremat.tree import Node

__all__ = ["DEFAULT_SEGMENTS", "STRATEGY", "choose_levels"]

DEFAULT_SEGMENTS = 3


def choose_levels(root: Node, segments: int) -> list[Node]:
    """The split scheme of claims 2-3 for the tree under ``root`` and a preset ``segments``.

    Returns the nodes of the scheme: the mandatory split points in the order they were met,
    then the other nodes of the level where the walk stopped. Returns an empty list when the
    root is a leaf. Pure: reads the tree, changes nothing.

    Raises:
        ValueError: ``segments`` is negative.
        TypeError: ``segments`` is not an int.
    """
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError(f"segments must be an int, got {type(segments).__name__}")
    if segments < 0:
        raise ValueError(f"segments must be >= 0, got {segments}")
    mandatory: list[Node] = []
    scheme: list[Node] = []
    level = [root]
    while level:
        others: list[Node] = []
        for node in level:
            if node.is_leaf:
                continue
            if all(child.is_leaf for child in node.children):
                mandatory.append(node)
            else:
                others.append(node)
        scheme = mandatory + others
        if len(scheme) > segments:
            return scheme
        level = [child for node in others for child in node.children]
    return scheme


def _check(request: Request) -> Request:
    segments = request.segments
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError(f"segments must be an int, got {type(segments).__name__}")
    if segments < 0:
        raise ValueError(f"segments must be >= 0, got {segments}; try segments=3")
    return request


def _choose(tree: Node, request: Request) -> dict[str, Any]:
    assert request.segments is not None
    chosen = choose_levels(tree, request.segments)
    return {"modules": tuple(n.path for n in chosen), "segments": request.segments}


STRATEGY = Strategy(name="levels", keyword="segments", needs="tree", check=_check, choose=_choose)

"""Claims 2 and 3 of the method (docs: /work/shared/patent-method.md), step by step.

The walk under test (:func:`autoremat.planning.strategies.levels.choose_levels`):

- walk the levels in order, starting with the root;
- at a level, a node whose children are *all leaves* is a split point, appended to a *mandatory
  list* kept from then on; a node whose children include a non-leaf is an *other node*; a leaf
  is neither;
- the candidate scheme = mandatory list + the level's other nodes;
- if its count is *greater than* the preset number, return it; otherwise descend to the children
  of the level's other nodes;
- *(reading)* when the levels run out, the last scheme is returned.

The first tests use hand-built trees so every expected scheme can be worked out by hand. The
property tests run the walk on random trees and check invariants stated independently of the
implementation. The last tests go through :func:`autoremat.plan` on real modules.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import autoremat
from autoremat.planning.strategies.levels import choose_levels
from autoremat.record.tree import Node

# --------------------------------------------------------------------------------------------
# Helpers for hand-built trees
# --------------------------------------------------------------------------------------------


def node(path: str, *children: Node) -> Node:
    """A node at ``path`` with ``children``; a node without children is a leaf."""
    return Node(
        name=path.rsplit(".", 1)[-1],
        path=path,
        module=nn.Identity(),
        children=list(children),
    )


def paths(nodes: list[Node]) -> list[str]:
    return [n.path for n in nodes]


def snapshot(n: Node) -> tuple:
    """Everything about a tree that the walk could change, by value and by identity."""
    return (
        id(n),
        n.name,
        n.path,
        id(n.module),
        id(n.children),
        n.inputs,
        n.outputs,
        n.calls,
        tuple(snapshot(c) for c in n.children),
    )


def two_by_two() -> Node:
    """Levels: 0 = [root] (other), 1 = [a, b] (others), 2 = [a.x, a.y, b.x, b.y] (split points).

    Scheme counts per level: 1, 2, 4.
    """
    return node(
        "",
        node("a", node("a.x", node("a.x.l")), node("a.y", node("a.y.l"))),
        node("b", node("b.x", node("b.x.l")), node("b.y", node("b.y.l"))),
    )


# --------------------------------------------------------------------------------------------
# 1. Split points, other nodes, leaves
# --------------------------------------------------------------------------------------------


def test_all_leaf_children_make_a_split_point_and_non_leaf_child_makes_an_other_node():
    """Claim 2: a node whose children are all leaves is a split point (mandatory); a node whose
    children include a non-leaf is an "other node"; a leaf on the level is neither."""
    root = node(
        "",
        node("p", node("p.l1"), node("p.l2")),  # all children leaves -> split point
        node("q", node("q.r", node("q.r.l")), node("q.l")),  # a non-leaf child -> other node
        node("leaf"),  # a leaf -> neither
    )
    # Level 0 = [root]: 1 node, not > 1, so the walk reaches level 1: 2 nodes > 1, stop.
    assert paths(choose_levels(root, 1)) == ["p", "q"]
    # 2 is not > 2: descend. The other node "q" is replaced by its children on level 2: "q.r"
    # is a split point, the leaf "q.l" is neither; the split point "p" stays.
    assert paths(choose_levels(root, 2)) == ["p", "q.r"]


def test_lone_leaf_under_the_root_is_never_chosen():
    """Claim 2 *(reading)*: leaves met on the way (a lone ReLU under a container) are neither
    split points nor other nodes, whatever the preset number."""
    root = node("", node("relu"), node("block", node("block.lin"), node("block.act")))
    for segments in range(6):
        chosen = paths(choose_levels(root, segments))
        assert "relu" not in chosen, segments
    assert paths(choose_levels(root, 1)) == ["block"]


def test_root_with_only_leaf_children_is_itself_a_split_point():
    """Claim 2: the all-leaves rule applies at level 0 too: the root is mandatory and the walk
    has nowhere to descend, so it is the whole scheme for any preset number."""
    root = node("", node("a"), node("b"), node("c"))
    for segments in range(5):
        assert choose_levels(root, segments) == [root], segments


# --------------------------------------------------------------------------------------------
# 2. Scheme = mandatory list + the level's other nodes
# --------------------------------------------------------------------------------------------


def test_scheme_is_mandatory_list_then_other_nodes_in_order_met():
    """Claim 2: the candidate scheme is the mandatory list followed by the level's other nodes;
    split points stay in the order the walk met them, even when registration order
    interleaves them with other nodes."""
    root = node(
        "",
        node("a", node("a.m", node("a.m.l"))),  # other; its child a.m is a split point
        node("b", node("b.l")),  # split point
        node("c"),  # leaf
        node("d", node("d.m", node("d.m.l")), node("d.l")),  # other
        node("e", node("e.l1"), node("e.l2")),  # split point
    )
    # Level 1: mandatory [b, e], others [a, d] -> 4 nodes > 1.
    assert paths(choose_levels(root, 1)) == ["b", "e", "a", "d"]
    # Level 1 count 4 is not > 4: level 2 = children of a and d; a.m and d.m join the mandatory
    # list after b and e (the order met, not registration order a.m, b, d.m, e).
    assert paths(choose_levels(root, 4)) == ["b", "e", "a.m", "d.m"]


def test_mandatory_list_order_follows_level_order_across_parents():
    """Claim 2: within a level the split points are met in level order, i.e. the children of
    the previous level's other nodes in order, parent by parent."""
    root = node(
        "",
        node("x", node("x.s1", node("x.s1.l")), node("x.o", node("x.o.s", node("x.o.s.l")))),
        node("y", node("y.s1", node("y.s1.l")), node("y.s2", node("y.s2.l"))),
    )
    # Level 2: x.s1 (split), x.o (other), y.s1 (split), y.s2 (split).
    assert paths(choose_levels(root, 2)) == ["x.s1", "y.s1", "y.s2", "x.o"]


# --------------------------------------------------------------------------------------------
# 3. "Greater than", not "greater or equal"
# --------------------------------------------------------------------------------------------


def test_walk_descends_when_count_equals_segments_and_stops_when_it_exceeds():
    """Claim 3: stop only when the scheme's count is *greater than* the preset number. At
    level 1 the scheme [a, b] has exactly 2 nodes: with segments=2 the walk must descend to
    level 2; with segments=1 it stops at level 1."""
    root = two_by_two()
    assert paths(choose_levels(root, 2)) == ["a.x", "a.y", "b.x", "b.y"]
    assert paths(choose_levels(root, 1)) == ["a", "b"]


def test_root_level_count_equal_to_segments_descends():
    """Claim 3: level 0 holds one node; with segments=1 the count equals the preset number, so
    the walk does not return the root."""
    root = two_by_two()
    assert choose_levels(root, 1) != [root]
    assert choose_levels(root, 0) == [root]


# --------------------------------------------------------------------------------------------
# 4. The mandatory list is kept across levels
# --------------------------------------------------------------------------------------------


def test_split_point_found_at_level_1_is_kept_in_the_scheme_at_level_3():
    """Claim 2: a split point is appended to the mandatory list "and kept from then on": one
    found at level 1 is still in the scheme the walk returns at level 3."""
    root = node(
        "",
        node("m", node("m.l")),  # split point at level 1
        node(
            "x",
            node(
                "x.y",
                node("x.y.z1", node("x.y.z1.l")),  # split point at level 3
                node("x.y.z2", node("x.y.z2.l")),  # split point at level 3
                node("x.y.w", node("x.y.w.v", node("x.y.w.v.l"))),  # other at level 3
            ),
        ),
    )
    # Counts: level 0 = 1, level 1 = [m, x] = 2, level 2 = [m, x.y] = 2,
    # level 3 = [m, x.y.z1, x.y.z2, x.y.w] = 4 > 3: stop at level 3.
    assert paths(choose_levels(root, 3)) == ["m", "x.y.z1", "x.y.z2", "x.y.w"]
    # And at level 4 (the last) it is still there.
    assert paths(choose_levels(root, 4)) == ["m", "x.y.z1", "x.y.z2", "x.y.w.v"]


# --------------------------------------------------------------------------------------------
# 5. Levels run out: the last scheme is returned
# --------------------------------------------------------------------------------------------


def test_last_scheme_is_returned_when_levels_run_out():
    """Claim 3 *(reading)*: if the tree runs out of levels before the count exceeds the preset
    number, the last scheme is returned, even though its count is <= segments."""
    root = two_by_two()
    for segments in (4, 5, 100):
        chosen = paths(choose_levels(root, segments))
        assert chosen == ["a.x", "a.y", "b.x", "b.y"], segments
        assert len(chosen) <= segments


def test_last_scheme_keeps_early_split_points_and_has_no_other_nodes():
    """Claim 3 *(reading)*: the last scheme is every split point met on the way (the mandatory
    list); the walk only runs out when a level has no other nodes left."""
    root = node(
        "",
        node("s", node("s.l")),
        node("deep", node("deep.s", node("deep.s.l")), node("deep.l")),
        node("leaf"),
    )
    assert paths(choose_levels(root, 50)) == ["s", "deep.s"]


# --------------------------------------------------------------------------------------------
# 6. Edge values of segments and of the root
# --------------------------------------------------------------------------------------------


def test_zero_segments_returns_the_root_level_scheme():
    """Claim 3: with segments=0 the first scheme (level 0 = the root) already has 1 > 0 nodes."""
    root = two_by_two()
    assert choose_levels(root, 0) == [root]


def test_leaf_root_returns_empty_scheme():
    """Claim 2: a leaf is never a split point or an other node, so a leaf root gives []."""
    root = node("")
    for segments in (0, 1, 7):
        assert choose_levels(root, segments) == []


def test_negative_segments_raise_value_error():
    """Claim 3: the preset number is a count of split points; a negative one is refused."""
    with pytest.raises(ValueError, match="segments"):
        choose_levels(two_by_two(), -1)


@pytest.mark.parametrize("bad", [2.0, True, False, "3", None])
def test_non_int_segments_raise_type_error(bad):
    """Claim 3: the preset number must be an int; floats and bools (an int subclass) are
    refused rather than silently compared."""
    with pytest.raises(TypeError, match="segments"):
        choose_levels(two_by_two(), bad)


# --------------------------------------------------------------------------------------------
# 7. Purity
# --------------------------------------------------------------------------------------------


def test_choose_levels_does_not_modify_the_tree():
    """Claims 2-3 only read the tree: the call changes no node, child list or module, and the
    returned list is a new list (editing it leaves a second call unchanged)."""
    root = node(
        "",
        node("m", node("m.l")),
        node("x", node("x.y", node("x.y.z", node("x.y.z.l")), node("x.y.l"))),
        node("leaf"),
    )
    before = snapshot(root)
    for segments in range(6):
        chosen = choose_levels(root, segments)
        assert snapshot(root) == before, segments
        expected = paths(chosen)
        chosen.clear()
        assert paths(choose_levels(root, segments)) == expected, segments
    assert snapshot(root) == before


# --------------------------------------------------------------------------------------------
# Property tests on random trees
# --------------------------------------------------------------------------------------------

MAX_DEPTH = 6
MAX_FANOUT = 5
MAX_NODES = 60
# The walk never looks at the module: one shared object keeps tree generation cheap.
SHARED_MODULE = nn.Identity()


@st.composite
def trees(draw: st.DrawFn) -> Node:
    """A random tree of depth <= MAX_DEPTH, fan-out <= MAX_FANOUT, <= MAX_NODES nodes.

    Each tree draws its own depth and fan-out limits first, so chains, shallow bushes and
    deep ragged trees all come up. Paths are the child indices joined by dots (``""`` for the
    root), so they are unique.
    """
    max_depth = draw(st.sampled_from(range(1, MAX_DEPTH + 1)))
    max_fanout = draw(st.sampled_from(range(1, MAX_FANOUT + 1)))
    budget = [MAX_NODES - 1]

    def build(path: str, depth: int) -> Node:
        children: list[Node] = []
        if depth < max_depth:
            # sampled_from spreads the counts evenly (st.integers leans to 0, which made most
            # trees a bare root or a root of leaves); the root always has a child, leaf roots
            # are the hand-built test's job.
            low = 1 if depth == 0 else 0
            count = draw(st.sampled_from(range(low, min(max_fanout, budget[0]) + 1)))
            budget[0] -= count
            for i in range(count):
                children.append(build(f"{path}.{i}" if path else str(i), depth + 1))
        return Node(
            name=path.rsplit(".", 1)[-1],
            path=path,
            module=SHARED_MODULE,
            children=children,
        )

    return build("", 0)


def depths(root: Node) -> dict[int, int]:
    """``id(node) -> depth`` (root at 0)."""
    out: dict[int, int] = {}
    stack = [(root, 0)]
    while stack:
        n, d = stack.pop()
        out[id(n)] = d
        stack.extend((c, d + 1) for c in n.children)
    return out


def proper_descendants(n: Node) -> set[int]:
    return {id(d) for d in n.walk()} - {id(n)}


def only_leaf_children(n: Node) -> bool:
    return not n.is_leaf and all(c.is_leaf for c in n.children)


segments_st = st.integers(0, 40)


@settings(max_examples=200, deadline=None)
@given(root=trees(), segments=segments_st)
def test_property_chosen_nodes_are_never_nested(root, segments):
    """Claims 2-3 (a): no chosen node is an ancestor of another (split points are never
    descended into; other nodes are replaced by their children when the walk descends)."""
    chosen = choose_levels(root, segments)
    ids = [id(n) for n in chosen]
    assert len(set(ids)) == len(ids), "a node is chosen twice"
    for n in chosen:
        assert not (proper_descendants(n) & set(ids)), n.path


@settings(max_examples=200, deadline=None)
@given(root=trees(), segments=segments_st)
def test_property_chosen_nodes_are_tree_nodes_and_not_leaves(root, segments):
    """Claim 2 (b): leaves are neither split points nor other nodes; everything chosen is a
    node of this tree."""
    chosen = choose_levels(root, segments)
    in_tree = {id(n) for n in root.walk()}
    for n in chosen:
        assert id(n) in in_tree, n.path
        assert not n.is_leaf, n.path


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(root=trees(), segments=segments_st)
def test_property_other_nodes_all_come_from_one_level_after_the_split_points(root, segments):
    """Claim 2 (c): a chosen node either has only leaf children (a split point, from any
    level met) or is an other node of the level where the walk stopped: all chosen nodes with
    a non-leaf child share one depth, no split point is deeper than that depth, and they come
    after every split point in the scheme."""
    chosen = choose_levels(root, segments)
    depth = depths(root)
    kinds = [only_leaf_children(n) for n in chosen]
    other_depths = {depth[id(n)] for n, split in zip(chosen, kinds, strict=True) if not split}
    assert len(other_depths) <= 1
    assert kinds == sorted(kinds, reverse=True), "an other node comes before a split point"
    if other_depths:
        (stop,) = other_depths
        assert all(depth[id(n)] <= stop for n in chosen)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(root=trees(), segments=segments_st)
def test_property_count_exceeds_segments_unless_the_tree_is_exhausted(root, segments):
    """Claim 3 (d): the walk returns a scheme with more than ``segments`` nodes, unless the
    levels ran out. Running out happens exactly when a level has no other nodes, so then the
    scheme is the mandatory list alone and covers the whole tree: every non-leaf node is
    chosen or a proper ancestor of a chosen node (a split point has only leaves below it),
    i.e. the chosen nodes are exactly the nodes whose children are all leaves."""
    chosen = choose_levels(root, segments)
    if len(chosen) > segments:
        return
    chosen_ids = {id(n) for n in chosen}
    assert all(only_leaf_children(n) for n in chosen)
    covered = set(chosen_ids)
    for n in root.walk():
        if chosen_ids & proper_descendants(n):
            covered.add(id(n))
    for n in root.walk():
        if not n.is_leaf:
            assert id(n) in covered, n.path
    assert chosen_ids == {id(n) for n in root.walk() if only_leaf_children(n)}


@settings(max_examples=200, deadline=None)
@given(root=trees(), segments=segments_st)
def test_property_result_is_the_first_depth_whose_scheme_exceeds_segments(root, segments):
    """Claims 2-3 as a closed form by depth. Every non-leaf node at depth d is on level d
    (its ancestors all have a non-leaf child, so they are all other nodes), so the scheme at
    level d is: the nodes at depth <= d with only leaf children (breadth-first order) followed
    by the nodes at depth d with a non-leaf child. The walk returns the first such scheme with
    more than ``segments`` nodes, or the one at the deepest non-leaf depth."""
    chosen = choose_levels(root, segments)
    bfs: list[tuple[Node, int]] = []
    frontier = [root]
    d = 0
    while frontier:
        bfs.extend((n, d) for n in frontier)
        frontier = [c for n in frontier for c in n.children]
        d += 1
    non_leaf_depths = [dd for n, dd in bfs if not n.is_leaf]
    if not non_leaf_depths:
        assert chosen == []
        return
    expected: list[Node] = []
    for level in range(max(non_leaf_depths) + 1):
        split = [n for n, dd in bfs if dd <= level and only_leaf_children(n)]
        other = [n for n, dd in bfs if dd == level and not n.is_leaf and not only_leaf_children(n)]
        expected = split + other
        if len(expected) > segments:
            break
    assert paths(chosen) == paths(expected)


@settings(max_examples=200, deadline=None)
@given(root=trees(), segments=segments_st)
def test_property_deterministic_and_pure(root, segments):
    """Claims 2-3 (e): the same call twice gives the same nodes, and the tree is untouched."""
    before = snapshot(root)
    first = choose_levels(root, segments)
    second = choose_levels(root, segments)
    assert [id(n) for n in first] == [id(n) for n in second]
    assert snapshot(root) == before


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(root=trees(), segments=segments_st)
def test_property_more_segments_never_stops_at_a_shallower_level(root, segments):
    """Claim 3: raising the preset number can only let the walk go deeper: every node chosen
    with ``segments + 1`` is chosen with ``segments`` or lies below (or is) one of them."""
    low = choose_levels(root, segments)
    high = choose_levels(root, segments + 1)
    low_ids = {id(n) for n in low}
    for n in high:
        ancestors_or_self = {id(a) for a in root.walk() if n in list(a.walk())}
        assert ancestors_or_self & low_ids, n.path


# --------------------------------------------------------------------------------------------
# End to end through autoremat.plan on real modules
# --------------------------------------------------------------------------------------------


def block(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU())


def test_plan_sequential_of_blocks_chooses_the_blocks():
    """Claims 1-3 end to end: in ``Sequential(Sequential(Linear, ReLU), ...)`` each block has
    only leaf children, so the blocks are the split points; the root (level 0, one node) is
    not chosen once segments >= 1."""
    torch.manual_seed(0)
    model = nn.Sequential(*(block(8) for _ in range(4)))
    x = torch.randn(2, 8)
    tree = autoremat.build_tree(model, (x,))
    assert [c.path for c in tree.children] == ["0", "1", "2", "3"]
    assert autoremat.plan(model, (x,), segments=3).modules == ("0", "1", "2", "3")
    # 4 is not > 4: the levels run out and the last scheme is returned.
    assert autoremat.plan(model, (x,), segments=4).modules == ("0", "1", "2", "3")
    assert autoremat.plan(model, (x,), segments=0).modules == ("",)


class WithModuleList(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_plan_dissolves_a_module_list_and_chooses_its_blocks():
    """Claim 1 *(reading)*: a ModuleList is never called, so it is dissolved and its blocks
    become children of the parent; claims 2-3 then choose the blocks (split points), never the
    ModuleList's path and never the lone leaf ``head``."""
    model = WithModuleList()
    x = torch.randn(2, 8)
    tree = autoremat.build_tree(model, (x,))
    assert [c.path for c in tree.children] == ["blocks.0", "blocks.1", "blocks.2", "head"]
    with pytest.raises(KeyError, match="blocks"):
        tree.find("blocks")
    for segments in (0, 1, 2, 3, 10):
        modules = autoremat.plan(model, (x,), segments=segments).modules
        assert "blocks" not in modules
        assert "head" not in modules
    assert autoremat.plan(model, (x,), segments=2).modules == ("blocks.0", "blocks.1", "blocks.2")


class WithUnused(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.first = block(width)
        self.unused = block(width)  # registered, never called
        self.second = block(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_plan_leaves_out_a_module_that_never_runs():
    """Claim 1 *(reading)*: only modules whose forward runs are computation modules. A block
    that is registered but never called is not in the tree, so it can never be chosen even
    though its shape (all-leaf children) would make it a split point."""
    model = WithUnused()
    x = torch.randn(2, 8)
    tree = autoremat.build_tree(model, (x,))
    assert [c.path for c in tree.children] == ["first", "second"]
    for path in ("unused", "unused.0", "unused.1"):
        with pytest.raises(KeyError):
            tree.find(path)
    assert autoremat.plan(model, (x,), segments=1).modules == ("first", "second")
    assert autoremat.plan(model, (x,), segments=5).modules == ("first", "second")

"""Claims 2-3 as a user calls them: a :class:`Plan` names the modules to recompute."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from autoremat import wrap
from autoremat.strategies.levels import choose_levels
from autoremat.tree import Node, build_tree


@dataclass(frozen=True)
class Plan:
    """Which modules of a model to recompute in backward, and how they were chosen.

    ``modules`` are qualified names as in ``model.named_modules()`` (``""`` is the model
    itself), never one inside another. ``print(plan)`` shows the tree with the chosen modules
    marked ``*``.
    """

    modules: tuple[str, ...]
    strategy: str
    model_class: str
    segments: int | None = None
    tree: Node | None = field(default=None, repr=False, compare=False)

    def apply(self, model: nn.Module) -> nn.Module:
        """Wrap the plan's modules of ``model`` in place (claim 4) and return ``model``.

        See :func:`autoremat.wrap.apply` for the errors; the model is unchanged when it raises.
        """
        return wrap.apply(model, self.modules)

    def __str__(self) -> str:
        how = f"levels, segments={self.segments}" if self.strategy == "levels" else self.strategy
        head = (
            f"Plan for {self.model_class} ({how}): recompute {len(self.modules)} module"
            f"{'' if len(self.modules) == 1 else 's'}"
        )
        lines = [head] + [f"  {p or '(root)'}" for p in self.modules]
        if self.tree is not None:
            lines += ["", self.tree.render(marked=frozenset(self.modules))]
        return "\n".join(lines)


def plan(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    segments: int = 3,
) -> Plan:
    """Choose the modules of ``model`` to recompute with the levels strategy (claims 2-3).

    Runs ``model(*args, **kwargs)`` once to build the tree (:func:`autoremat.build_tree`; the
    model is left as it was found), then walks it level by level until the scheme holds more
    than ``segments`` modules (:func:`autoremat.strategies.choose_levels`).

    Raises:
        ValueError: ``segments`` is negative, or no submodule of ``model`` ran (there is
            nothing to choose from).
        TypeError: ``segments`` is not an int, or ``model`` is not an ``nn.Module``.
        RuntimeError: the example inputs fail in the forward pass (names the module).
    """
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError(f"segments must be an int, got {type(segments).__name__}")
    if segments < 0:
        raise ValueError(f"segments must be >= 0, got {segments}; try segments=3")
    tree = build_tree(model, args, kwargs)
    if tree.is_leaf:
        raise ValueError(
            f"{type(model).__name__} has no submodules that ran on the example inputs: there "
            f"is nothing to recompute; wrap it in a model with submodules, or check the inputs"
        )
    chosen = choose_levels(tree, segments)
    return Plan(
        modules=tuple(n.path for n in chosen),
        strategy="levels",
        model_class=type(model).__name__,
        segments=segments,
        tree=tree,
    )

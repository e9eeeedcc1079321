"""Strategies: pure functions from a module tree to the paths of the modules to recompute."""

from autoremat.strategies.levels import choose_levels

__all__ = ["choose_levels"]

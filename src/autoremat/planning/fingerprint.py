"""A model's module structure and its hash: what ties a plan to the model it was made for
(:meth:`autoremat.Plan.check` refuses a model of another structure)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from torch import nn

from autoremat.core.classes import own_class

__all__ = ["fingerprint", "structure", "structure_fingerprint"]


def structure(model: nn.Module) -> tuple[str, ...]:
    """The module structure of ``model``: ``"path Class"`` for every module in
    ``named_modules()`` order (``""`` is the root), with the classes modules had before
    autoremat wrapped them or ``fully_shard`` sharded them."""
    return tuple(f"{path} {own_class(m).__qualname__}" for path, m in model.named_modules())


def fingerprint(model: nn.Module) -> str:
    """A short hash of :func:`structure`: equal for models built the same way."""
    return structure_fingerprint(structure(model))


def structure_fingerprint(lines: Sequence[str]) -> str:
    """The :func:`fingerprint` of a model whose :func:`structure` is ``lines``: 16 hex digits.

    Raises:
        UnicodeEncodeError: a line holds a lone surrogate (never a model's structure).
    """
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]

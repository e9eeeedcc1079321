"""The ``autoremat`` command: :func:`main` (:mod:`autoremat.cli.commands`), what its arguments
mean (``arguments``), its parser and help (``parser``), the demo (``demo``) and what a TARGET
names (``targets``)."""

from autoremat.cli.commands import main

__all__ = ["main"]

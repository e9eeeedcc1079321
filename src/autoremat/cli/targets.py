"""What a command-line TARGET names: a built-in example, or ``FILE.py:FACTORY``.

:func:`load_target` builds ``(model, args, kwargs)`` for it; a file target is executed
(imported as Python, with the user's permissions). Every failure is a :class:`TargetError`
whose message names the target and the exception.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from torch import nn

from autoremat.examples import EXAMPLES, Example

__all__ = ["CliError", "TargetError", "load_target"]


class CliError(ValueError):
    """A command-line mistake, with a message in the command line's own terms."""


class TargetError(CliError):
    """A TARGET that names no example and no loadable factory, or whose factory fails."""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_target(target: str) -> Example:
    """``(model, args, kwargs)`` for a TARGET: a name in :data:`autoremat.examples.EXAMPLES`
    or ``path/to/file.py:factory``. The file is executed (imported as Python).

    Raises:
        TargetError: the name is unknown, the file or factory is missing, importing the file
            or calling the factory raises (the message names both and the exception), or the
            factory does not return ``(nn.Module, tuple, dict)``.
    """
    if target in EXAMPLES:
        try:
            return EXAMPLES[target]()
        except Exception as exc:
            raise TargetError(f"building example {target} raised {_one_line(exc)}") from exc
    if ":" not in target:
        raise TargetError(
            f"unknown target {target!r}: use one of {', '.join(EXAMPLES)} "
            f"or path/to/file.py:factory"
        )
    file, _, name = target.rpartition(":")
    module = _import_file(file, name)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise TargetError(f"{file} has no function {name!r}")
    try:
        result = factory()
    except (Exception, SystemExit) as exc:
        raise TargetError(f"{name}() in {file} raised {_one_line(exc)}") from exc
    if not (
        isinstance(result, tuple)
        and len(result) == 3
        and isinstance(result[0], nn.Module)
        and isinstance(result[1], tuple)
        and isinstance(result[2], dict)
    ):
        raise TargetError(
            f"{name}() in {file} must return (model: nn.Module, args: tuple, kwargs: dict), "
            f"not {type(result).__name__}"
        )
    return result


def _import_file(file: str, name: str) -> Any:
    """The module that executing ``file`` makes, for its factory ``name``; the module is in
    ``sys.modules`` (as dataclasses and pickling inside it expect)."""
    path = Path(file)
    if not path.is_file():
        raise TargetError(f"no such file: {file}")
    module_name = f"autoremat_target_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"cannot import {file} as a Python file (name it *.py)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        sys.modules.pop(module_name, None)
        raise TargetError(f"importing {file} (for {name}()) raised {_one_line(exc)}") from exc
    return module

"""What the command's arguments mean: a ``--budget``, a ``--loss``, ``--segments``, and the
messages for budgets below what recompute reaches, in the command line's own words."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from autoremat.cli.targets import CliError
from autoremat.core.sizes import BUDGET_FORMS, format_size, parse_budget, percent_hint
from autoremat.planning.strategies.budget import BudgetTooLow
from autoremat.planning.strategies.levels import DEFAULT_SEGMENTS
from autoremat.record.step import LossFn
from autoremat.training.sharding import Sharding

__all__ = [
    "AUTOCAST",
    "LOSS_HELP",
    "at_least",
    "below_lowest",
    "check_segments",
    "joined_values",
    "loss_from_output",
    "parse_budget_arg",
    "sharding_arg",
]

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --autocast's values

LOSS_HELP = (
    "the loss in the model's output: a key or attribute (loss) or a position (1: the second "
    "of a tuple such as (logits, loss)); default: the output's loss if it has one, else the "
    "sum of every floating-point tensor in it"
)


def parse_budget_arg(text: str) -> int | float | str:
    """What ``--budget TEXT`` asks for, as :func:`autoremat.plan` takes it: a bare number in
    (0, 1] is a fraction (float), a bare whole number above 1 is bytes (int), anything else
    (``"50%"``, ``"2GiB"``, ``"800MB"``) stays a string once its form is checked.

    Raises:
        CliError: none of the forms in :data:`autoremat.core.sizes.BUDGET_FORMS`.
    """
    stripped = text.strip()
    try:
        number: float | None = float(stripped)
    except ValueError:
        number = None
    if number is not None:
        if 0.0 < number <= 1.0:
            return number
        if 1.0 < number < math.inf and number.is_integer():
            return int(number)
        raise CliError(
            f"budget {text}: a bare number is a fraction in (0, 1] or whole bytes; "
            f"use {BUDGET_FORMS}"
        )
    try:
        parse_budget(stripped, 2**40)
    except ValueError:
        why = "; a percentage is above 0% and at most 100%" if stripped.endswith("%") else ""
        raise CliError(f"budget {text} is not understood{why}; use {BUDGET_FORMS}") from None
    return stripped


def at_least(size: int) -> str:
    """A --budget value of at least ``size`` bytes, in the unit :func:`format_size` picks,
    rounded up: ``"23.14MiB"``."""
    unit = format_size(size).split()[1]
    if unit == "B":
        return str(size)
    scale = 2 ** (10 * (1 + ("KiB", "MiB", "GiB", "TiB").index(unit)))
    return f"{math.ceil(size * 100 / scale) / 100:.2f}{unit}"


def below_lowest(exc: BudgetTooLow, text: str, value: int | float | str, model: str) -> str:
    """The start of a message for a budget below the lowest peak any plan reaches."""
    asked = text
    if isinstance(value, float) or str(value).endswith("%"):
        asked += f" ({format_size(parse_budget(value, exc.baseline))})"
    if hint := percent_hint(value):
        asked += f" ({hint})"
    return (
        f"budget {asked} is below the lowest peak {model} reaches, {format_size(exc.lowest)} "
        f"({exc.lowest / exc.baseline:.0%} of {format_size(exc.baseline)} without recompute)"
    )


def check_segments(segments: int | None) -> None:
    """Refuse a negative ``--segments``, suggesting one that works."""
    if segments is not None and segments < 0:
        raise CliError(
            f"--segments must be 0 or more, got {segments}; try --segments {DEFAULT_SEGMENTS}"
        )


def sharding_arg(
    sharding: str | None, world_size: int | None, units: str | None
) -> Sharding | None:
    """The :class:`~autoremat.Sharding` ``--sharding``, ``--world-size`` and ``--fsdp-units``
    name; ``None`` for one device. Each needs the others it depends on, said in one line."""
    if sharding is None:
        if world_size not in (None, 1) or units is not None:
            given = "--world-size" if units is None else "--fsdp-units"
            raise CliError(f"{given} sizes one rank of a job: add --sharding ddp or fsdp2")
        return None
    if world_size is None:
        raise CliError(
            f"--sharding {sharding} needs --world-size N, the number of ranks: it decides "
            f"what each rank holds"
        )
    if units is not None and sharding != "fsdp2":
        raise CliError("--fsdp-units are FSDP2's: use --sharding fsdp2, or drop them")
    paths = None if units is None else tuple(u for u in units.split(",") if u)
    return Sharding(sharding, world_size, paths)


def loss_from_output(where: str | None) -> LossFn | None:
    """The loss function ``--loss WHERE`` names (:data:`LOSS_HELP`); ``None`` for the default
    (:func:`~autoremat.record.step.default_loss`). The loss found must be a tensor: the training
    step then checks that it is a scalar that requires grad."""
    if where is None:
        return None

    def pick(output: Any) -> torch.Tensor:
        if where.isdigit() and isinstance(output, Sequence):
            if int(where) >= len(output):
                raise CliError(
                    f"--loss {where}: the model's output has {len(output)} parts; give a "
                    f"position below {len(output)}, or a key"
                )
            return output[int(where)]
        if isinstance(output, Mapping) and where in output:
            return output[where]
        if not isinstance(output, Mapping) and hasattr(output, where):
            return getattr(output, where)
        keys = list(output) if isinstance(output, Mapping) else []
        raise CliError(
            f"--loss {where}: the model's output ({type(output).__name__}) has no {where!r}"
            + (f"; its keys are {', '.join(map(str, keys[:8]))}" if keys else "")
        )

    return pick


def joined_values(argv: Sequence[str], value_options: Sequence[str]) -> list[str]:
    """``argv`` with each of ``value_options`` joined to a value that starts with ``-``
    (``--budget -5%`` becomes ``--budget=-5%``), so that such a value is refused in the
    option's own words instead of being taken for another option."""
    found: list[str] = []
    tokens = list(argv)
    k = 0
    while k < len(tokens):
        token = tokens[k]
        following = tokens[k + 1] if k + 1 < len(tokens) else ""
        if token in value_options and following[:1] == "-" and following[:2] != "--":
            found.append(f"{token}={following}")
            k += 2
            continue
        found.append(token)
        k += 1
    return found

"""Reading a plan back from JSON: every field validated, the wrong one named.

:func:`plan_from_dict` turns what :meth:`autoremat.Plan.to_dict` wrote into a
:class:`~autoremat.plans.Plan`, or raises ``ValueError`` naming the field that is missing or
wrong. Plans saved before ways had their name (a choice's ``"mode"``), and before per-entry
ops (a ``selective`` list with one ``save_ops``), still load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autoremat.entries import ENTRY
from autoremat.plans import FORMAT, Choice, Plan
from autoremat.selective import DEFAULT_SAVE_OPS, FULL, WAYS, check_names

__all__ = ["plan_from_dict"]

OBJECTIVES = ("time", "flops")
_KIND_NAMES = {"str": "a string", "int": "an integer", "list": "a list", "dict": "an object"}


class _Fields:
    """Typed access to the fields of one JSON object, with errors that name the field."""

    def __init__(self, data: dict[str, Any], bad: Callable[[str], ValueError]) -> None:
        self.data, self.bad = data, bad

    def get(self, key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
        if key not in self.data:
            raise self.bad(f"field {key!r} is missing")
        value = self.data[key]
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, kind):
            raise self.bad(f"field {key!r} is {value!r}, expected {_kind_name(kind)}")
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        value = self.get(key, list)
        if not all(isinstance(x, str) for x in value):
            raise self.bad(f"field {key!r} must be a list of strings")
        return tuple(value)

    def count(self, key: str) -> int | None:
        value = self.get(key, int, optional=True)
        if value is not None and value < 0:
            raise self.bad(f"field {key!r} is {value}, expected a count >= 0")
        return value

    def seconds(self, key: str) -> float | None:
        value = self.data.get(key)
        if value is not None and not _is_seconds(value):
            raise self.bad(f"field {key!r} is {value!r}, expected a number >= 0")
        return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(_KIND_NAMES.get(k.__name__, k.__name__) for k in kinds)


def _is_seconds(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value >= 0


def plan_from_dict(data: Any, where: str = "the data") -> Plan:
    """Validate ``data`` field by field and build the :class:`~autoremat.plans.Plan` (see
    :meth:`~autoremat.plans.Plan.load`).

    Raises:
        ValueError: a field is missing or wrong; the message names it.
    """

    def bad(why: str) -> ValueError:
        return ValueError(f"{where} is not a saved autoremat plan: {why}")

    if not isinstance(data, dict):
        raise bad(f"expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise bad(f"'format' is {data.get('format')!r}, expected {FORMAT!r}")
    fields = _Fields(data, bad)
    strategy = fields.get("strategy", str)
    if strategy not in ("levels", "budget"):
        raise bad(f"field 'strategy' is {strategy!r}, expected 'levels' or 'budget'")
    modules = fields.strings("modules")
    for entry in modules:
        if not ENTRY.fullmatch(entry):
            raise bad(f"module entry {entry!r} is not a module path or path[i:j]")
    selective = _selective(fields, modules)
    objective = data.get("objective")
    if objective is not None and objective not in OBJECTIVES:
        raise bad(f"field 'objective' is {objective!r}, expected one of {OBJECTIVES} or null")
    return Plan(
        modules=modules,
        strategy=strategy,
        model_class=fields.get("model_class", str),
        segments=fields.count("segments"),
        budget=fields.count("budget"),
        estimated_peak=fields.count("estimated_peak"),
        baseline_peak=fields.count("baseline_peak"),
        recompute_flops=fields.count("recompute_flops"),
        objective=objective,
        recompute_seconds=fields.seconds("recompute_seconds"),
        choices=tuple(_choice(c, bad) for c in fields.get("choices", list)),
        selective=selective,
        fingerprint=fields.get("fingerprint", str, optional=True),
        structure=fields.strings("structure"),
    )


def _choice(c: Any, bad: Callable[[str], ValueError]) -> Choice:
    ways = (FULL, *WAYS)
    way = c.get("way", c.get("mode", FULL)) if isinstance(c, dict) else None
    if not (
        isinstance(c, dict)
        and isinstance(c.get("path"), str)
        and all(
            isinstance(c.get(k), int) and not isinstance(c.get(k), bool) for k in ("freed", "flops")
        )
        and way in ways
    ):
        raise bad(
            f"choice {c!r} must be an object with path (str), freed and flops (int), "
            f"way ({', '.join(map(repr, ways))})"
        )
    seconds = c.get("seconds")
    if seconds is not None and not _is_seconds(seconds):
        raise bad(f"choice {c!r}: seconds must be a number >= 0 or null")
    return Choice(c["path"], c["freed"], c["flops"], way, seconds)


def _selective(fields: _Fields, modules: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    raw = fields.get("selective", (dict, list))
    if isinstance(raw, list):  # the first form: a list of paths, all keeping 'save_ops'
        ops = list(fields.data.get("save_ops", DEFAULT_SAVE_OPS))
        raw = {path: ops for path in fields.strings("selective")}
    selective = {}
    for entry, ops in raw.items():
        if not isinstance(ops, list):
            raise fields.bad(
                f"field 'selective' maps {entry!r} to {ops!r}, expected a list of op names"
            )
        try:
            selective[entry] = check_names(ops)
        except (TypeError, ValueError) as e:
            raise fields.bad(f"field 'selective', entry {entry!r}: {e}") from None
    odd = [e for e in selective if e not in modules]
    if odd:
        raise fields.bad(f"selective entries {odd[:5]!r} are not among 'modules'")
    return selective

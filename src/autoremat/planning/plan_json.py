"""Reading a plan back from JSON: every field validated, the wrong one named.

:func:`fields_from_dict` turns what :meth:`autoremat.Plan.to_dict` wrote into the fields of
a :class:`~autoremat.planning.plans.Plan` (``Plan(**fields)``); :func:`fields_from_json` and
:func:`fields_from_file` (behind ``Plan.from_json`` and ``Plan.load``) read the text first.

docs/guide.md ("Plans persist") lists the older forms that still load and what is checked, so
that a file from elsewhere can do no more than fail to load; also ``calls`` (modules of the
plan's structure, each a count in ``[1, 2**63)`` above the index of every call entry of the
module, one for every module a call entry names) and ``left_out`` (modules of that structure,
each reason a string of at most :data:`MAX_REASON_CHARS` characters). Time and memory are
linear in the size of the text (plus sorts). Anything wrong raises ``ValueError``, never
another error.
"""

from __future__ import annotations

import json
import math
import os
import re
import reprlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from autoremat.core.entries import ENTRY, first_nested, module_of, parse_call, parse_run
from autoremat.core.selective import DEFAULT_SAVE_OPS, FULL, WAYS, check_names
from autoremat.planning.choice import OBJECTIVES, Choice
from autoremat.planning.fingerprint import structure_fingerprint

__all__ = [
    "FORMAT",
    "MAX_JSON_DEPTH",
    "MAX_PLAN_BYTES",
    "fields_from_dict",
    "fields_from_file",
    "fields_from_json",
]

# The "format" of a saved plan; Plan.load refuses others.
FORMAT = "autoremat.plan/1"

# The largest plan file read: a plan of a model of 150,000 modules is about 5 MiB; loading
# one at this limit takes at most ~15 times as much memory and a few seconds.
MAX_PLAN_BYTES = 8 * 2**20
# The deepest nesting of JSON arrays and objects read (a plan nests 3 deep).
MAX_JSON_DEPTH = 16
# A plan has at most one JSON array or object per this many characters (a choice or a
# selective entry is also named in 'modules' and 'structure'); json.loads allocates ~64 bytes
# for each, so more in a file is refused before parsing it.
MIN_CONTAINER_CHARS = 16
# Counts (bytes, FLOPs, segments) are below 2**63.
MAX_COUNT = 2**63 - 1
# The longest reason a plan's 'left_out' gives for a module (autoremat writes about 150
# characters, plus the paths it names).
MAX_REASON_CHARS = 4096
_FIX = "re-make the plan with autoremat.plan(model, ...) and save it with Plan.save"
_KIND_NAMES = {str: "a string", int: "an integer", list: "a list", dict: "an object"}
# For the scan before parsing: every byte but brackets and quotes deleted, "{}" made "[]";
# then strings (without their escapes) dropped, a chunk at a time.
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b'[]{}"')
_CHUNK = 2**16
_HEX16 = re.compile(r"[0-9a-f]{16}")
_COUNTS = ("segments", "budget", "estimated_peak", "baseline_peak", "recompute_flops")


def _shown(value: Any) -> str:
    """``repr(value)``, cut short (a field may hold megabytes)."""
    try:
        return reprlib.repr(value)
    except ValueError:  # an int past Python's limit on digits
        return f"a {type(value).__name__}"


def fields_from_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The plan in the file at ``path`` (see :meth:`autoremat.Plan.load`); at most
    :data:`MAX_PLAN_BYTES` bytes are read.

    Raises:
        ValueError: the file is not UTF-8, or fails a check of the module docstring (the
            message names the field).
        OSError: the file cannot be read.
    """
    where = repr(os.fspath(path))
    raw = bytearray()
    with open(path, "rb") as f:  # in chunks: read(n) would allocate n bytes at once
        while len(raw) <= MAX_PLAN_BYTES:
            chunk = f.read(min(2**16, MAX_PLAN_BYTES + 1 - len(raw)))
            if not chunk:
                break
            raw += chunk
    if len(raw) > MAX_PLAN_BYTES:
        raise ValueError(
            f"{where} is not a saved plan: it is larger than {MAX_PLAN_BYTES} bytes, the most "
            f"autoremat reads; {_FIX}"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not a saved plan: not UTF-8 text ({e.reason})") from None
    del raw
    return fields_from_json(text, where)


def fields_from_json(text: str, where: str = "the text") -> dict[str, Any]:
    """The plan in ``text`` (what :meth:`autoremat.Plan.save` wrote).

    Raises:
        ValueError: ``text`` fails a check of the module docstring (the text's own first, then
            :func:`fields_from_dict`'s).
    """
    why = _shape_refusal(text)
    if why is not None:
        raise ValueError(f"{where} is not a saved plan: {why}")
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        why = f"not JSON ({_shown(str(e))})"
        raise ValueError(f"{where} is not a saved plan: {why}") from None
    return fields_from_dict(data, where)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _shape_refusal(text: str) -> str | None:
    """Why ``text`` is no plan, seen before parsing it, or ``None``: its length (at most
    :data:`MAX_PLAN_BYTES` characters), its nesting, or its count of arrays and objects (at most
    one per :data:`MIN_CONTAINER_CHARS` characters), or brackets that do not match. All but
    brackets is dropped, then the innermost pairs, :data:`MAX_JSON_DEPTH` times: linear, never
    recursive. Text that is not JSON may pass (``json.loads`` refuses it next), but no JSON
    nested too deep does."""
    if len(text) > MAX_PLAN_BYTES:
        return f"longer than {MAX_PLAN_BYTES} characters, the most autoremat reads"
    brackets = _outside_brackets(text)
    containers = brackets.count(b"[")
    for _ in range(MAX_JSON_DEPTH):
        brackets = brackets.replace(b"[]", b"")
    if brackets:
        return f"not JSON, or nested deeper than {MAX_JSON_DEPTH} levels"
    if containers > len(text) // MIN_CONTAINER_CHARS + MAX_JSON_DEPTH:
        return (
            f"{containers} JSON arrays and objects in {len(text)} characters, more than a "
            f"plan has (one per {MIN_CONTAINER_CHARS} characters)"
        )
    return None


def _outside_brackets(text: str) -> bytes:
    """The brackets of ``text`` outside its strings, ``{`` and ``}`` as ``[`` and ``]``.

    Non-ASCII characters are never JSON syntax, and escapes hide no quote once the escaped
    backslashes and quotes are gone; then all but brackets and quotes are deleted, and the
    strings dropped a chunk at a time (so no object is made per string): a few C passes, at
    most twice ``text``'s length in memory."""
    reduced = text.encode("ascii", "ignore").replace(b"\\\\", b"").replace(b'\\"', b"")
    reduced = reduced.translate(_BRACKETS, _NOT_BRACKETS)
    outside = bytearray()
    in_string = 0
    for start in range(0, len(reduced), _CHUNK):
        parts = reduced[start : start + _CHUNK].split(b'"')
        outside += b"".join(parts[in_string::2])
        in_string ^= (len(parts) - 1) % 2
    return bytes(outside)


def fields_from_dict(data: Any, where: str = "the data") -> dict[str, Any]:
    """Validate ``data`` field by field and build the :class:`~autoremat.planning.plans.Plan` (see
    :meth:`~autoremat.planning.plans.Plan.load` and the module docstring for what is checked).

    Raises:
        ValueError: a field is missing or wrong (the message names it), the fingerprint is
            missing or is not that of the plan's structure, an entry is not in the structure
            or is inside another, or an op name is malformed or of a namespace torch lacks.
    """

    def bad(why: str) -> ValueError:
        return ValueError(f"{where} is not a saved autoremat plan: {why}")

    if not isinstance(data, dict):
        raise bad(f"expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise bad(f"field 'format' is {_shown(data.get('format'))}, expected {FORMAT!r}")
    fields = _Fields(data, bad)
    strategy = fields.get("strategy", str)
    if strategy not in ("levels", "budget"):
        raise bad(f"field 'strategy' is {_shown(strategy)}, expected 'levels' or 'budget'")
    model_class = fields.get("model_class", str)
    if not model_class.isidentifier():
        raise bad(f"field 'model_class' is {_shown(model_class)}, expected a class name")
    lines = _structure(fields)
    paths = {line.rpartition(" ")[0] for line in lines}
    modules = _modules(fields, paths)
    selective = _selective(fields, modules)
    objective = data.get("objective")
    if objective is not None and objective not in OBJECTIVES:
        raise bad(f"field 'objective' is {_shown(objective)}, expected one of {OBJECTIVES} or null")
    return {
        "modules": modules,
        "strategy": strategy,
        "model_class": model_class,
        **{key: fields.count(key) for key in _COUNTS},
        "objective": objective,
        "recompute_seconds": fields.seconds("recompute_seconds"),
        "choices": _choices(fields, modules, selective),
        "selective": selective,
        "left_out": _left_out(fields, paths),
        "calls": _calls(fields, paths, modules),
        "fingerprint": data["fingerprint"],
        "structure": lines,
        "parameter_bytes": fields.count("parameter_bytes") if "parameter_bytes" in data else None,
    }


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
            kinds = kind if isinstance(kind, tuple) else (kind,)
            expected = " or ".join(_KIND_NAMES[k] for k in kinds)
            raise self.bad(f"field {key!r} is {_shown(value)}, expected {expected}")
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        value = self.get(key, list)
        if not all(isinstance(x, str) for x in value):
            raise self.bad(f"field {key!r} must be a list of strings")
        return tuple(value)

    def count(self, key: str) -> int | None:
        value = self.get(key, int, optional=True)
        if value is not None and not _is_count(value):
            raise self.bad(f"field {key!r} is {_shown(value)}, expected a count in [0, 2**63)")
        return value

    def seconds(self, key: str) -> float | None:
        value = self.data.get(key)
        if value is not None and not _is_seconds(value):
            raise self.bad(f"field {key!r} is {_shown(value)}, expected a finite number >= 0")
        return value


def _is_seconds(value: Any) -> bool:
    finite = isinstance(value, float) and math.isfinite(value)
    return _is_count(value) or (finite and 0 <= value <= MAX_COUNT)


def _is_count(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= MAX_COUNT


def _structure(fields: _Fields) -> tuple[str, ...]:
    """The plan's ``structure`` (``"path Class"`` lines, the root first, each path once),
    checked against its ``fingerprint``, which must be there."""
    if fields.data.get("fingerprint") is None:
        state = "null" if "fingerprint" in fields.data else "missing"
        raise fields.bad(
            f"field 'fingerprint' is {state}: a plan without one would be applied to any "
            f"model, of any structure, so it is refused; {_FIX}"
        )
    fingerprint = fields.get("fingerprint", str)
    if not _HEX16.fullmatch(fingerprint):
        raise fields.bad(f"field 'fingerprint' is {_shown(fingerprint)}, expected 16 hex digits")
    lines = fields.strings("structure")
    paths = [line.rpartition(" ")[0] for line in lines]
    odd = [line for line in lines if " " not in line or line.endswith(" ")]
    if odd or not paths or paths[0] != "" or len(set(paths)) != len(paths):
        shown = _shown(odd[0] if odd else lines[:1])
        raise fields.bad(
            f"field 'structure' must list 'path Class' once per module, the root (' Class') "
            f"first; {shown} is not so"
        )
    try:
        found = structure_fingerprint(lines)
    except UnicodeEncodeError:
        raise fields.bad("field 'structure' holds a string that is not valid Unicode") from None
    if found != fingerprint:
        raise fields.bad(
            f"field 'fingerprint' is {fingerprint}, but the plan's 'structure' hashes to "
            f"{found}: the file was changed after it was saved; {_FIX}"
        )
    return lines


def _modules(fields: _Fields, paths: set[str]) -> tuple[str, ...]:
    """The plan's entries, each a module of ``paths`` or a run within its children, and none
    inside another; runs are checked arithmetically, never expanded."""
    modules = fields.strings("modules")
    children = Counter(path.rpartition(".")[0] for path in paths if path)
    for entry in modules:
        if not ENTRY.fullmatch(entry):
            raise fields.bad(
                f"module entry {_shown(entry)} is not a module path, path@k or path[i:j]"
            )
        run = parse_run(entry)
        if run is None and module_of(entry) not in paths:
            raise fields.bad(
                f"module entry {_shown(entry)} is not a module of the plan's 'structure'"
            )
        if run is not None and not (run[0] in paths and run[1] < run[2] <= children[run[0]]):
            raise fields.bad(
                f"module entry {_shown(entry)} is not a run of children of a module of the plan's "
                f"'structure' (path[i:j] with i < j <= its number of children)"
            )
    nested = first_nested(modules)
    if nested is not None:
        raise fields.bad(
            f"field 'modules': entry {_shown(nested[0] or '(root)')} is inside "
            f"{_shown(nested[1] or '(root)')}, recomputes would nest; {_FIX}"
        )
    return modules


def _selective(fields: _Fields, modules: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Each selective entry (a module path among ``modules``) with its ops, checked without
    looking them up in ``torch.ops``."""
    raw = fields.get("selective", (dict, list))
    if isinstance(raw, list):  # the first form: a list of paths, all keeping 'save_ops'
        ops = fields.data.get("save_ops", list(DEFAULT_SAVE_OPS))
        if not isinstance(ops, list):
            raise fields.bad(f"field 'save_ops' is {_shown(ops)}, expected a list of op names")
        raw = dict.fromkeys(fields.strings("selective"), ops)
    selective: dict[str, tuple[str, ...]] = {}
    checked: dict[int, tuple[str, ...]] = {}
    for entry, ops in raw.items():
        if not isinstance(ops, list):
            raise fields.bad(
                f"field 'selective' maps {_shown(entry)} to {_shown(ops)}, expected a list of "
                f"op names"
            )
        try:
            if id(ops) not in checked:  # the first form shares one list
                checked[id(ops)] = check_names(ops, strict=True)
        except ValueError as e:
            raise fields.bad(f"field 'selective', entry {_shown(entry)}: {e}") from None
        selective[entry] = checked[id(ops)]
    known = set(modules)
    odd = [e for e in selective if e not in known or parse_run(e)]
    if odd:
        raise fields.bad(
            f"field 'selective': entries {_shown(odd[:5])} are not module paths or calls among "
            f"'modules'"
        )
    return selective


def _calls(fields: _Fields, paths: set[str], modules: tuple[str, ...]) -> dict[str, int]:
    """The plan's ``calls``, checked as the module docstring says; empty when the field is
    missing (plans saved before it existed)."""
    raw = fields.get("calls", dict) if "calls" in fields.data else {}
    for path, count in raw.items():
        if path not in paths or not _is_count(count) or count < 1:
            raise fields.bad(
                f"field 'calls' maps {_shown(path)} to {_shown(count)}, expected a module of the "
                f"plan's 'structure' and a count >= 1"
            )
    for entry in modules:
        call = parse_call(entry)
        if call is not None and call[0] not in raw:
            raise fields.bad(
                f"module entry {_shown(entry)} names a call of {_shown(call[0])}, but field "
                f"'calls' does not say how many calls it made (add \"{call[0]}\": N)"
            )
        if call is not None and call[1] >= raw[call[0]]:
            raise fields.bad(
                f"module entry {_shown(entry)} names call {call[1]}, but field 'calls' says "
                f"{_shown(call[0])} ran {raw[call[0]]} times"
            )
    return dict(raw)


def _left_out(fields: _Fields, paths: set[str]) -> dict[str, str]:
    """The plan's ``left_out``, checked as the module docstring says (empty when missing)."""
    raw = fields.get("left_out", dict) if "left_out" in fields.data else {}
    for path, why in raw.items():
        if path not in paths:
            raise fields.bad(
                f"field 'left_out': {_shown(path)} is not a module of the plan's 'structure'"
            )
        if not isinstance(why, str) or len(why) > MAX_REASON_CHARS:
            raise fields.bad(
                f"field 'left_out' maps {_shown(path)} to {_shown(why)}, expected a reason (a "
                f"string of at most {MAX_REASON_CHARS} characters)"
            )
    return dict(raw)


def _choices(
    fields: _Fields, modules: tuple[str, ...], selective: dict[str, tuple[str, ...]]
) -> tuple[Choice, ...]:
    """The budget strategy's choices, each an entry among ``modules``, a selective one also
    in ``selective``."""
    ways = (FULL, *WAYS)
    known = set(modules)
    choices = []
    for c in fields.get("choices", list):
        way = c.get("way", c.get("mode", FULL)) if isinstance(c, dict) else None
        if not (
            isinstance(c, dict)
            and isinstance(c.get("path"), str)
            and _is_count(c.get("freed"))
            and _is_count(c.get("flops"))
            and isinstance(way, str)
            and way in ways
        ):
            raise fields.bad(
                f"field 'choices': {_shown(c)} must be an object with path (str), freed and "
                f"flops (counts in [0, 2**63)), way ({', '.join(map(repr, ways))})"
            )
        seconds = c.get("seconds")
        if seconds is not None and not _is_seconds(seconds):
            raise fields.bad(f"field 'choices': {_shown(c)}: seconds must be >= 0 or null")
        if c["path"] not in known or (way != FULL and c["path"] not in selective):
            where = "'modules'" if c["path"] not in known else "'selective'"
            raise fields.bad(f"field 'choices': {_shown(c['path'])} is not among {where}")
        choices.append(Choice(c["path"], c["freed"], c["flops"], way, seconds))
    return tuple(choices)

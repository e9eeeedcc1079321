"""A :class:`Plan`: which modules to recompute, how they were chosen, and its JSON form.

A plan is data: entries (:mod:`autoremat.core.entries`), the selective way of each selective
entry, the figures its strategy predicted, and the module structure of the model it was made
for (:func:`structure`, hashed into :func:`fingerprint`), so that applying it to another model
is refused. :meth:`Plan.save` and :meth:`Plan.load` write and read it as JSON
(:mod:`autoremat.planning.plan_json` validates what is read).
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from autoremat.core.entries import covered, module_of, parse_call, parse_run, run_entry
from autoremat.core.nested import parameter_bytes
from autoremat.core.selective import FULL, WAYS, ops_on
from autoremat.core.sizes import format_size
from autoremat.core.words import first_few
from autoremat.planning.choice import Choice
from autoremat.planning.fingerprint import fingerprint, structure
from autoremat.planning.plan_json import (
    FORMAT,
    fields_from_dict,
    fields_from_file,
    fields_from_json,
)
from autoremat.record.tree import Node
from autoremat.wrap.wrapping import apply as wrap_apply

__all__ = ["Plan"]

logger = logging.getLogger(__name__)
# The fields to_dict writes as they are, in its order.
_FIGURES = ("segments", "budget", "estimated_peak", "baseline_peak", "recompute_flops",
            "objective", "recompute_seconds")  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """Which modules of a model to recompute in backward, and how they were chosen.

    ``modules`` are entries (qualified names as in ``named_modules()``, ``""`` the model itself;
    calls ``path@k``; runs ``path[i:j]``), never one inside another; ``selective`` maps those
    recomputed selectively to the ops whose outputs they keep (:mod:`autoremat.core.selective`),
    ``calls`` each module named by call entries to the calls it was planned for (a step with
    another number warns). A budget plan predicts the step's peak with it (``estimated_peak``,
    found as ``estimated_by`` says) and without, and the FLOPs and seconds its recomputes add,
    minimising ``objective``; ``compiled_peak`` is measured under ``torch.compile``.
    ``left_out``: the modules left out, with reasons. ``warnings``, ``device`` and
    ``estimated_by`` are not saved. :meth:`apply` warns on a model whose parameters hold other
    bytes than ``parameter_bytes``. docs/guide.md lists every field; ``print(plan)`` shows the
    choice, what was left out and the tree with the chosen modules marked ``*``.
    """

    modules: tuple[str, ...]
    strategy: str
    model_class: str
    segments: int | None = None
    budget: int | None = None
    estimated_peak: int | None = None
    baseline_peak: int | None = None
    recompute_flops: int | None = None
    objective: str | None = None
    recompute_seconds: float | None = None
    compiled_peak: int | None = None
    choices: tuple[Choice, ...] = ()
    selective: dict[str, tuple[str, ...]] = field(default_factory=dict, hash=False)
    left_out: dict[str, str] = field(default_factory=dict, hash=False)
    calls: dict[str, int] = field(default_factory=dict, hash=False)
    warnings: dict[str, str] = field(default_factory=dict, hash=False, compare=False, repr=False)
    device: str | None = field(default=None, compare=False, repr=False)
    estimated_by: str | None = field(default=None, compare=False, repr=False)
    fingerprint: str | None = None
    structure: tuple[str, ...] = field(default=(), repr=False)
    parameter_bytes: int | None = field(default=None, repr=False)
    tree: Node | None = field(default=None, repr=False, compare=False)

    def apply(self, model: nn.Module) -> nn.Module:
        """Wrap the plan's modules of ``model`` in place (claim 4) and return ``model``.

        Raises:
            ValueError: ``model``'s module structure is not the one the plan was made for
                (the message names the modules that no longer exist), or see
                :func:`autoremat.wrap.apply`. The model is unchanged when it raises.
        """
        self.check(model)
        made_for = self.parameter_bytes
        if made_for is not None and (found := parameter_bytes(model)) != made_for:
            logger.warning(
                "this plan was made for a %s whose parameters hold %s; this one's hold %s (built "
                "wider or narrower, or cast): its entries apply, but its budget and predicted "
                "figures were that model's. Make a plan from this model to know its memory",
                self.model_class, format_size(made_for), format_size(found),
            )  # fmt: skip
        return wrap_apply(model, self.modules, selective=self.selective, calls=self.calls)

    def check(self, model: nn.Module) -> None:
        """Raise ``ValueError`` unless ``model`` has the module structure the plan was made
        for (same :func:`fingerprint`); the message names the modules gone and new."""
        if self.fingerprint is None or fingerprint(model) == self.fingerprint:
            return
        detail, other = self._differences(structure(model)), type(model).__name__
        if other != self.model_class:
            inside = type(getattr(model, "module", None)).__name__ == self.model_class  # (DDP's)
            fix = (f"Apply it to the model inside ({other}.module), or before wrapping" if inside
                   else "Make a plan from this model (autoremat.plan(model, ...))")  # fmt: skip
            raise ValueError(f"this plan was made for a {self.model_class}, not a {other}: "
                             f"{'; '.join(detail[:1])}. {fix}")  # fmt: skip
        raise ValueError(
            f"this plan was made for a {self.model_class} with another module structure "
            f"(fingerprint {self.fingerprint}, the model's is {fingerprint(model)}): "
            f"{'; '.join(detail) or 'the structure differs'}. Make a new plan from this model "
            f"(autoremat.plan(model, ...))"
        )

    def _differences(self, now: tuple[str, ...]) -> list[str]:
        missing, count = _missing(self.modules, [line.rpartition(" ")[0] for line in now])
        gone = sorted(set(self.structure) - set(now))
        new = sorted(set(now) - set(self.structure))

        def names(lines: list[str], total: int | None = None) -> str:
            shown = [repr(x if x[:1] != " " else "(root)" + x) for x in lines[:5]]
            return first_few(shown, 5, len(lines) if total is None else total)

        parts = [
            ("the plan's modules {} no longer exist", missing, count),
            ("modules no longer there: {}", gone, None),
            ("new modules: {}", new, None),
        ]
        return [text.format(names(lines, total)) for text, lines, total in parts if lines]

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON data (what :meth:`save` writes; no tree)."""
        return {
            "format": FORMAT,
            "model_class": self.model_class,
            "fingerprint": self.fingerprint,
            "strategy": self.strategy,
            "modules": list(self.modules),
            **{name: getattr(self, name) for name in _FIGURES},
            "choices": [asdict(c) for c in self.choices],
            "selective": {path: list(ops) for path, ops in self.selective.items()},
            "left_out": dict(self.left_out),
            "calls": dict(self.calls),
            "structure": list(self.structure),
            "parameter_bytes": self.parameter_bytes,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """The plan :meth:`to_dict` gave, validated as :meth:`load` validates a file.

        Raises:
            ValueError: as :meth:`load`.
        """
        return cls(**fields_from_dict(data))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan in ``text`` (what :meth:`save` wrote), validated as :meth:`load` validates.

        Raises:
            ValueError: as :meth:`load`.
        """
        return cls(**fields_from_json(text))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan to ``path`` as indented JSON (see :meth:`to_dict`)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan :meth:`save` wrote. :meth:`apply` then refuses a model whose module
        structure changed since the plan was made. At most 8 MiB (``MAX_PLAN_BYTES``) is read,
        checked in linear time and memory; nothing is looked up or created in ``torch.ops``
        (:mod:`autoremat.planning.plan_json` lists the checks).

        Raises:
            ValueError: the file is too large, not JSON, nested too deep, or not a plan of
                this format: a field missing or wrong (the message names it), no fingerprint,
                or one that is not the hash of the plan's structure.
            OSError: the file cannot be read.
        """
        return cls(**fields_from_file(path))

    def table(self) -> str:
        """The chosen entries with what each frees and adds, and the predicted peak."""
        if self.strategy != "budget":
            return "\n".join(f"  {p or '(root)'}" for p in self.modules)
        if not self.modules:
            return self._figures()
        grouped = _grouped(self.choices, self.calls)
        width = max([len(c.path or "(root)") for c in grouped] + [6])
        rows = [
            f"  {'module':{width}}  {'how':13}  {'frees':>10}  {'adds GFLOP':>10}  {'adds ms':>8}"
        ]
        rows += [
            f"  {c.path or '(root)':{width}}  {c.way:13}  {format_size(c.freed):>10}  "
            f"{c.flops / 1e9:>10.3f}  " + ("" if c.seconds is None else f"{c.seconds * 1e3:>8.1f}")
            for c in grouped
        ]
        rows.append(self._figures())
        for way in dict.fromkeys(c.way for c in self.choices if c.way != FULL):
            ops = next((self.selective[c.path] for c in self.choices if c.way == way), WAYS[way])
            shown = ops_on(ops, self.device)
            others = len(ops) - len(shown)
            rows.append(
                f"{way} keeps the outputs of: {', '.join(shown)}"
                + (f" (and {others} kernels of other devices)" if others else "")
            )
        for path, i, j in [r for c in self.choices if (r := parse_run(c.path))][:1]:  # (the first)
            rows.append(f"{run_entry(path, i, j)}: children {i} to {j - 1} of the nn.Sequential "
                        f"{path or '(root)'}, recomputed as one (path[i:j] as in slicing)")
        return "\n".join(rows)

    def _figures(self) -> str:
        """The predicted peak against the budget and the baseline, and what recompute adds;
        ``?`` for a figure the plan does not have."""

        def size(x: int | None) -> str:
            return "?" if x is None else format_size(x)

        share = (
            f", {self.estimated_peak / self.baseline_peak:.0%}"
            if self.estimated_peak is not None and self.baseline_peak
            else ""
        )
        flops = "?" if self.recompute_flops is None else f"{self.recompute_flops / 1e9:.3f}"
        by = f", from running the planned step {self.estimated_by}" if self.estimated_by else ""
        line = (
            f"predicted peak {size(self.estimated_peak)} (budget {size(self.budget)}, "
            f"no recompute {size(self.baseline_peak)}{share}{by}), recompute adds {flops} GFLOP"
        )
        if self.recompute_seconds is not None:
            line += f" and {self.recompute_seconds * 1e3:.1f} ms (as profiled)"
        return line + ("" if self.objective is None else f"; minimised {self.objective}")

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.tree is not None:
            marked = frozenset(p for e in self.modules for p in covered(e))
            lines += ["", self.tree.render(marked=marked)]
        return "\n".join(lines)

    def summary(self) -> str:
        """The header and :meth:`table`, without the tree."""
        how = {
            "levels": f"levels, segments={self.segments}: the first level with more than "
            f"{self.segments} split point{'s' * (self.segments != 1)}",
            "budget": f"budget {format_size(self.budget)}" if self.budget else "budget",
        }.get(self.strategy, self.strategy)
        count = len(self.modules)
        plain = all(module_of(e) == e for e in self.modules)
        noun = ("module", "modules") if plain else ("entry", "entries")
        head = f"Plan for {self.model_class} ({how}): recompute {count} {noun[count != 1]}"
        if not self.modules and self.strategy == "budget":
            head += " (no recompute needed)"
        lines = [head, self.table()] if self.modules or self.strategy == "budget" else [head]
        if self.left_out:
            count = len(self.left_out)
            lines.append(f"left out ({count} module{'s' * (count != 1)}):")
            lines += [f"  {p or '(root)'}: {why}" for p, why in list(self.left_out.items())[:10]]
            lines += [f"  ... and {count - 10} more"] if count > 10 else []
        return "\n".join(lines)


def _grouped(choices: Sequence[Choice], calls: dict[str, int]) -> list[Choice]:
    """The choices as :meth:`Plan.table` shows them: consecutive calls of one module chosen
    the same way as one row ``path@i..j`` (``(n of N calls)``), their figures summed."""

    def key(numbered: tuple[int, Choice]) -> tuple[Any, ...]:
        # (calls k, k+1, ... at places n, n+1, ... share k - n; any other choice is alone)
        n, c = numbered
        call = parse_call(c.path)
        return (c.path, n) if call is None else (call[0], c.way, call[1] - n)

    rows: list[Choice] = []
    for _, numbered in itertools.groupby(enumerate(choices), key):
        group = [c for _, c in numbered]
        call = parse_call(group[0].path)
        if len(group) == 1 or call is None:
            rows += group
            continue
        (path, first), count = call, len(group)
        label = f"{path}@{first}..{first + count - 1} ({count} of {calls.get(path, '?')} calls)"
        seconds = [c.seconds for c in group]
        total = None if None in seconds else sum(s or 0.0 for s in seconds)
        freed, flops = sum(c.freed for c in group), sum(c.flops for c in group)
        rows.append(Choice(label, freed, flops, group[0].way, total))
    return rows


def _missing(entries: Sequence[str], paths: Sequence[str]) -> tuple[list[str], int]:
    """The first (sorted) few of the module paths ``entries`` cover (:func:`covered`) that are
    not among ``paths``, and how many there are in all. Runs are not expanded: the children
    they cover that are present are counted by index, and at most 5 missing ones are named."""
    have = set(paths)
    indices: dict[str, list[int]] = {}
    for path in paths:
        parent, _, name = path.rpartition(".")
        if name.isascii() and name.isdigit() and len(name) < 19 and str(int(name)) == name:
            indices.setdefault(parent, []).append(int(name))
    for found in indices.values():
        found.sort()
    shown: list[str] = []
    count = 0
    # each entry once, a call entry as its module's path
    for entry in dict.fromkeys(e if (c := parse_call(e)) is None else c[0] for e in entries):
        run = parse_run(entry)
        if run is None:
            if entry not in have:
                shown.append(entry)
                count += 1
            continue
        parent, i, j = run
        present = indices.get(parent, [])
        lo, hi = bisect.bisect_left(present, i), bisect.bisect_left(present, j)
        count += max(j - i, 0) - (hi - lo)
        inside = set(present[lo:hi])
        absent = (k for k in range(i, j) if k not in inside)
        shown += [covered(run_entry(parent, k, k + 1))[0] for k in itertools.islice(absent, 5)]
    return sorted(shown)[:5], count

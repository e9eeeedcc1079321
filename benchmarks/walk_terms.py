"""What a term of the walk earns: the plans of two checkouts side by side.

For every built-in example and five zoo models (ResNet-18, Llama, UNet, T5, Swin), fp32 and
CPU bf16 autocast: the profile's peak, the lowest budget, and the plans at 75% and 50% of the
peak (``objective="flops"``, so nothing depends on timing): each plan's run peak, its
recompute FLOPs and entries, and how many plan steps were run. ``--out FILE`` writes them as
JSON; ``--against FILE`` prints where this checkout's differ from a file written by another
(``PYTHONPATH=<other checkout>/src`` runs that one). A term whose removal changes no lowest
budget and no plan's cost here can go (docs/cost-model.md, "The walk").

    cd benchmarks && ../.venv-zoo/bin/python walk_terms.py --out /tmp/head.json
    PYTHONPATH=/tmp/other/src ../.venv-zoo/bin/python walk_terms.py --against /tmp/head.json
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

import torch

import autoremat
import library_zoo  # (first: transformers imports torchvision, which needs the zoo's shim)
from autoremat.examples import EXAMPLES
from autoremat.planning import rehearsal
from autoremat.planning.plan import plan_from_profile, profile_lowest

ZOO = ("tv_resnet18", "hf_llama", "df_unet", "hf_t5", "timm_swin")
FRACTIONS = (0.75, 0.5)


def plans_of(name: str, dtype: torch.dtype | None) -> dict[str, Any]:
    """The peak, the lowest budget and the plans at :data:`FRACTIONS` of one model."""
    model, args, kwargs = library_zoo.ZOO[name].build() if name in ZOO else EXAMPLES[name]()
    runs = [0]
    run = rehearsal.Rehearsal._run

    def counted(self: Any, *a: Any) -> Any:
        runs[0] += 1
        return run(self, *a)

    rehearsal.Rehearsal._run = counted  # type: ignore[method-assign,assignment]
    try:
        prof = autoremat.profile(model, args, kwargs, autocast=dtype)
        row: dict[str, Any] = {"peak": prof.peak, "lowest": profile_lowest(prof, objective="flops")}
        for fraction in FRACTIONS:
            budget = max(int(prof.peak * fraction), row["lowest"])
            p = plan_from_profile(model, prof, budget, objective="flops")
            row[str(fraction)] = [p.estimated_peak, p.recompute_flops, len(p.modules)]
    finally:
        rehearsal.Rehearsal._run = run  # type: ignore[method-assign]
    row["runs"] = runs[0]
    return row


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """One line per model whose lowest budget or plans differ (runs alone: said too)."""
    lines = []
    for key, row in mine.items():
        other = theirs.get(key, {})
        changed = [k for k in row if k != "runs" and row[k] != other.get(k)]
        for k in changed:
            lines.append(f"{key}: {k} {other.get(k)} -> {row[k]}")
        if not changed and row.get("runs") != other.get("runs"):
            lines.append(f"{key}: the same plans, {other.get('runs')} -> {row['runs']} runs")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the plans here (JSON)")
    parser.add_argument("--against", help="a file --out wrote: print where these differ")
    options = parser.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    found: dict[str, Any] = {}
    for name in [*EXAMPLES, *ZOO]:
        for dtype in (None, torch.bfloat16):
            key = f"{name} {'bf16' if dtype else 'fp32'}"
            found[key] = plans_of(name, dtype)
            print(key, found[key], flush=True)
    if options.out:
        with open(options.out, "w") as f:
            json.dump(found, f, indent=1)
    if options.against:
        with open(options.against) as f:
            lines = differences(found, json.load(f))
        print("\n".join(lines) or "the same plans everywhere")


if __name__ == "__main__":
    main()

"""Selective recompute at a 50% budget as the models get deeper (issue 6's FLOPs target).

    python benchmarks/depth.py                      # ~8 min on 2 shared CPU cores
    python benchmarks/depth.py --models vit --layers 4,8

The zoo's GPT-2-like (``gpt2``, ``gpt-torch``), Llama-like (``llama``) and ViT-like (``vit``)
models have 4 layers. Here each is rebuilt with ``--layers`` layers (default 4, 8 and 12; width,
heads, batch and sequence as in the zoo) and planned at a 50% budget three ways, side by side
in one :func:`autoremat.comparison.compare` per model and depth:

* ``budget 50% (module)``: module-level recompute only, minimising FLOPs;
* ``budget 50% (flops)``: selective recompute allowed, minimising FLOPs;
* ``budget 50%``: the default, selective allowed, minimising the profiled recompute time.

Figures: FLOPs of the step over no recompute (``FlopCounterMode``, recompute included; the
target is at most 1.05x), measured peak over the no-recompute peak, the planner's estimate
error, step time over no recompute (median of ``--repeats`` interleaved steps), the predicted
time ratio (``1 + plan.recompute_seconds`` over the measured no-recompute step) and whether one
step's loss and gradients equal the unwrapped model's. Writes ``depth.md`` and ``depth.csv``
to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run
from autoremat.comparison import Contender, budget_plan, compare, no_recompute
from autoremat.examples import TinyGPT, seeded
from report import dicts_to_csv
from zoo import SEQ, VOCAB, ZOO

MODELS = ("gpt2", "gpt-torch", "llama", "vit")
TARGET_FLOPS = 1.05
PLANS = (  # (selective, objective, row name)
    (False, "flops", "budget 50% (module)"),
    (True, "flops", "budget 50% (flops)"),
    (True, "time", "budget 50%"),
)


def deeper(name: str, layers: int) -> Any:
    """The zoo model ``name`` with ``layers`` layers (seeded weights, the zoo's inputs)."""
    model, args, kwargs = ZOO[name]()
    if name == "gpt-torch":

        @seeded
        def build() -> Any:
            model = TinyGPT(vocab=VOCAB, width=256, layers=layers, heads=4, context=SEQ)
            return model, args, kwargs

        return build()
    config = model.config
    config.__setattr__("n_layer" if name == "gpt2" else "num_hidden_layers", layers)

    @seeded
    def rebuild() -> Any:
        return type(model)(config), args, kwargs

    return rebuild()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layers", default="4,8,12")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per strategy")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name in ns.models.split(","):
        for layers in (int(x) for x in ns.layers.split(",")):
            model, args, kwargs = deeper(name, layers)
            strategies = [no_recompute()]
            for selective, objective, label in PLANS:
                # named as in the tables ("budget 50% (module)", not "... (module) (flops)")
                inner = budget_plan(0.5, selective=selective, objective=objective)
                strategies.append(Contender(label, inner.apply))
            print(f"{name} x{layers}", file=sys.stderr, flush=True)
            measured = compare(model, args, kwargs, strategies, repeats=ns.repeats, name=name)
            base = measured[0]
            for r in measured[1:]:
                p = r.plan  # the plan applied (None when the strategy failed)
                rows.append(
                    {
                        "model": name,
                        "layers": layers,
                        "strategy": r.strategy,
                        "flops_x": r.flops_ratio,
                        "peak_x": r.peak_ratio,
                        "within": None if p is None or r.peak is None else r.peak <= p.budget,
                        "estimate_error": None
                        if p is None or not r.peak
                        else (p.estimated_peak - r.peak) / r.peak,
                        "time_x": r.time_ratio,
                        "predicted_time_x": None
                        if p is None or not base.seconds
                        else 1 + p.recompute_seconds / base.seconds,
                        "selective": None if p is None else f"{len(p.selective)}/{len(p.modules)}",
                        "grads": "ok" if r.grads_match else "DIFFER",
                    }
                )
    out = Path(ns.out)
    dicts_to_csv(rows, out / "depth.csv")

    def fmt(x: Any, spec: str) -> str:
        return "n/a" if x is None else format(x, spec)

    lines = [
        "# Selective recompute at a 50% budget, by depth",
        "",
        run.machine_line(time.perf_counter() - start, ns.repeats, detail=f"layers {ns.layers}"),
        "",
        "Ratios are to no recompute of the same model and depth. `FLOPs x`: the step's FLOPs, "
        f"recompute included (target <= {TARGET_FLOPS}x). `selective`: entries recomputed "
        "selectively / all entries. `predicted time x`: 1 + the plan's profiled recompute "
        "seconds over the measured no-recompute step.",
        "",
        "| model | layers | strategy | FLOPs x | target | peak x | within | est. error | "
        "time x | predicted time x | selective | grads |",
        "|---|---:|---|---:|---|---:|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        target = "met" if r["flops_x"] is not None and r["flops_x"] <= TARGET_FLOPS else "missed"
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['strategy']} | {fmt(r['flops_x'], '.3f')} | "
            f"{target} | {fmt(r['peak_x'], '.2f')} | "
            f"{'n/a' if r['within'] is None else 'yes' if r['within'] else 'NO'} | "
            f"{fmt(r['estimate_error'], '+.1%')} | {fmt(r['time_x'], '.2f')} | "
            f"{fmt(r['predicted_time_x'], '.2f')} | {r['selective']} | {r['grads']} |"
        )
    (out / "depth.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

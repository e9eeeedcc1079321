"""How fast the budget planner is: the solver alone on 1000-node trees (the planning tree of
an 80-layer Llama-shaped model profiled on the meta device, and adversarial random trees whose
costs follow no pattern), and planning a Llama-2-7B-shaped model end to end.

    python benchmarks/solver_speed.py [--out benchmarks/results]

Writes ``solver.md``. Timings are medians of 3 runs on this machine.
"""

from __future__ import annotations

import argparse
import logging
import platform
import random
import statistics
import time
from pathlib import Path

import torch

import autoremat
from autoremat.examples import llama_on_meta
from autoremat.planning.planning_tree import planning_tree
from autoremat.planning.solver import Item, min_peak, solve


def random_tree(nodes: int, seed: int) -> tuple[Item, list[tuple[int, int]]]:
    """A random planning tree of ``nodes`` nodes shaped like a network: a root over a chain
    of blocks of random depth and width, with activation-like costs and a memory timeline
    that grows through the forward and shrinks through the backward."""
    rng = random.Random(seed)
    counter = [0]

    def build(path: str, budget: int, depth: int) -> Item:
        start = counter[0]
        children = []
        while budget > 1 and depth < 6:
            size = rng.randint(1, max(1, min(budget - 1, 40)))
            children.append(build(f"{path}.{len(children)}", size, depth + 1))
            budget -= size
        end = counter[0]
        counter[0] += 1
        freed = sum(c.freed for c in children) + rng.randint(0, 2**22)
        flops = sum(c.flops for c in children) + rng.randint(0, 2**30)
        return Item(path, start, end, freed, flops, True, tuple(children), rng.randint(0, 2**24))

    root = build("", nodes, 0)
    total = root.freed
    points = []
    n = counter[0]
    for p in range(n + 1):
        points.append((p, int(total * p / n) + rng.randint(0, 2**24)))
    return root, points


def median_seconds(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ns = parser.parse_args()
    logging.disable(logging.WARNING)
    lines = [
        "# Budget planner speed",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}. Medians of 3 runs.",
        "",
        "| case | nodes | budget | solve s | lowest peak search s |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    deep_model, deep_args, deep_kwargs = llama_on_meta(
        layers=80, width=1024, heads=16, ffn=2816, batch=4, sequence=2048
    )
    prof = autoremat.profile(deep_model, deep_args, deep_kwargs)
    # (the tree, the points after the forward, the points of the forward)
    cases = [
        (
            "Llama, 80 layers (meta profile)",
            planning_tree(prof),
            list(prof.backward_points),
            list(prof.forward_points),
        )
    ]
    cases += [(f"random tree, seed {seed}", *random_tree(1000, seed), []) for seed in range(2)]
    for label, root, points, forward in cases:
        nodes = len(root.walk())
        baseline = max(b for _, b in (*points, *forward))
        lowest = min_peak(root, points, forward)
        search_s = median_seconds(lambda r=root, p=points, f=forward: min_peak(r, p, f), repeats=1)
        for fraction in (0.75, 0.5):
            budget = max(lowest, int(baseline * fraction))
            solve_s = median_seconds(
                lambda b=budget, r=root, p=points, f=forward: solve(r, p, b, f)
            )
            lines.append(
                f"| {label} | {nodes} | {budget / baseline:.0%} of baseline | "
                f"{solve_s:.3f} | {search_s:.2f} |"
            )
    start = time.perf_counter()
    model, args, kwargs = llama_on_meta()
    built = time.perf_counter() - start
    start = time.perf_counter()
    plan = autoremat.plan(model, args, kwargs, budget=0.5)
    planned = time.perf_counter() - start
    lines += [
        "",
        f"Llama-2-7B shape (32 layers, width 4096, sequence 4096, batch 1) on the meta device: "
        f"built in {built:.1f} s, planned at a 50% budget end to end (profile + solve) in "
        f"{planned:.1f} s: {len(plan.modules)} modules, predicted peak "
        f"{plan.estimated_peak / 2**30:.1f} GiB of {plan.baseline_peak / 2**30:.1f} GiB, "
        f"recompute {plan.recompute_flops / 1e12:.1f} TFLOP.",
    ]
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "solver.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

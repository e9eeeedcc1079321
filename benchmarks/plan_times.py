"""How long planning takes: the zoo's plan time and the Llama-70B shape on meta.

For each model and precision: profile one step, find the lowest budget, plan a budget midway
and one at the lowest (what ``make zoo`` times as ``plan s``), best of ``--repeats`` runs; five
zoo models, or with ``--zoo`` all of them. Then the Llama-70B shape on ``meta`` (80 layers,
8192 wide, batch 8 x 4096): ``plan(75%)`` and ``lowest_budget``, end to end. With ``--fit``,
``fit`` on three built-in examples instead (``looped`` and ``gpt2`` at 96 MiB, ``mlp`` at 48
MiB: the batch found and seconds). Runs with whatever ``autoremat`` is importable, so the same
script times another checkout (``PYTHONPATH=<other>/src``) for a side-by-side table.

    cd benchmarks && ../.venv-zoo/bin/python plan_times.py [--repeats 2] [--no-70b] [--zoo] [--fit]
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

import autoremat
import library_zoo  # (first: transformers imports torchvision, which needs the zoo's shim)
from autoremat.examples import llama_on_meta
from autoremat.planning.plan import plan_from_profile, profile_lowest

MODELS = ("tv_resnet18", "hf_llama", "df_unet", "hf_t5", "timm_swin")


def _seconds(work: Callable[[], Any]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def zoo_plan_seconds(name: str, dtype: torch.dtype | None) -> float:
    """Profile, lowest budget and two plans (midway, lowest) of one zoo model, in seconds."""
    model, args, kwargs = library_zoo.ZOO[name].build()

    def work() -> None:
        prof = autoremat.profile(model, args, kwargs, autocast=dtype)
        lowest = profile_lowest(prof)
        mid = prof.peak // 2 if prof.peak // 2 >= lowest else (prof.peak + lowest) // 2
        for budget in (mid, lowest):
            plan_from_profile(model, prof, budget)

    return _seconds(work)


def llama_70b_seconds() -> tuple[float, float]:
    """``plan(75%)`` and ``lowest_budget`` of the Llama-70B shape on meta, in seconds."""
    model, args, kwargs = llama_on_meta(
        layers=80, width=8192, heads=64, ffn=28672, batch=8, sequence=4096
    )
    planned = _seconds(lambda: autoremat.plan(model, args, kwargs, budget=0.75))
    lowest = _seconds(lambda: autoremat.lowest_budget(model, args, kwargs))
    return planned, lowest


FITS = (("looped", "96MiB"), ("mlp", "48MiB"), ("gpt2", "96MiB"))


def fit_seconds() -> None:
    """``fit`` on the examples of :data:`FITS`: the batch found, the largest without
    recompute, and seconds (the real check on the CPU allocator included)."""
    from autoremat.examples import EXAMPLES
    from autoremat.training.scale_batch import scale_batch

    for name, memory in FITS:
        model, args, kwargs = EXAMPLES[name]()
        started = time.perf_counter()
        found = autoremat.fit(
            model, lambda b, a=args, k=kwargs: scale_batch(a, k, b), device_memory=memory
        )
        seconds = time.perf_counter() - started
        print(f"fit {name} {memory}: batch {found.batch} (without recompute "
              f"{found.largest_without_recompute}) in {seconds:.1f} s", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--zoo", action="store_true", help="every zoo model (--models ignored)")
    parser.add_argument("--no-70b", action="store_true")
    parser.add_argument("--fit", action="store_true", help="time fit on three examples only")
    options = parser.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    if options.fit:
        fit_seconds()
        return
    print("| model | fp32 s | bf16 s |\n| --- | ---: | ---: |")
    total = 0.0
    for name in list(library_zoo.ZOO) if options.zoo else options.models:
        best = [
            min(zoo_plan_seconds(name, dtype) for _ in range(options.repeats))
            for dtype in (None, torch.bfloat16)
        ]
        total += sum(best)
        print(f"| {name} | {best[0]:.2f} | {best[1]:.2f} |", flush=True)
    print(f"\nin all: {total:.1f} s")
    if not options.no_70b:
        runs = [llama_70b_seconds() for _ in range(options.repeats)]
        print(
            f"\nLlama-70B shape on meta: plan(75%) {min(r[0] for r in runs):.1f} s, "
            f"lowest_budget {min(r[1] for r in runs):.1f} s (best of {options.repeats})"
        )


if __name__ == "__main__":
    main()

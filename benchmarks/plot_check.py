"""``--plot`` on every built-in example (fp32 and bf16) and, given ``--zoo NAME``, on library
zoo models: each plan at 50% (or the lowest budget, when higher) drawn, its drawn peaks
checked against the plan's figures, the file's size and the time to draw it printed as a
markdown table (issue 41). With ``--fit``, ``fit`` on each too (at twice the step's memory
without recompute, SGD, batches up to 64), its page checked to mark the batch chosen.

    python benchmarks/plot_check.py [--out DIR] [--examples gpt2,cnn] [--zoo resnet18] [--fit]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

import autoremat
from autoremat.examples import EXAMPLES
from autoremat.training.scale_batch import scale_batch


def drawn_peaks(html: str) -> dict[str, int]:
    """Each curve's peak as the page marks it (``data-peak`` of its marker)."""
    found = re.findall(r'<circle[^>]*data-peak="(\d+)" data-curve="(\w+)"', html)
    return {curve: int(peak) for peak, curve in found}


def check(name: str, model, args, kwargs, autocast, out: Path) -> str:  # type: ignore[no-untyped-def]
    dtype = "bf16" if autocast else "fp32"
    try:
        plan = autoremat.plan(model, args, kwargs, budget="50%", autocast=autocast)
    except autoremat.BudgetTooLow as exc:  # (50% below the lowest: the lowest)
        plan = autoremat.plan(model, args, kwargs, budget=exc.lowest, autocast=autocast)
    start = time.perf_counter()
    path = autoremat.plot(plan, out / f"{name}-{dtype}.html", model, args, kwargs,
                          autocast=autocast)  # fmt: skip
    seconds = time.perf_counter() - start
    peaks = drawn_peaks(path.read_text())
    same = peaks.get("plan") == plan.estimated_peak and peaks.get("without") == plan.baseline_peak
    return (f"| {name} | {dtype} | {len(plan.modules)} | {plan.estimated_by} | "
            f"{'yes' if same else f'NO {peaks} vs {plan.estimated_peak}, {plan.baseline_peak}'} | "
            f"{path.stat().st_size / 1024:.0f} KiB | {seconds:.1f} s |")  # fmt: skip


def check_fit(name: str, model, args, kwargs, autocast, out: Path) -> str:  # type: ignore[no-untyped-def]
    dtype = "bf16" if autocast else "fp32"
    need = autoremat.predict_memory(model, args, kwargs, optimizer="sgd", autocast=autocast)
    found = autoremat.fit(model, lambda b: scale_batch(args, kwargs, b),
                          device_memory=2 * need.device, optimizer="sgd", max_batch=64,
                          autocast=autocast)  # fmt: skip
    start = time.perf_counter()
    path = autoremat.plot(found, out / f"{name}-{dtype}-fit.html")
    seconds = time.perf_counter() - start
    html = path.read_text()
    marked = re.findall(r'data-chosen="(\d+)"', html)
    bars = len(set(re.findall(r'data-batch="(\d+)"', html)))
    same = marked == [str(found.batch)]
    return (f"| {name} | {dtype} | fit: batch {found.batch} (fits: {found.fits}) | "
            f"{bars} bars | {'yes' if same else f'NO: marked {marked}'} | "
            f"{path.stat().st_size / 1024:.0f} KiB | {seconds:.1f} s |")  # fmt: skip


def zoo_model(name: str):  # type: ignore[no-untyped-def]
    import library_zoo

    return library_zoo.ZOO[name].build()


def _zoo_shim() -> None:
    """In the zoo's venv, the library zoo's shim first: transformers imports torchvision there,
    which does not load beside the CPU torch without it (docs/zoo.md)."""
    sys.path.insert(0, str(Path(__file__).parent))
    with contextlib.suppress(ImportError):  # (not the zoo's venv: no torchvision to shim)
        import library_zoo  # noqa: F401


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    p.add_argument("--examples", default=",".join(EXAMPLES))
    p.add_argument("--zoo", default="")
    p.add_argument("--fit", action="store_true", help="fit each model too, and draw it")
    ns = p.parse_args()
    _zoo_shim()
    out = Path(ns.out or tempfile.mkdtemp(prefix="autoremat-plots-"))
    out.mkdir(parents=True, exist_ok=True)
    print("| model | dtype | entries | plan's run | drawn peaks = plan's | file | draw |")
    print("|---|---|---:|---|---|---:|---:|")
    targets = [(n, EXAMPLES[n]) for n in ns.examples.split(",") if n]
    targets += [(n, lambda n=n: zoo_model(n)) for n in ns.zoo.split(",") if n]
    for name, factory in targets:
        for autocast in (None, torch.bfloat16):
            model, args, kwargs = factory()
            print(check(name, model, args, kwargs, autocast, out), flush=True)
            if ns.fit:
                model, args, kwargs = factory()
                print(check_fit(name, model, args, kwargs, autocast, out), flush=True)
    print(f"pages in {out}")


if __name__ == "__main__":
    main()

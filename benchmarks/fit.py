"""Fitting a device: autoremat.fit against trial and error (issue 15).

    python benchmarks/fit.py                     # ~10 min on 2 shared CPU cores
    python benchmarks/fit.py --models gpt2 --steps 2

A CPU "device" of a given size is emulated: a dispatch mode counts the bytes of every tensor
alive (parameters, optimizer state, inputs and what the step creates) and raises PyTorch's CPU
out-of-memory error (``RuntimeError: ... out of memory.``) when a step goes over. Side by side,
per model and device size:

* ``accelerate (x0.9)``: ``accelerate.utils.find_executable_batch_size`` (when accelerate is
  installed: ``pip install accelerate``): a training step at the starting batch, then at 0.9
  times the batch after each out-of-memory error, no recompute;
* ``halving``: the same loop, halving the batch;
* ``autoremat fit``: :func:`autoremat.fit` (the largest batch whose cheapest plan fits,
  sized on ``meta``, checked once) and ``autoremat fit (throughput)`` (of a few batches, the
  most predicted samples per second).

The trial loops start at 16 times the example's batch (accelerate's default 128 for the
8-sequence language models). Figures: the batch found, the seconds to find it (everything the
method ran), the training throughput at that batch (samples per second, median of ``--steps``
timed steps with an AdamW step, the plan applied) and whether that step stayed within the
device. Writes ``fit.md`` and ``fit.csv`` to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run
from autoremat import fit, measure_memory, remove
from autoremat.core.nested import tensor_bytes
from autoremat.examples import EXAMPLES
from autoremat.record.memory import LiveMemory
from autoremat.record.step import train_step
from autoremat.training.scale_batch import scale_batch
from report import dicts_to_csv

# model -> the device sizes tried
DEVICES = {
    "gpt2": ("128MiB", "256MiB"),
    "looped": ("128MiB",),
    "mlp": ("96MiB",),
    "cnn": ("64MiB",),
}


class OutOfMemory(LiveMemory):
    """LiveMemory that raises PyTorch's CPU out-of-memory error once the bytes it tracks pass
    ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.current > self.limit:
            raise RuntimeError(
                f"DefaultCPUAllocator: can't allocate memory (emulated {self.limit})"
            )
        return out


def step(model: Any, opt: Any, args: Any, kwargs: Any, total: int | None) -> None:
    """One training step with the optimizer; over ``total`` bytes in all, out of memory."""
    state = [v for s in opt.state.values() for v in s.values()]
    resident = tensor_bytes([*model.parameters(), *model.buffers(), state, args, kwargs])
    if total is None:
        train_step(model, args, kwargs, None)
        opt.step()
        return
    with OutOfMemory(total - resident):
        train_step(model, args, kwargs, None)
        opt.step()


def throughput(model: Any, args: Any, kwargs: Any, batch: int, steps: int) -> float:
    """Samples per second of training steps at ``batch`` (AdamW), the median of ``steps``."""
    opt = torch.optim.AdamW(model.parameters())
    step(model, opt, args, kwargs, None)  # the state exists from here on
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        step(model, opt, args, kwargs, None)
        times.append(time.perf_counter() - begin)
    return batch / statistics.median(times)


def trial(model: Any, args: Any, kwargs: Any, total: int, start: int, shrink: Any) -> int:
    """The loop users write: a step at ``start``, and a smaller batch after each
    out-of-memory error (``shrink``: accelerate's decorator, or halving)."""

    def attempt(batch: int) -> int:
        opt = torch.optim.AdamW(model.parameters())
        a, k = scale_batch(args, kwargs, batch)
        for _ in range(2):  # the second step has the optimizer's state
            step(model, opt, a, k, total)
        return batch

    return shrink(attempt, start)


def accelerate_loop(attempt: Any, start: int) -> int:
    from accelerate.utils import find_executable_batch_size

    return find_executable_batch_size(attempt, starting_batch_size=start)()  # type: ignore[no-any-return]


def halving_loop(attempt: Any, start: int) -> int:
    batch = start
    while batch >= 1:
        try:
            return attempt(batch)
        except RuntimeError as exc:
            if "can't allocate memory" not in str(exc):
                raise
            batch //= 2
    raise RuntimeError("no batch fits")


def methods() -> list[str]:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return ["halving", "autoremat fit", "autoremat fit (throughput)"]
    return ["accelerate (x0.9)", "halving", "autoremat fit", "autoremat fit (throughput)"]


def one(name: str, device: str, method: str, steps: int) -> dict[str, Any]:
    model, args, kwargs = EXAMPLES[name]()
    total = int(device.removesuffix("MiB")) * 2**20
    start = 16 * int(args[0].shape[0] if args else next(iter(kwargs.values())).shape[0])
    begin = time.perf_counter()
    plan, fits, predicted = None, True, None
    if method.startswith("autoremat"):
        objective = "throughput" if "throughput" in method else "batch"
        found = fit(
            model, lambda b: scale_batch(args, kwargs, b), device_memory=total, objective=objective
        )
        batch, plan, fits = found.batch, found.plan, bool(found.fits)
        predicted = found.chosen.memory.tensors if found.chosen is not None else None
    else:
        shrink = accelerate_loop if method.startswith("accelerate") else halving_loop
        batch = trial(model, args, kwargs, total, start, shrink)
    took = time.perf_counter() - begin
    model, args, kwargs = EXAMPLES[name]()  # fresh weights for the timing
    a, k = scale_batch(args, kwargs, batch)
    if plan is not None:
        plan.apply(model)
    memory = measure_memory(model, a, k, optimizer="adamw").tensors
    speed = throughput(model, a, k, batch, steps)
    remove(model)
    return {
        "model": name,
        "device": device,
        "method": method,
        "batch": batch,
        "seconds_to_find": round(took, 2),
        "samples_per_s": round(speed, 1),
        "memory_mib": round(memory / 2**20, 2),
        "predicted_mib": None if predicted is None else round(predicted / 2**20, 2),
        "within": fits and memory <= total,
        "entries": 0 if plan is None else len(plan.modules),
    }


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [
        "# Fitting a device: autoremat.fit against trial and error",
        "",
        header,
        "",
        "A CPU device of the given size, emulated (a dispatch mode raises the CPU out-of-memory "
        "error past it). `batch`: the batch each method found; `find s`: seconds it took "
        "(every step or profile it ran); `samples/s`: training throughput at that batch (AdamW, "
        "the plan applied, median of timed steps); `x`: over the best trial-and-error row; "
        "`memory`: the most tensors held in a training step at that batch (`predicted`: what "
        "fit predicted for it); `entries`: the plan's.",
        "",
        "| model | device | method | batch | find s | samples/s | x | memory MiB | predicted | "
        "within | entries |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        trials = [
            x["samples_per_s"]
            for x in rows
            if (x["model"], x["device"]) == (r["model"], r["device"])
            and not x["method"].startswith("autoremat")
        ]
        ratio = r["samples_per_s"] / max(trials) if trials else float("nan")
        lines.append(
            f"| {r['model']} | {r['device']} | {r['method']} | {r['batch']} | "
            f"{r['seconds_to_find']:.1f} | {r['samples_per_s']:.1f} | {ratio:.2f} | "
            f"{r['memory_mib']:.1f} | "
            f"{'' if r['predicted_mib'] is None else format(r['predicted_mib'], '.1f')} | "
            f"{'yes' if r['within'] else 'NO'} | {r['entries']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEVICES))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    begin = time.perf_counter()
    rows = []
    for name in ns.models.split(","):
        for device in DEVICES[name]:
            for method in methods():
                print(f"{name} {device} {method}", file=sys.stderr, flush=True)
                rows.append(one(name, device, method, ns.steps))
    out = Path(ns.out)
    dicts_to_csv(rows, out / "fit.csv")
    detail = "accelerate " + ("installed" if len(methods()) == 4 else "not installed")
    text = markdown(rows, run.machine_line(time.perf_counter() - begin, detail=detail))
    (out / "fit.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

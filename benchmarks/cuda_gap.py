"""Where the CUDA allocator's peak and the storage-byte peak of a budget plan part ways.

    python benchmarks/cuda_gap.py        # on a CUDA machine; prints one block per model

For a budget plan applied to each model, one training step runs under a dispatch mode that,
after every op, records the live storage bytes (:class:`autoremat.LiveMemory`) and
``torch.cuda.memory_allocated()``. It prints the planner's estimate, both peaks, the
allocator's own statistics (``requested_bytes`` is what was asked for, before rounding), and
the ops after which the gap between the allocator and the storages grew most.
"""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autoremat
from autoremat.examples import EXAMPLES
from autoremat.record.memory import LiveMemory

sys.path.insert(0, str(Path(__file__).resolve().parent))
MiB = 2**20


class Gap(TorchDispatchMode):
    def __init__(self, live: LiveMemory, start: int) -> None:
        super().__init__()
        self.live, self.start, self.rows = live, start, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        alloc = torch.cuda.memory_allocated() - self.start
        self.rows.append((str(func), self.live.current, alloc))
        return out


def step_peak(model, args, kwargs) -> int:
    """The allocator's peak over one step, above what was allocated before it."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    autoremat.record.step.default_loss(model(*args, **kwargs)).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def run(name: str, model, args, kwargs, budget: str) -> None:
    try:
        plan = autoremat.plan(model, args, kwargs, budget=budget)
    except ValueError:
        plan = autoremat.plan(model, args, kwargs, budget=0.99)
    unwrapped = [step_peak(model, args, kwargs) for _ in range(2)]
    wrapped = plan.apply(copy.deepcopy(model))
    # the first steps of the wrapped model (after the unwrapped model's): workspaces, segments
    first = [step_peak(wrapped, args, kwargs) for _ in range(3)]
    print(
        f"-- {name}: allocator peak of the unwrapped model's steps "
        f"{[round(x / MiB, 1) for x in unwrapped]} MiB (planner baseline "
        f"{plan.baseline_peak / MiB:.1f}); of the wrapped model's first 3 steps "
        f"{[round(x / MiB, 1) for x in first]} MiB"
    )
    wrapped.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with LiveMemory() as live, Gap(live, start) as gap:
        out = wrapped(*args, **kwargs)
        autoremat.record.step.default_loss(out).backward()
        del out
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    alloc_peak = torch.cuda.max_memory_allocated() - start
    print(
        f"== {name} budget {budget}: {len(plan.modules)} entries "
        f"({len(plan.selective)} selective)\n"
        f"estimated {plan.estimated_peak / MiB:.1f} MiB, storage peak {live.peak / MiB:.1f}, "
        f"allocator peak {alloc_peak / MiB:.1f}, requested peak "
        f"{(stats.get('requested_bytes.all.peak', 0) - start) / MiB:.1f}, reserved peak "
        f"{stats['reserved_bytes.all.peak'] / MiB:.1f}, alloc retries "
        f"{stats.get('num_alloc_retries', 0)}"
    )
    gaps = [(a - s, op, s, a) for op, s, a in gap.rows]
    top = max(gap.rows, key=lambda r: r[2])
    print(f"at the allocator's highest op ({top[0]}): storages {top[1] / MiB:.1f} MiB")
    jumps = sorted(
        ((gaps[i][0] - gaps[i - 1][0], gaps[i][1], i) for i in range(1, len(gaps))), reverse=True
    )[:6]
    for d, op, i in jumps:
        print(f"  gap +{d / MiB:7.2f} MiB after op {i:5d} {op} (gap now {gaps[i][0] / MiB:.1f})")


def main() -> None:
    logging.disable(logging.WARNING)
    torch.backends.cuda.matmul.allow_tf32 = False
    from gpu_bench import build

    for name in ("gpt2", "hf-gpt2", "cnn"):
        model, args, kwargs = EXAMPLES[name]()
        model, args, kwargs = model.cuda(), *_to(args, kwargs)
        run(name, model, args, kwargs, "50%")
    for name in ("gpt2", "mlp", "llama"):
        model, args, kwargs = build(name, "gpu", "cuda")
        run(f"{name} (GPU size)", model, args, kwargs, "50%")
        del model, args, kwargs
        torch.cuda.empty_cache()


def _to(args, kwargs):
    move = lambda t: t.cuda() if isinstance(t, torch.Tensor) else t  # noqa: E731
    return tuple(move(a) for a in args), {k: move(v) for k, v in (kwargs or {}).items()}


if __name__ == "__main__":
    main()

"""What the wrap's replay guards cost (issue 13): buffers put back to their pre-forward values,
Python's and NumPy's generators replayed, inputs checked (:mod:`autoremat.wrap.replay`).

    python benchmarks/replay_cost.py            # the zoo, budget 50% (or lowest) plans

For each model: one eager training step with the plan applied, timed with the guards and with
them switched off (their bookkeeping replaced by no-ops, interleaved, median of ``--repeats``),
and the bytes the guards keep from forward to backward (pre-forward values of the buffers the
forward changed) and copy transiently (every buffer of the recomputed modules). Writes
``replay.md`` to ``--out``.
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

import autoremat
from autoremat.comparison.contenders import MiB
from autoremat.core.entries import covered
from autoremat.record.step import default_loss, train_step
from autoremat.wrap import replay
from run import machine_line
from zoo import ZOO


def _step_seconds(model: Any, args: Any, kwargs: Any) -> float:
    start = time.perf_counter()
    train_step(model, args, kwargs, default_loss)
    return time.perf_counter() - start


def _guards_off() -> dict[str, Any]:
    """Replace the guards' bookkeeping by no-ops; returns what to put back."""
    saved = {name: getattr(replay, name) for name in ("_buffers", "get_host_rng", "set_host_rng")}
    replay._buffers = lambda owners: {}  # type: ignore[assignment]
    replay.get_host_rng = lambda: (None, None)  # type: ignore[assignment]
    replay.set_host_rng = lambda states: None  # type: ignore[assignment]
    return saved


def _kept_bytes(model: Any, args: Any, kwargs: Any) -> tuple[int, int]:
    """Bytes of buffers kept from forward to backward, and of all buffers of wrapped
    modules (copied transiently), for one forward."""
    kept: list[int] = []
    original = replay.CheckpointedCall._forward

    def forward(self: Any, fn: Any, a: Any, k: Any) -> Any:
        out = original(self, fn, a, k)
        kept.append(
            sum(
                b.numel() * b.element_size()
                for b in self.before.values()
                if isinstance(b, torch.Tensor)
            )
        )
        return out

    replay.CheckpointedCall._forward = forward  # type: ignore[method-assign]
    try:
        train_step(model, args, kwargs, default_loss)
    finally:
        replay.CheckpointedCall._forward = original  # type: ignore[method-assign]
    paths = {p for entry in autoremat.wrap.wrapped_paths(model) for p in covered(entry)}
    wrapped = [m for p, m in model.named_modules() if p in paths]
    copied = sum(b.numel() * b.element_size() for m in wrapped for b in m.buffers())
    return sum(kept), copied


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama,vit,cnn,unet,mlp")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ns = parser.parse_args()
    torch.set_num_threads(1)
    lines = [
        "| model | entries | step ms, guards on | step ms, guards off | on / off | "
        "kept to backward KiB | copied per forward KiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ns.models.split(","):
        model, args, kwargs = ZOO[name]()
        try:
            chosen = autoremat.plan(model, args, kwargs, budget="50%", objective="flops")
        except autoremat.BudgetTooLow as exc:
            chosen = autoremat.plan(model, args, kwargs, budget=exc.lowest, objective="flops")
        chosen.apply(model)
        kept, copied = _kept_bytes(model, args, kwargs)
        on: list[float] = []
        off: list[float] = []
        for _ in range(ns.repeats):
            on.append(_step_seconds(model, args, kwargs))
            saved = _guards_off()
            try:
                off.append(_step_seconds(model, args, kwargs))
            finally:
                for attr, value in saved.items():
                    setattr(replay, attr, value)
        t_on, t_off = statistics.median(on), statistics.median(off)
        lines.append(
            f"| {name} | {len(autoremat.wrap.wrapped_paths(model))} | {t_on * 1e3:.0f} | "
            f"{t_off * 1e3:.0f} | {t_on / t_off:.3f} | {kept / 1024:.1f} | {copied / 1024:.1f} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    text = "# What the replay guards cost\n\n" + machine_line(repeats=ns.repeats) + "\n\n"
    (out / "replay.md").write_text(text + "\n".join(lines) + f"\n\n(1 MiB = {MiB} bytes)\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

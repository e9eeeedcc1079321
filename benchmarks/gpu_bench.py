"""GPU benchmark: recompute strategies side by side on GPU-sized models, measured by the CUDA
caching allocator.

    python benchmarks/gpu_bench.py --out benchmarks/results            # on a CUDA machine, < 4 min
    python benchmarks/gpu_bench.py --quick --device cpu --out /tmp/x   # smoke test: tiny sizes

Models (each step holds about 1.5-3.5 GB of activations in float32 at the GPU sizes; few layers
and large batches, since the profiling and dispatch-mode measurements cost Python time per op):
Hugging Face GPT-2 (6 layers, width 768, batch 8 x 512) and Llama (4 layers, width 1024, GQA,
batch 8 x 512), the plain-PyTorch TinyGPT (6 layers, width 768, explicit attention, batch
4 x 512), an MLP chain (the one ``nn.Sequential``, for sqrt segments: 12 Linear(2048)+GELU
pairs, batch 16384) and a BatchNorm CNN (3 stages of 64-256 channels, batch 32 x 128 x 128); all
with dropout where the architecture has it.

Strategies, run by :func:`autoremat.comparison.compare` on the same inputs: no recompute, every
block, sqrt(n) segments (chains only), autoremat levels at segments 1, 4, 16 (identical plans
kept once), and autoremat budget plans at 75%, 50% and the lowest feasible budget. On CUDA the
``peak`` of :func:`autoremat.measure` is ``torch.cuda.max_memory_allocated`` over the step;
the budget planner's estimate comes from its storage-byte profile. Writes ``results_cuda.md``,
``results_cuda.csv`` to ``--out`` after each model, so a run stopped early keeps what it
measured, and ``results_cuda.png`` at the end.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import math
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from autoremat.comparison import (
    Contender,
    Row,
    budget_plan,
    compare,
    every_block,
    levels_plan,
    no_recompute,
    sqrt_segments,
    to_markdown,
)
from autoremat.examples import ConvNet, Example, TinyGPT, require_transformers
from autoremat.record.snapshot import preserved
from autoremat.record.step import default_loss, train_step
from report import plot, to_csv

LEVELS = (1, 4, 16)
BUDGETS: tuple[float | str, ...] = (0.75, 0.5, "min")
MODELS = ("gpt2", "llama", "gpt-torch", "mlp", "cnn")

# name -> sizes at full (GPU) scale and at --quick scale
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "gpt2": {
        "gpu": {"layers": 6, "width": 768, "heads": 12, "batch": 8, "seq": 512, "vocab": 8192},
        "quick": {"layers": 2, "width": 64, "heads": 4, "batch": 2, "seq": 64, "vocab": 256},
    },
    "llama": {
        "gpu": {
            "layers": 4,
            "width": 1024,
            "heads": 16,
            "kv_heads": 8,
            "ffn": 2816,
            "batch": 8,
            "seq": 512,
            "vocab": 8192,
        },
        "quick": {
            "layers": 2,
            "width": 64,
            "heads": 4,
            "kv_heads": 2,
            "ffn": 176,
            "batch": 2,
            "seq": 64,
            "vocab": 256,
        },
    },
    "gpt-torch": {
        "gpu": {"layers": 6, "width": 768, "heads": 12, "batch": 4, "seq": 512, "vocab": 8192},
        "quick": {"layers": 2, "width": 64, "heads": 4, "batch": 2, "seq": 64, "vocab": 256},
    },
    "mlp": {
        "gpu": {"pairs": 12, "width": 2048, "batch": 16384},
        "quick": {"pairs": 6, "width": 64, "batch": 256},
    },
    "cnn": {
        "gpu": {"base": 64, "stages": 3, "batch": 32, "image": 128},
        "quick": {"base": 8, "stages": 2, "batch": 2, "image": 32},
    },
}


def _seeded(build: Callable[[], Example]) -> Example:
    """Build with seed 0 without touching the global random state; training mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, args, kwargs = build()
    return model.train(), args, kwargs


def gpt2(s: dict[str, int]) -> Example:
    t = require_transformers()
    config = t.GPT2Config(
        n_layer=s["layers"],
        n_embd=s["width"],
        n_head=s["heads"],
        n_positions=s["seq"],
        vocab_size=s["vocab"],
    )
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]))
    return t.GPT2LMHeadModel(config), (), {"input_ids": ids, "labels": ids}


def llama(s: dict[str, int]) -> Example:
    t = require_transformers()
    config = t.LlamaConfig(
        num_hidden_layers=s["layers"],
        hidden_size=s["width"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        intermediate_size=s["ffn"],
        vocab_size=s["vocab"],
        max_position_embeddings=s["seq"],
        attention_dropout=0.1,
    )
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]))
    return t.LlamaForCausalLM(config), (), {"input_ids": ids, "labels": ids}


def gpt_torch(s: dict[str, int]) -> Example:
    model = TinyGPT(
        vocab=s["vocab"], width=s["width"], layers=s["layers"], heads=s["heads"], context=s["seq"]
    )
    idx = torch.randint(0, s["vocab"], (s["batch"], s["seq"]))
    return model, (idx,), {"targets": torch.roll(idx, -1, dims=1)}


def mlp(s: dict[str, int]) -> Example:
    layers: list[nn.Module] = []
    for _ in range(s["pairs"]):
        layers += [nn.Linear(s["width"], s["width"]), nn.GELU()]
    return nn.Sequential(*layers), (torch.randn(s["batch"], s["width"]),), {}


def cnn(s: dict[str, int]) -> Example:
    widths = tuple(s["base"] * 2**i for i in range(s["stages"]))
    images = torch.randn(s["batch"], 3, s["image"], s["image"])
    return ConvNet(widths=widths), (images,), {}


BUILDERS: dict[str, Callable[[dict[str, int]], Example]] = {
    "gpt2": gpt2,
    "llama": llama,
    "gpt-torch": gpt_torch,
    "mlp": mlp,
    "cnn": cnn,
}


def to_device(obj: Any, device: str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def build(name: str, scale: str, device: str) -> Example:
    model, args, kwargs = _seeded(lambda: BUILDERS[name](SIZES[name][scale]))
    return model.to(device), to_device(args, device), to_device(kwargs, device)


def warm_up(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """One training step before anything is measured: cuBLAS allocates a workspace for each
    thread on its first use (the autograd engine's device thread too) and keeps it, which would
    otherwise count in the first strategy's peak. The model is left as found."""
    with preserved(model):
        train_step(model, args, kwargs, default_loss)


def describe(name: str, scale: str, model: nn.Module) -> str:
    params = sum(p.numel() for p in model.parameters())
    sizes = ", ".join(f"{k} {v}" for k, v in SIZES[name][scale].items())
    return f"{name}: {type(model).__name__}, {params / 1e6:.1f} M parameters, {sizes}"


def strategies(budgets: tuple[float | str, ...]) -> list[Contender]:
    chosen = [no_recompute(), every_block(), sqrt_segments()]
    chosen += [levels_plan(k) for k in LEVELS]
    chosen += [budget_plan(b) for b in budgets]
    return chosen


_PREDICTED = re.compile(r"predicted peak ([\d.]+) MiB \(([+-][\d.]+)%\)")


def estimate(row: Row) -> tuple[str, str]:
    """The budget planner's estimated peak (MiB) and its error against the measured peak, from
    the row's note (``autoremat.comparison`` writes them there); n/a for other strategies."""
    found = _PREDICTED.search(row.note)
    if found is None:
        return "n/a", "n/a"
    return found.group(1), f"{float(found.group(2)):+.1f}%"


def _x(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.2f}"


def short_note(row: Row) -> str:
    """What the summary says beyond the figures: why a row failed, what a budget plan wraps."""
    lowest = re.search(r"below the lowest peak .*?, ([\d.]+) MiB", row.note)
    if lowest is not None:
        return f"infeasible: the lowest peak the planner reaches is {lowest.group(1)} MiB"
    failed = re.search(r"failed: (.*)", row.note)
    if failed is not None:
        return f"failed: {failed.group(1)[:100]}"
    parts = [p for p in row.note.split("; ") if not p.startswith("predicted peak")]
    parts.sort(key=lambda p: "differ" not in p)  # what differs from the baseline first
    return "; ".join(parts)[:120].replace("|", "\\|")


def summary_table(rows: list[Row]) -> str:
    """The figures this benchmark is about, one line per row."""
    lines = [
        "| model | strategy | peak MiB | peak x | estimated MiB | estimate error | FLOPs x "
        "| ms/step | time x | grads | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        est, err = estimate(r)
        grads = "n/a" if r.flops is None else "ok" if r.grads_match else "DIFFER"
        lines.append(
            f"| {r.model} | {r.strategy} | {'n/a' if r.peak is None else f'{r.peak / 2**20:.1f}'} "
            f"| {_x(r.peak_ratio)} | {est} | {err} | {_x(r.flops_ratio)} "
            f"| {'n/a' if r.seconds is None else f'{r.seconds * 1e3:.1f}'} | {_x(r.time_ratio)} "
            f"| {grads} | {short_note(r)} |"
        )
    return "\n".join(lines)


def machine_line(device: str, repeats: int, seconds: float | None = None) -> str:
    parts = [f"torch {torch.__version__}"]
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        parts.append(f"transformers {transformers.__version__}")
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        parts.insert(0, f"GPU: {props.name} ({props.total_memory / 2**30:.0f} GiB)")
        parts.append(f"CUDA {torch.version.cuda}")
        parts.append(f"float32 matmul precision {torch.get_float32_matmul_precision()}")
    else:
        parts.insert(0, f"device: {device}, {torch.get_num_threads()} threads")
    parts.append(f"{repeats} interleaved timed steps per strategy")
    parts.append(f"date {datetime.datetime.now().isoformat(timespec='minutes')}")
    if seconds is not None:
        parts.append(f"run took {seconds / 60:.1f} min")
    return "Machine: " + ", ".join(parts)


LEGEND = """\
`peak`: the most memory allocated during one training step (forward, loss, backward) above what
was allocated before it, from `autoremat.measure`: on CUDA `torch.cuda.max_memory_allocated`
(caching-allocator blocks, kernels' scratch buffers included), on CPU the storage tracker.
`x` columns are ratios to the `none` row of the same model. `estimated`: the budget planner's
predicted peak (storage bytes of its profile) and its error against the measured peak. `FLOPs x`:
forward, backward and recompute FLOPs (matmuls, convolutions, attention) over `none`'s. `ms/step`:
median of interleaved timed steps (one step of each strategy per round, order reversed every
other round), the GPU synchronized before and after each. `grads`: loss and every gradient of
one step equal to `none`'s within rtol 1e-5, atol 1e-6 (fused attention and some other backward
kernels add in a nondeterministic order on a GPU, which can exceed that without any error in the
recompute; the note of the full table gives the worst relative error)."""


def write(
    rows: list[Row],
    out: Path,
    header: str,
    models: list[str],
    errors: list[str],
    picture: bool = False,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    parts = [
        "# autoremat on a GPU: recompute strategies side by side",
        header,
        "\n".join(f"* {line}" for line in models),
        LEGEND,
        summary_table(rows),
        "## All figures",
        to_markdown(rows),
    ]
    if errors:
        parts += ["## Errors", "\n\n".join(f"```\n{e}\n```" for e in errors)]
    (out / "results_cuda.md").write_text("\n\n".join(parts) + "\n")
    to_csv(rows, out / "results_cuda.csv")
    if not picture:
        return
    try:
        plot(rows, out / "results_cuda.png", title=header)
    except Exception as exc:  # matplotlib missing or a plotting problem: tables still stand
        print(f"plot failed: {type(exc).__name__}: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per strategy")
    parser.add_argument("--out", default="benchmarks/results", help="output directory")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=210.0,
        help="seconds; no model is started after this (the tables are written as they stand)",
    )
    parser.add_argument(
        "--no-tf32",
        action="store_true",
        help="keep float32 matmuls in full precision on the GPU (default: TF32, 'high')",
    )
    ns = parser.parse_args(argv)
    names = [n.strip() for n in ns.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in BUILDERS]
    if unknown:
        parser.error(f"unknown models {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if ns.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU; use --device cpu (with --quick)")
    scale = "quick" if ns.quick else "gpu"
    repeats = ns.repeats or (2 if ns.quick else 5)
    if ns.device == "cuda" and not ns.no_tf32:
        torch.set_float32_matmul_precision("high")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    out = Path(ns.out)
    start = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {line}", file=sys.stderr, flush=True)

    rows: list[Row] = []
    described: list[str] = []
    errors: list[str] = []
    for name in names:
        if time.perf_counter() - start > ns.time_limit:
            progress(f"time limit reached: {name} and later models skipped")
            described.append(f"{name}: skipped (time limit)")
            continue
        try:
            model, args, kwargs = build(name, scale, ns.device)
            described.append(describe(name, scale, model))
            progress(described[-1])
            warm_up(model, args, kwargs)
            rows += compare(
                model,
                args,
                kwargs,
                strategies(BUDGETS),
                repeats=repeats,
                name=name,
                progress=progress,
            )
        except Exception:
            errors.append(f"{name}:\n{traceback.format_exc()}")
            progress(f"{name} failed:\n{errors[-1]}")
        finally:
            model = args = kwargs = None  # free the model before the next one
            gc.collect()
            if ns.device == "cuda":
                torch.cuda.empty_cache()
        write(rows, out, machine_line(ns.device, repeats), described, errors)
    header = machine_line(ns.device, repeats, time.perf_counter() - start)
    write(rows, out, header, described, errors, picture=True)
    progress(f"done; wrote {out}/results_cuda.md, results_cuda.csv, results_cuda.png")
    print(header)
    print(summary_table(rows))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

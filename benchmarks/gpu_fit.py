"""Fitting a GPU under a memory cap: autoremat.fit against no recompute and every-block
checkpointing, each at its own largest batch (issue 15's GPU check; under 8 minutes).

    python benchmarks/gpu_fit.py --out benchmarks/results          # on a CUDA machine
    python benchmarks/gpu_fit.py --quick --device cpu --out /tmp/x  # smoke test: tiny sizes

A Hugging Face Llama-style model (float32 parameters and AdamW state, the step under bf16
autocast: sized on ``meta`` with autocast's casts made there, :mod:`autoremat.record.autocast_meta`)
trains under a cap on the caching allocator
(``torch.cuda.set_per_process_memory_fraction``). Three ways, each at the largest batch it can
train under the cap:

* ``autoremat fit``: :func:`autoremat.fit` (sized on ``meta``, the plan checked once);
* ``no recompute``: the largest batch without recompute (bisection with real steps; an
  out-of-memory error means "too big");
* ``every block``: every decoder layer checkpointed (its entries applied with
  ``autoremat.wrap.apply``), the largest batch the same way.

For each: the batch, ``torch.cuda.max_memory_reserved`` over ``--steps`` training steps against
the cap (no out-of-memory error may occur), and tokens per second (median step). Writes
``results_fit_cuda.md`` to ``--out``.
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
from autoremat import fit, remove
from autoremat.training.device_model import CUDA_CONTEXT
from autoremat.wrap.wrapping import apply

SIZES = {  # layers, width, heads, ffn, sequence, vocab
    "full": (12, 2048, 16, 5632, 2048, 32000),
    "quick": (2, 64, 4, 128, 32, 256),
}


def build(quick: bool, device: str) -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    layers, width, heads, ffn, seq, vocab = SIZES["quick" if quick else "full"]
    config = transformers.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        intermediate_size=ffn,
        vocab_size=vocab,
        max_position_embeddings=seq,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device).train()

    def make_inputs(batch: int) -> tuple[tuple[()], dict[str, torch.Tensor]]:
        ids = torch.randint(0, vocab, (batch, seq))
        return (), {"input_ids": ids, "labels": ids}

    return model, make_inputs, seq


def steps_at(model: Any, make_inputs: Any, batch: int, steps: int, device: str) -> dict[str, Any]:
    """``steps`` AdamW training steps at ``batch``: the allocator's most reserved bytes and the
    median step's seconds; ``oom`` when the cap was hit."""
    _, kwargs = make_inputs(batch)
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    opt = torch.optim.AdamW(model.parameters())
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = []
    try:
        for _ in range(steps + 1):
            begin = time.perf_counter()
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(**kwargs).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - begin)
    except torch.OutOfMemoryError:
        return {"oom": True}
    finally:
        del opt
    reserved = torch.cuda.max_memory_reserved() if cuda else None
    return {"oom": False, "reserved": reserved, "seconds": statistics.median(times[1:])}


def largest(model: Any, make_inputs: Any, top: int, device: str) -> int:
    """The largest batch in ``1..top`` whose steps raise no out-of-memory error (bisection)."""
    lo, hi = 0, top + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        fits = not steps_at(model, make_inputs, mid, 1, device)["oom"]
        lo, hi = (mid, hi) if fits else (lo, mid)
    return lo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--fraction", type=float, default=0.4, help="the allocator's cap")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ns = parser.parse_args(argv)
    begin = time.perf_counter()
    model, make_inputs, seq = build(ns.quick, ns.device)
    if ns.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(ns.fraction)
        cap = int(total * ns.fraction)
        device_memory = cap + CUDA_CONTEXT  # the cap bounds the allocator; fit adds the context
    else:
        cap = device_memory = 64 * 2**20
    found = fit(
        model, make_inputs, device_memory=device_memory, optimizer="adamw", autocast=torch.bfloat16
    )
    rows = []
    found.plan.apply(model)
    rows.append(
        (
            "autoremat fit",
            found.batch,
            steps_at(model, make_inputs, found.batch, ns.steps, ns.device),
        )
    )
    remove(model)
    top = max(2 * found.batch, 2)
    if ns.device == "cuda":
        plain = largest(model, make_inputs, top, ns.device)
        rows.append(
            ("no recompute", plain, steps_at(model, make_inputs, plain, ns.steps, ns.device))
        )
        layers = [f"model.layers.{k}" for k in range(model.config.num_hidden_layers)]
        apply(model, layers)
        blocks = largest(model, make_inputs, top, ns.device)
        rows.append(
            ("every block", blocks, steps_at(model, make_inputs, blocks, ns.steps, ns.device))
        )
        remove(model)
    lines = [
        "# Fitting a GPU under a memory cap",
        "",
        run.machine_line(time.perf_counter() - begin, detail=f"cap {cap / 2**30:.1f} GiB"),
        "",
        str(found),
        "",
        "| strategy | batch | reserved GiB | of the cap | tokens/s | OOM |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, batch, r in rows:
        reserved = r.get("reserved")
        tokens = batch * seq / r["seconds"] if not r["oom"] else float("nan")
        share = "n/a" if reserved is None else f"{reserved / cap:.3f}"
        size = "n/a" if reserved is None else f"{reserved / 2**30:.2f}"
        lines.append(f"| {name} | {batch} | {size} | {share} | {tokens:.0f} | {r['oom']} |")
    text = "\n".join(lines) + "\n"
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    (Path(ns.out) / "results_fit_cuda.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

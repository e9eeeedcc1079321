"""DDP and FSDP2 (``fully_shard``) on CPU: gloo, 2 processes started by this file.

The two ranks run everything in one launch (:func:`_worker`, this file run as a script) and
write what they saw to a file; the tests compare it here with a single-process reference. The
model has no dropout, so every step is deterministic: the reference is one step of the
unwrapped, unsharded model on the two ranks' batches concatenated (data-parallel gradients are
the mean over ranks of per-rank means, which is the mean over the whole batch). A launch that
takes longer than :data:`TIMEOUT` seconds (a hang in a collective) is killed and fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import autoremat
from autoremat import wrap
from autoremat.comparison.recomputed import RecomputeCounter
from autoremat.examples import TinyGPT
from autoremat.planning.fingerprint import fingerprint, structure
from autoremat.record.memory import LiveMemory
from autoremat.training.rank_emulation import ResizeCountingMemory
from conftest import no_recompute_if_asked

WORLD = 2
BATCH = 4  # per rank
TOKENS = 32
BUDGET = "80%"
TIMEOUT = 900  # seconds for the whole 2-process launch (only a hang should reach it)

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed/gloo"
)


def build() -> TinyGPT:
    """A 4-block GPT-2-like model without dropout, the same weights on every call."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TinyGPT(vocab=128, width=64, layers=4, heads=4, context=TOKENS, dropout=0.0).train()


def batch(rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (``rank=None``), or rank ``rank``'s share of it."""
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 128, (WORLD * BATCH, TOKENS), generator=g)
    targets = torch.roll(idx, -1, dims=1)
    if rank is None:
        return idx, targets
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    return idx[rows], targets[rows]


def step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x, targets=y)["loss"].backward()


def _shard(model: TinyGPT, mesh: Any) -> TinyGPT:
    from torch.distributed.fsdp import fully_shard

    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_peaks(model: TinyGPT, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """Peak of one FSDP2 step on this rank: with resize_ counted, and as LiveMemory sees it.
    The output is kept until backward ends, as :func:`autoremat.measure` (the plan's
    figures) keeps it."""
    step(model, x, y)  # warm-up: lazy init, unsharded storages made once
    peaks = []
    for tracker in (ResizeCountingMemory(), LiveMemory()):
        model.zero_grad(set_to_none=True)
        with tracker:
            out = model(x, targets=y)
            out["loss"].backward()
            del out
        peaks.append(tracker.peak)
    return peaks[0], peaks[1]


def _worker(rank: int, out: Path) -> None:
    """One rank: every scenario in turn; results to ``out/rank<r>.pt``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out / 'store'}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    res: dict[str, Any] = {}
    x, y = batch(rank)
    times = {"start": time.perf_counter()}

    # broadcast_plan: src passing None raises on every rank (nobody is left waiting)
    try:
        autoremat.broadcast_plan(None)
    except ValueError as e:
        res["none_error"] = str(e)
    # a plan built by hand, without a fingerprint: the other ranks could not load it, so
    # every rank raises (none is left waiting at its next collective)
    try:
        autoremat.broadcast_plan(
            autoremat.Plan(modules=("0",), strategy="levels", model_class="M", segments=1)
        )
    except ValueError as e:
        res["unfingerprinted_error"] = str(e)

    # a group without rank 1: rank 0 gets its plan back, rank 1 (outside it) a ValueError
    solo = dist.new_group([0])
    try:
        model = build()
        mine = autoremat.Plan(
            (), "levels", "TinyGPT", fingerprint=fingerprint(model), structure=structure(model)
        )
        res["solo"] = autoremat.broadcast_plan(mine, group=solo) is mine
    except ValueError as e:
        res["solo"] = str(e)

    # plan once, on rank 0, on rank 0's batch; send it
    plan = autoremat.plan(build(), (x,), {"targets": y}, budget=BUDGET) if rank == 0 else None
    plan = autoremat.broadcast_plan(plan)
    times["plan"] = time.perf_counter()
    res["plan"] = json.dumps(plan.to_dict())

    # (a) DDP over the wrapped model
    model = plan.apply(build())
    ddp = DistributedDataParallel(model)
    step(ddp, x, y)
    res["ddp_wrapped"] = list(autoremat.wrap.wrapped_paths(model))
    res["ddp_keys"] = list(ddp.state_dict())
    res["ddp_grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    times["ddp"] = time.perf_counter()

    # (b) FSDP2: apply the plan, then fully_shard each block and the root
    mesh = init_device_mesh("cpu", (WORLD,))
    model = _shard(plan.apply(build()), mesh)
    step(model, x, y)
    res["fsdp_wrapped"] = list(autoremat.wrap.wrapped_paths(model))
    res["fsdp_keys"] = list(model.state_dict())
    res["fsdp_grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    res["fsdp_classes"] = {p: type(m).__name__ for p, m in model.named_modules()}
    # per-rank memory of the step: the plan on the sharded model, and no plan
    res["fsdp_peak_plan"], res["fsdp_live_plan"] = _fsdp_peaks(model, x, y)
    res["fsdp_peak_none"], res["fsdp_live_none"] = _fsdp_peaks(_shard(build(), mesh), x, y)
    times["fsdp"] = time.perf_counter()

    # a wrapped module that is itself a fully_shard unit (h.0), and one inside a unit
    model = _shard(wrap.apply(build(), ["h.0", "h.1.mlp"]), mesh)
    with RecomputeCounter() as seen:
        step(model, x, y)
    res["unit_recomputed"] = seen.missing(["h.0", "h.1.mlp"])
    res["unit_grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    res["unit_classes"] = {p: type(model.get_submodule(p)).__name__ for p in ("h.0", "h.1.mlp")}
    try:
        autoremat.remove(model)
        res["remove_error"] = None
    except ValueError as e:
        res["remove_error"] = str(e)
    res["after_remove"] = list(autoremat.wrap.wrapped_paths(model))

    # the other order: fully_shard first, then apply (the plan's structure check looks
    # through FSDP's classes), then remove
    model = _shard(build(), mesh)
    plan.apply(model)
    res["apply_after_shard_wrapped"] = sorted(autoremat.wrap.wrapped_paths(model))
    res["apply_after_shard_class"] = type(model.h[0]).__name__
    step(model, x, y)
    res["apply_after_shard_grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    autoremat.remove(model)
    res["apply_after_shard_removed"] = list(autoremat.wrap.wrapped_paths(model))
    res["apply_after_shard_restored"] = type(model.h[0]).__name__
    times["end"] = time.perf_counter()
    res["seconds"] = {k: v - times["start"] for k, v in times.items()}

    torch.save(res, out / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Run :func:`_worker` on 2 processes; their results, by rank."""
    out = tmp_path_factory.mktemp("distributed")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [open(out / f"log{r}.txt", "w") for r in range(WORLD)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), str(out)], env=env, stdout=log, stderr=log
        )
        for r, log in enumerate(logs)
    ]
    deadline = time.monotonic() + TIMEOUT
    hung = False
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            hung = True
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for log in logs:
        log.close()
    text = "\n".join(
        f"--- rank {r} (exit {p.returncode}) ---\n{(out / f'log{r}.txt').read_text()[-4000:]}"
        for r, p in enumerate(procs)
    )
    if hung:
        pytest.fail(f"the 2-process run did not finish in {TIMEOUT} s (a hang?)\n{text}")
    if any(p.returncode != 0 for p in procs):
        pytest.fail(f"a rank failed\n{text}")
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """Gradients of one step of the unwrapped, unsharded model on the whole batch."""
    model = build()
    step(model, *batch())
    return {n: p.grad for n, p in model.named_parameters()}


def assert_grads(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert list(grads) == list(reference)
    for name, g in grads.items():
        torch.testing.assert_close(g, reference[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.slow
def test_broadcast_plan_gives_every_rank_rank0s_plan(ranks):
    """Every rank gets the budget plan rank 0 made on its own batch (not empty)."""
    plans = [json.loads(r["plan"]) for r in ranks]
    assert plans[0] == plans[1]
    assert plans[0]["strategy"] == "budget" and plans[0]["modules"]
    assert plans[0]["fingerprint"] == fingerprint(build())


def test_broadcast_plan_none_on_src_raises_on_every_rank(ranks):
    for r in ranks:
        assert "rank 0 (the src rank) passed NoneType, not a Plan" in r["none_error"]


def test_broadcast_plan_without_a_fingerprint_raises_on_every_rank(ranks):
    for r in ranks:
        assert "a plan the other ranks cannot load" in r["unfingerprinted_error"]
        assert "fingerprint" in r["unfingerprinted_error"]


def test_broadcast_plan_in_a_group(ranks):
    """In a group of rank 0 alone, rank 0 gets its own plan object back; rank 1, outside the
    group, gets a ValueError instead of a plan."""
    assert ranks[0]["solo"] is True
    assert "rank 1 is not in the group" in ranks[1]["solo"]


def test_broadcast_plan_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        autoremat.broadcast_plan(autoremat.Plan((), "levels", "TinyGPT"))


def test_ddp_gradients_equal_single_process(ranks, reference):
    """(a) Plan on rank 0, broadcast, apply on every rank, then DDP: after one step on
    different data per rank, each rank's gradients equal one step of the unwrapped model on
    the whole batch; ``state_dict`` keys are DDP's ``module.`` + the original ones."""
    modules = json.loads(ranks[0]["plan"])["modules"]
    keys = ["module." + k for k in build().state_dict()]
    for r in ranks:
        assert sorted(r["ddp_wrapped"]) == sorted(modules)
        assert r["ddp_keys"] == keys
        assert_grads(r["ddp_grads"], reference)


def test_fsdp2_gradients_equal_single_process(ranks, reference):
    """(b) Apply the broadcast plan, then ``fully_shard`` each block and the root: the full
    gradients (``DTensor.full_tensor()``) after one step equal the single-process reference;
    the ``state_dict`` keys are the original ones; the classes are FSDP's over autoremat's."""
    modules = json.loads(ranks[0]["plan"])["modules"]
    for r in ranks:
        assert sorted(r["fsdp_wrapped"]) == sorted(modules)
        assert r["fsdp_keys"] == list(build().state_dict())
        assert_grads(r["fsdp_grads"], reference)
        classes = r["fsdp_classes"]
        assert classes[""] == "FSDPTinyGPT"
        for path in modules:
            assert "Checkpointed" in classes[path]


def test_fsdp2_wrapped_unit_trains_and_remove_refuses(ranks, reference):
    """A wrapped module that is itself a ``fully_shard`` unit becomes ``FSDPCheckpointed<Cls>``
    and trains right; :func:`autoremat.remove` then raises a ValueError naming it and changes
    nothing (the module inside a unit included)."""
    for r in ranks:
        assert r["unit_classes"] == {"h.0": "FSDPCheckpointedBlock", "h.1.mlp": "CheckpointedMLP"}
        assert r["unit_recomputed"] == [], f"not recomputed: {r['unit_recomputed']}"
        assert_grads(r["unit_grads"], reference)
        assert "'h.0'" in r["remove_error"] and "fully_shard" in r["remove_error"]
        assert r["after_remove"] == ["h.0", "h.1.mlp"]


def test_fsdp2_plan_applies_after_fully_shard_too(ranks, reference):
    """``plan.apply`` on a model already sharded works: the structure check looks through
    FSDP's classes (``FSDPBlock`` is a ``Block``). Gradients equal the reference, and
    :func:`autoremat.remove` gives FSDP's classes back."""
    plan = autoremat.Plan.from_dict(json.loads(ranks[0]["plan"]))
    for r in ranks:
        assert r["apply_after_shard_wrapped"] == sorted(plan.modules)
        assert_grads(r["apply_after_shard_grads"], reference)
        assert r["apply_after_shard_removed"] == []
        assert r["apply_after_shard_restored"] == "FSDPBlock"


def test_fsdp2_per_rank_peak(ranks):
    """Per-rank peak of an FSDP2 step vs the plan's figures for the unsharded model on one
    rank's batch (``estimated_peak`` with the plan, ``baseline_peak`` without).

    Under FSDP2 each rank's step peak is the unsharded model's peak on the per-rank batch plus
    what FSDP2 allocates during the step (unsharded parameters of the root and of the block
    running, the all-gather buffer of the next block, reduce-scatter buffers), less what the
    sharded gradients save: here the root's plus two blocks' parameter bytes (less 256), with
    and without the plan; asserted between root + 1 and root + 3 blocks. The plan's saving
    carries over (at least 3/4 of it asserted; all of it here). LiveMemory alone misses
    FSDP2's ``resize_`` re-allocations of unsharded parameters."""
    plan = autoremat.Plan.from_dict(json.loads(ranks[0]["plan"]))
    assert plan.estimated_peak is not None and plan.baseline_peak is not None
    model = build()
    block = sum(p.numel() * p.element_size() for p in model.h[0].parameters())
    root = sum(p.numel() * p.element_size() for p in model.parameters()) - len(model.h) * block
    for r in ranks:
        over_plan = r["fsdp_peak_plan"] - plan.estimated_peak
        over_none = r["fsdp_peak_none"] - plan.baseline_peak
        print(
            f"per-rank peak: FSDP2 + plan {r['fsdp_peak_plan']}, FSDP2 {r['fsdp_peak_none']}; "
            f"unsharded on the rank's batch: estimated {plan.estimated_peak}, baseline "
            f"{plan.baseline_peak}; overhead {over_plan} / {over_none}; block {block}, root "
            f"{root}; LiveMemory alone {r['fsdp_live_plan']} / {r['fsdp_live_none']}; "
            f"seconds {r['seconds']}"
        )
        for over in (over_plan, over_none):
            assert root + block < over <= root + 3 * block
        saving = plan.baseline_peak - plan.estimated_peak
        assert r["fsdp_peak_none"] - r["fsdp_peak_plan"] >= 0.75 * saving > 0
        assert r["fsdp_live_plan"] < r["fsdp_peak_plan"]


if __name__ == "__main__":
    _rank, _out = int(sys.argv[1]), Path(sys.argv[2])
    no_recompute_if_asked()
    try:
        _worker(_rank, _out)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # at once: the other rank's collectives then fail instead of waiting

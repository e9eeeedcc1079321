"""Per-rank sizing (``sharding=Sharding(...)``) against real gloo ranks on the CPU.

The parent predicts each rank's whole step on fake tensors (no ranks: FSDP2 is emulated,
DDP priced); then 2 and 4 processes (gloo) build the same models, shard them (DDP, FSDP2 with
``reshard_after_forward`` true and false, ``fully_shard`` per block), run real AdamW steps and
measure one: the storages live before it (shards, optimizer state, inputs), DDP's buckets (a
comm hook reads their sizes) and the step's peak (:class:`ResizeCountingMemory`: tensors, the
``resize_`` with which FSDP2 gathers and frees, and the RNG states checkpoint keeps). Every
rank's figure must equal the prediction to the byte, with the Hugging Face cache on and off.
``fit(world_size=...)``'s batch must measure within the device and the next batch up, at its
lowest plan, beyond it.

(The CPU allocator's own figure is not used: gloo frees some buffers on its own threads,
where the profiler does not follow, so its per-rank totals drift by megabytes.)
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import autoremat
from autoremat.cli.commands import main
from autoremat.core.nested import tensor_bytes
from autoremat.examples import TinyGPT
from autoremat.planning.plan import plan_from_profile, profile_lowest
from autoremat.record.step import train_step
from autoremat.training.rank_emulation import ResizeCountingMemory
from autoremat.training.sharding import Sharding, default_units, sharding_of
from launch_ranks import run_ranks, worker_main

TOKENS = 32
TIMEOUT = 600
pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed/gloo"
)


def build(kind: str) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if kind == "tinygpt":
            return TinyGPT(vocab=256, width=64, layers=4, heads=4, context=TOKENS,
                           dropout=0.1).train()  # fmt: skip
        from transformers import GPT2Config, GPT2LMHeadModel

        cache = kind == "gpt2-cache"
        cfg = GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=256, n_positions=TOKENS,
                         use_cache=cache, bos_token_id=0, eos_token_id=0)  # fmt: skip
        return GPT2LMHeadModel(cfg).train()  # (with the cache on, it fills one in training)


def inputs(kind: str, batch: int, seed: int = 0) -> tuple[tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (batch, TOKENS), generator=g)
    if kind == "tinygpt":
        return (x,), {"targets": torch.roll(x, -1, 1)}
    return (), {"input_ids": x, "labels": x}


def loss_of(kind: str) -> Any:
    return (lambda out: out["loss"]) if kind == "tinygpt" else (lambda out: out.loss)


def _shard(model: torch.nn.Module, case: dict[str, Any], mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if case["sharding"] == "ddp":
        return DistributedDataParallel(model)
    how = {"mesh": mesh, "reshard_after_forward": not case["keep"]}
    if case.get("mp"):
        how["mp_policy"] = bf16_policy()
    for path in case["units"]:
        fully_shard(model.get_submodule(path), **how)
    fully_shard(model, **how)
    return model


def _bucket_bytes(ddp: Any, step: Any) -> int:
    """The bytes of DDP's gradient buckets, read from the buckets a comm hook is handed."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    seen: list[int] = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks bare annotations)
        seen.append(bucket.buffer().nbytes)
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    step()
    return sum(seen)


def _measure(case: dict[str, Any], rank: int, mesh: Any) -> dict[str, int]:
    kind = case["model"]
    model = build(kind)
    if case.get("plan"):
        autoremat.Plan.from_dict(case["plan"]).apply(model)
    m = _shard(model, case, mesh)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    a, k = inputs(kind, case["batch"], seed=rank)
    loss = loss_of(kind)

    def step() -> None:
        train_step(m, a, k, loss)
        opt.step()

    step()
    step()
    for p in m.parameters():
        p.grad = None
    state = [v for s in opt.state.values() for v in s.values()]
    local = [getattr(t, "_local_tensor", t) for t in [*m.parameters(), *m.buffers(), *state]]
    resident = tensor_bytes([local, a, k])
    peaks = []
    for _ in range(3):  # (the least of three: see measured_total)
        with ResizeCountingMemory(rng_states=True) as fb:
            train_step(m, a, k, loss)
        peaks.append(fb.peak)
    with ResizeCountingMemory() as om:
        opt.step()
    grads = tensor_bytes([getattr(p.grad, "_local_tensor", p.grad) for p in m.parameters()
                          if p.grad is not None])  # fmt: skip
    buckets = _bucket_bytes(m, step) if case["sharding"] == "ddp" else 0
    return {"resident": resident, "buckets": buckets, "step": min(peaks), "grads": grads,
            "opt_step": om.peak, "step_max": max(peaks)}  # fmt: skip


def _worker(rank: int, world: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))  # fmt: skip
    mesh = init_device_mesh("cpu", (world,))
    cases = json.loads((out / "cases.json").read_text())
    found = [_measure(case, rank, mesh) for case in cases]
    (out / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def launch(world: int, cases: list[dict[str, Any]], out: Path) -> list[list[dict[str, int]]]:
    """Run :func:`_worker` on ``world`` processes over ``cases``; each rank's figures."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "cases.json").write_text(json.dumps(cases))
    return run_ranks(__file__, world, out, lambda r: [str(r), str(world), str(out)],
                     timeout=TIMEOUT)  # fmt: skip


def measured_total(case: dict[str, Any], seen: dict[str, int], most: bool = False) -> int:
    """A rank's most tensors held at once, as :class:`~autoremat.training.step_memory.StepMemory`
    adds, in the least of three steps (``most``: the most). Under FSDP2 a step now and then holds
    one
    unit's all-gather buffer a little longer, when gloo's own thread drops its last reference
    to it late (seen on 4 ranks: one unit's parameter bytes more, once in a few runs)."""
    step = seen["step_max" if most else "step"]
    return seen["resident"] + seen["buckets"] + max(step, seen["grads"] + seen["opt_step"])


# (strategy, reshard_after_forward=False, FSDP2's bf16 MixedPrecisionPolicy)
SHARDINGS = [("ddp", False, False), ("fsdp2", False, False), ("fsdp2", True, False),
             ("fsdp2", False, True)]  # fmt: skip


def bf16_policy() -> Any:
    """FSDP2 gathering and computing in bf16 from fp32 shards, reducing in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


MODELS = ("tinygpt", "gpt2", "gpt2-cache")


def cases_for(world: int, sized: tuple[str, ...] = ("tinygpt",),
              models: tuple[str, ...] = MODELS) -> list[dict[str, Any]]:  # fmt: skip
    """Each of ``models`` x sharding, with no plan and with a half-budget plan; for the models in
    ``sized`` under FSDP2 also the ``plan(device_memory=...)`` plan for a device between the two
    (which must fit it). The prediction of each rank's step (``predicted``) is made here,
    on fake tensors, with a device (which counts checkpoints' RNG states)."""
    cases = []
    for kind in models:
        model = build(kind)
        a, k = inputs(kind, 4)
        prof = autoremat.profile(model, a, k)
        half = autoremat.plan(model, a, k, budget="50%", objective="flops")
        units = list(default_units(model))
        for sharding, keep, mp in SHARDINGS:
            policy = bf16_policy() if mp else None
            chosen = tuple(units) if mp else None
            how: dict[str, Any] = {"sharding": Sharding(sharding, world, chosen, not keep, policy)}
            plain = autoremat.predict_memory(model, a, k, device_memory="1GiB", **how)
            plans: list[tuple[Any, int | None]] = [(None, None), (half, None)]
            if kind in sized and sharding == "fsdp2" and not keep and not mp:
                least = plan_from_profile(model, prof, profile_lowest(prof))
                lowest = autoremat.predict_memory(model, a, k, plan=least, **how)
                room = (plain.tensors + lowest.tensors) // 2
                fitted = autoremat.plan(model, a, k, device_memory=room, objective="flops",
                                        **how)  # fmt: skip
                plans.append((fitted, room))
            for p, room in plans:
                memory = plain if p is None else autoremat.predict_memory(
                    model, a, k, plan=p, device_memory="1GiB", **how)  # fmt: skip
                cases.append({"model": kind, "sharding": sharding, "keep": keep, "mp": mp,
                              "batch": 4, "units": units, "plan": p.to_dict() if p else None,
                              "predicted": memory.tensors, "room": room})  # fmt: skip
    return cases


def fit_cases(world: int, shardings: tuple[str, ...] = ("ddp", "fsdp2")) -> list[dict[str, Any]]:
    """``fit(sharding=Sharding(s, world))`` on the built-in example for a device of 1.5x its batch-2
    step (``shardings``): the batch found with its plan, and one more at its lowest plan."""
    model = build("tinygpt")
    cases = []
    for sharding in shardings:
        how = {"sharding": Sharding(sharding, world)}
        limit = int(1.5 * autoremat.predict_memory(model, *inputs("tinygpt", 2), **how).tensors)
        found = autoremat.fit(model, lambda b: inputs("tinygpt", b), device_memory=limit, **how)
        a, k = inputs("tinygpt", found.batch + 1)
        prof = autoremat.profile(model, a, k)
        beyond = plan_from_profile(model, prof, profile_lowest(prof))
        units = list(default_units(model))
        for batch, p in ((found.batch, found.plan), (found.batch + 1, beyond)):
            memory = autoremat.predict_memory(model, *inputs("tinygpt", batch), plan=p,
                                              device_memory=limit, **how)  # fmt: skip
            cases.append({"model": "tinygpt", "sharding": sharding, "keep": False,
                          "batch": batch, "units": units, "plan": p.to_dict(), "fit": limit,
                          "next": batch > found.batch,
                          "predicted": memory.tensors})  # fmt: skip
    return cases


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two real ranks, on the built-in example and a GPT-2 whose cache is on (a plan turns it
    off, so both are stepped), fit's batch under FSDP2 only. Four ranks, a GPT-2 built with
    its cache off, and fit under DDP are ``benchmarks/per_rank.py``'s (its table: every case
    to the byte); on two cores they took a minute of the suite."""
    world = 2
    cases = cases_for(world, models=("tinygpt", "gpt2-cache")) + fit_cases(world, ("fsdp2",))
    return world, cases, launch(world, cases, tmp_path_factory.mktemp(f"ranks{world}"))


@pytest.mark.slow
def test_each_ranks_step_is_predicted_to_the_byte(ranks):
    """Every rank's measured whole step equals the prediction made without ranks, to the
    byte, for DDP and FSDP2 (both reshard settings, bf16 gathers), on a built-in example and
    a Hugging Face GPT-2 with its key/value cache off and on (filled in training when no
    plan turns it off), with no plan and with plans (which fit their device)."""
    world, cases, seen = ranks
    for i, case in enumerate(cases):
        for r in range(world):
            got = measured_total(case, seen[r][i])
            name = f"{case['model']} {case['sharding']} keep={case['keep']} mp={case.get('mp')}"
            name += f" plan={bool(case['plan'])} rank {r}"
            assert got == case["predicted"], (name, got, case["predicted"])
            if case.get("room"):
                assert got <= case["room"], name


@pytest.mark.slow
def test_fit_per_rank_finds_the_largest_batch_that_trains(ranks):
    """The batch ``fit(sharding=...)`` finds, with its plan, trains on every
    real rank within the device; the next batch up, even at its lowest plan, does not fit."""
    world, cases, seen = ranks
    fits = [(i, c) for i, c in enumerate(cases) if "fit" in c]
    assert len(fits) == 2
    for i, case in fits:
        for r in range(world):
            got = measured_total(case, seen[r][i])
            assert (got > case["fit"]) == case["next"], (case["sharding"], case["batch"], got)


def test_sharding_is_checked_and_units_default_to_the_blocks():
    """A ``Sharding`` names its ranks; units are the blocks (``_no_split_modules`` for Hugging
    Face, the largest ``ModuleList`` otherwise); a unit must be a submodule."""
    tiny, hf = build("tinygpt"), build("gpt2")
    assert default_units(tiny) == ("h.0", "h.1", "h.2", "h.3")
    assert default_units(hf) == tuple(f"transformer.h.{i}" for i in range(4))
    assert sharding_of(tiny, None) is None
    assert sharding_of(tiny, Sharding("fsdp2", 2)).units == default_units(tiny)
    with pytest.raises(TypeError, match=r"sharding must be an autoremat.Sharding, such as"):
        sharding_of(tiny, "fsdp2")  # type: ignore[arg-type]
    for world in (0, 2.5, True):
        with pytest.raises(ValueError, match="world_size must be a whole number >= 1"):
            Sharding("ddp", world)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sharding must be one of ddp, fsdp2"):
        Sharding("zero3", 2)
    with pytest.raises(ValueError, match=r"\['h.9'\] are not submodules of TinyGPT"):
        sharding_of(tiny, Sharding("fsdp2", 2, units=["h.9"]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="FSDP2's settings"):
        Sharding("ddp", 2, units=("h.0",))
    with pytest.raises(ValueError, match="FSDP2's settings"):
        Sharding("ddp", 2, reshard_after_forward=False)
    with pytest.raises(ValueError, match=r"mp_policy must be a torch\.distributed\.fsdp\.Mixed"):
        Sharding("fsdp2", 2, mp_policy="bf16")


def test_a_model_without_blocks_is_sharded_at_the_root_with_a_warning(caplog):
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    with caplog.at_level("WARNING", logger="autoremat.training.sharding"):
        spec = sharding_of(model, Sharding("fsdp2", 2))
    assert spec is not None and spec.units == ()
    assert "only the root is a unit" in caplog.text and "units=[...]" in caplog.text
    assert "(the root only)" in str(spec)


def test_a_step_that_reads_values_cannot_be_emulated_and_says_what_to_do():
    class Routed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x[x.sum(-1).nonzero().squeeze(-1)].sum()  # (rows chosen by value)

    model, x = Routed(), torch.randn(4, 8)
    with pytest.raises(ValueError, match="Routed's FSDP2 rank cannot be emulated on fake"):
        autoremat.predict_memory(model, (x,), sharding=Sharding("fsdp2", 2))
    assert autoremat.predict_memory(model, (x,), sharding=Sharding("ddp", 2)).buckets > 0


def test_the_emulation_leaves_no_process_group_and_shards_by_the_world():
    """Predicting FSDP2 per rank starts and ends no process group of the caller's, puts
    ``sys.excepthook`` back, and shards: parameters, gradients and the optimizer's state
    per rank halve from 2 to 4 ranks here (every dim 0 divides), the buffers do not."""
    model = build("tinygpt")
    hook = sys.excepthook
    a, k = inputs("tinygpt", 2)
    two, four = (autoremat.predict_memory(model, a, k, sharding=Sharding("fsdp2", n))
                 for n in (2, 4))  # fmt: skip
    assert not dist.is_initialized() and sys.excepthook is hook
    whole = sum(p.numel() * 4 for p in model.parameters())
    assert two.parameters == whole // 2 and four.parameters == whole // 4
    assert two.gradients == 2 * four.gradients
    assert two.buffers == four.buffers == tensor_bytes(list(model.buffers()))
    ddp = autoremat.predict_memory(model, a, k, sharding=Sharding("ddp", 4))
    assert ddp.parameters == ddp.buckets == whole and "per rank: ddp over 4 ranks" in str(ddp)


@pytest.mark.slow
def test_the_fit_command_sizes_one_rank(capsys, tiny):
    """``autoremat fit TARGET --world-size N --sharding S`` prints one rank's batch and memory
    and says it is not checked on a device; ``--world-size`` alone, or ``--sharding`` alone
    (which once sized one rank silently), is one line, status 2."""
    assert main(["fit", tiny, "--device-memory", "2MiB", "--world-size", "4",
                 "--sharding", "fsdp2", "--optimizer", "sgd"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "per rank: fsdp2 over 4 ranks" in out and "parameters (this rank's shards)" in out
    assert "not verified (sized per rank" in out
    assert main(["fit", "mlp", "--device-memory", "48MiB", "--world-size", "4"]) == 2
    assert "--world-size sizes one rank of a job: add --sharding" in capsys.readouterr().err
    assert main(["fit", "mlp", "--device-memory", "48MiB", "--sharding", "fsdp2"]) == 2
    err = capsys.readouterr().err
    assert "--sharding fsdp2 needs --world-size N" in err and len(err.splitlines()) == 1


if __name__ == "__main__":
    _rank, _world, _out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    worker_main(lambda: _worker(_rank, _world, _out))


def test_a_rank_plans_budget_is_the_step_peak_its_rank_step_leaves():
    """``plan(device_memory=..., sharding=fsdp2)``: the plan's budget is the step peak its own
    rank step leaves room for, so its estimated peak is within it and the slack is the rank's
    under the device (the search's limit guessed the gathers from the plan without recompute:
    a user saw "predicted peak 627 KiB (budget 609 KiB)" for a plan that fitted)."""
    model, (a, k) = build("tinygpt"), inputs("tinygpt", 4)
    how: dict[str, Any] = {"sharding": Sharding("fsdp2", 2)}
    plain = autoremat.predict_memory(model, a, k, device_memory="1GiB", **how).tensors
    prof = autoremat.profile(model, a, k)
    least = plan_from_profile(model, prof, profile_lowest(prof))
    lowest = autoremat.predict_memory(model, a, k, plan=least, device_memory="1GiB", **how).tensors
    for room in (lowest + (plain - lowest) // 4, (plain + lowest) // 2):
        made = autoremat.plan(model, a, k, device_memory=room, objective="flops", **how)
        rank = autoremat.predict_memory(model, a, k, plan=made, device_memory=room, **how).tensors
        assert made.estimated_peak is not None and made.budget is not None
        assert rank <= room and made.estimated_peak <= made.budget
        assert made.budget - made.estimated_peak == room - rank


def test_measure_memory_on_a_ranks_model_says_what_it_does_not_see():
    """``measure_memory`` counts one process's step: on a model DDP wraps it misses the
    buckets, on one FSDP2 shards the gathers (``resize_``), so its figure is not the rank's
    (2,279,416 bytes where an FSDP2 rank held 1,787,640, a user found): it warns, naming what
    and ``predict_memory(sharding=...)``; on the plain model it does not."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    from autoremat.training.rank_emulation import fake_world

    a, k = inputs("tinygpt", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (none on the plain model)
        autoremat.measure_memory(build("tinygpt"), a, k, steps=1)
    with fake_world(2):
        sharded = build("tinygpt")
        for block in sharded.h:
            fully_shard(block)
        fully_shard(sharded)
        with pytest.warns(UserWarning, match=r"FSDP's gathers.*not a rank's.*predict_memory"):
            autoremat.measure_memory(sharded, a, k, steps=1)
        # (DDP's step cannot run on the fake group: its comm hook gets nothing back)
        ddp = torch.nn.parallel.DistributedDataParallel(build("tinygpt"))
        said = pytest.warns(UserWarning, match=r"DDP's gradient buckets are not seen")
        with said, pytest.raises(RuntimeError):
            autoremat.measure_memory(ddp, a, k, steps=1)
    assert not dist.is_initialized()

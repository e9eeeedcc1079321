"""The CUDA code path: `measure` through the caching allocator, `profile` and budget plans on a
GPU, and wrapped training steps with dropout (CUDA RNG replay in the recompute).

Skipped without a GPU (CI runs on CPU); ``benchmarks/gpu_run.sh`` runs them on a GPU machine.
Diagnostics are printed: run with ``-rA`` to see them for passing tests too.

What is comparable between CPU and CUDA:

* :class:`~autoremat.record.memory.LiveMemory` counts tensor storage bytes at the dispatcher, so on
  CUDA it gives exactly the CPU figures wherever the same ATen ops run (explicit-matmul attention,
  Linear, LayerNorm, GELU, cross-entropy, convolutions). It differs where CUDA runs other ops:
  dropout (a fused ``native_dropout`` that keeps a bool mask on CUDA; on CPU ``bernoulli_`` into
  a float noise tensor, four times the bytes), ``scaled_dot_product_attention`` (memory-efficient
  or flash attention on CUDA, the math fallback with its attention matrices on CPU) and cuDNN's
  batch norm (a reserve buffer). FLOPs follow the same rule (the flash/efficient backward
  formulas count one matmul more than the math path's backward).
* :class:`~autoremat.record.memory.CudaMemory` (what ``measure`` uses on CUDA) reads the caching
  allocator: every block is rounded up to a multiple of 512 bytes (a 4-byte loss takes 512),
  a large-pool block is not split when less than 1 MiB would be left over, and a kernel's scratch
  buffers and the cuBLAS workspace (allocated once per thread and stream, kept for good) count.
  On a toy model made of whole-MiB tensors it is exact after one warm-up step; on others it is
  at least the tracker's figure and close to it.
"""

from __future__ import annotations

import copy
import gc
import re
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import autoremat
from autoremat import wrap
from autoremat.examples import EXAMPLES
from autoremat.record.memory import LiveMemory
from autoremat.record.snapshot import preserved
from autoremat.record.step import default_loss, leaf_inputs
from autoremat.record.step import train_step as one_step
from conftest import train_step

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"
MiB = 2**20
A = 4 * MiB  # one activation of the toy model, 2048 x 512 float32
W = 1 * MiB  # one weight or weight gradient, 512 x 512 float32
BLOCK = 512  # the CUDA caching allocator's smallest block: a 4-byte scalar takes one
UNIT = 2 * 2048 * 512 * 512  # FLOPs of one forward matmul of the toy model
# one training step's gradients may differ by this much (relative norm) between the wrapped and
# the plain model on CUDA: some backward kernels add in a nondeterministic order (atomics); a
# dropout mask drawn again differently moves them by far more (checked by the control test)
GRAD_RTOL = 1e-4


# --------------------------------------------------------------------------- helpers


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


def example(name: str, device: str | None = None) -> tuple[nn.Module, tuple, dict]:
    """An example of :data:`EXAMPLES` and its inputs on ``device`` (default: the GPU);
    ``gpt2-nodrop`` is ``gpt2`` with every dropout probability set to 0 (dropout is the one op
    of that model that CUDA runs differently: see the module docstring)."""
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    device = device or DEVICE
    model, args, kwargs = EXAMPLES[name.removesuffix("-nodrop")]()
    if name.endswith("-nodrop"):
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
    return model.to(device), to_device(args, device), to_device(kwargs, device)


def linear() -> nn.Linear:
    return nn.Linear(512, 512, bias=False)


def two_blocks() -> nn.Sequential:
    """The toy model of tests/test_measure.py: two (Linear, ReLU, Linear, ReLU) blocks."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        blocks = nn.Sequential(
            *(nn.Sequential(linear(), nn.ReLU(), linear(), nn.ReLU()) for _ in range(2))
        )
    return blocks.to(DEVICE)


def batch() -> torch.Tensor:
    return torch.randn(2048, 512, generator=torch.Generator().manual_seed(1)).to(DEVICE)


def live_step(model: nn.Module, args: tuple, kwargs: dict | None = None) -> tuple[int, int]:
    """(peak, saved) of one training step by the storage tracker, on whatever device."""
    inputs = leaf_inputs(args, kwargs)
    with preserved(model, inputs), LiveMemory() as memory:
        forward_ends = lambda: memory.snapshot("forward")  # noqa: E731
        one_step(model, args, kwargs, default_loss, after_forward=forward_ends)
    return memory.peak, memory.marks["forward"]


def settle() -> None:
    """Free garbage before a measurement: a free during the step would hide allocations."""
    gc.collect()
    torch.cuda.synchronize()


def warm_up(model: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
    """One step, so that cuBLAS has its workspaces for the forward thread and the autograd
    device thread (allocated on first use, kept for good, counted by the allocator)."""
    inputs = leaf_inputs(args, kwargs)
    with preserved(model, inputs):
        one_step(model, args, kwargs, default_loss)
    settle()


def relative_error(g: torch.Tensor, reference: torch.Tensor) -> float:
    norm = float(reference.double().norm())
    diff = float((g.double() - reference.double()).norm())
    return diff / norm if norm else diff


def step_differences(
    reference: nn.Module, other: nn.Module, args: tuple, kwargs: dict, seed: int = 1
) -> tuple[float, dict[str, float], list[str]]:
    """One step of each from the same seed: relative loss difference, each parameter
    gradient's relative error, and the buffers that differ afterwards."""
    loss_ref = train_step(reference, args, kwargs, seed)
    loss = train_step(other, args, kwargs, seed)
    errors = {}
    for (name, p), (name2, q) in zip(
        reference.named_parameters(), other.named_parameters(), strict=True
    ):
        assert name == name2
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            errors[name] = relative_error(q.grad, p.grad)
    assert errors, "no parameter received a gradient: the comparison would be vacuous"
    moved = [
        name
        for (name, b), (_, c) in zip(reference.named_buffers(), other.named_buffers(), strict=True)
        if not torch.equal(b, c)
    ]
    return relative_error(loss, loss_ref), errors, moved


def assert_same_step(reference: nn.Module, other: nn.Module, args: tuple, kwargs: dict) -> None:
    loss_error, errors, moved = step_differences(reference, other, args, kwargs)
    worst = max(errors, key=errors.__getitem__)
    print(f"loss rel. error {loss_error:.2e}; worst grad {worst}: {errors[worst]:.2e}")
    assert loss_error <= 1e-6, loss_error
    bad = {n: e for n, e in errors.items() if e > GRAD_RTOL}
    assert not bad, f"{len(bad)}/{len(errors)} gradients differ: {sorted(bad.items())[:5]}"
    assert not moved, f"buffers differ after a step: {moved}"


# --------------------------------------------------------------------------- measure


def test_measure_on_cuda_is_exact_on_whole_mib_tensors():
    """tests/test_measure.py's figures, through the allocator: every activation (4 MiB) and
    weight gradient (1 MiB) is a whole number of blocks; the loss and the ones backward starts
    from take one 512-byte block each. After a warm-up step nothing else is allocated."""
    model, x = two_blocks(), batch()
    warm_up(model, (x,))
    plain = autoremat.measure(model, (x,))
    print(f"plain: {plain}")
    assert plain.saved == 4 * A + BLOCK, plain.saved - (4 * A + BLOCK)
    assert plain.peak == 6 * A + W + 2 * BLOCK, plain.peak - (6 * A + W + 2 * BLOCK)
    assert plain.flops == 11 * UNIT
    assert plain.seconds > 0

    wrap.apply(model, ["0"])  # block 0 recomputed: m0 no longer held, its recompute on top
    try:
        warm_up(model, (x,))
        ckpt = autoremat.measure(model, (x,))
    finally:
        wrap.remove(model)
    print(f"block 0 recomputed: {ckpt}")
    assert ckpt.saved == 3 * A + BLOCK, ckpt.saved - (3 * A + BLOCK)
    assert ckpt.peak == 5 * A + 2 * W + 2 * BLOCK, ckpt.peak - (5 * A + 2 * W + 2 * BLOCK)
    assert ckpt.flops == 13 * UNIT


def test_measure_leaves_a_cuda_model_as_found():
    model, args, kwargs = example("cnn")  # BatchNorm statistics and dropout
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.cuda.get_rng_state()
    m = autoremat.measure(model, args, kwargs, repeats=2)
    assert m.peak >= m.saved > 0 and m.flops > 0 and m.seconds > 0
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.cuda.get_rng_state(), rng)


@pytest.mark.parametrize("name", ["gpt2-nodrop", "mlp", "gpt2", "cnn"])
def test_tracker_on_cuda_matches_cpu_and_the_allocator_is_close(name):
    """The storage tracker sees the same bytes on CUDA as on CPU where the same ops run (no
    dropout, no batch norm); fewer with dropout (bool masks); within 1% with cuDNN batch norm.
    The allocator's figures are at least the tracker's (every storage is a block) and, without
    cuDNN (whose convolutions take workspaces from the allocator), within 10% + 1 MiB of them."""
    cpu = autoremat.measure(*example(name, "cpu"))
    model, args, kwargs = example(name)
    warm_up(model, args, kwargs)
    live_peak, live_saved = live_step(model, args, kwargs)
    settle()
    alloc = autoremat.measure(model, args, kwargs)
    print(
        f"{name}: cpu tracker peak {cpu.peak} saved {cpu.saved}; cuda tracker peak {live_peak} "
        f"saved {live_saved}; cuda allocator peak {alloc.peak} saved {alloc.saved} "
        f"(+{(alloc.peak - live_peak) / MiB:.3f} MiB, {alloc.peak / live_peak - 1:+.2%})"
    )
    if name == "cnn":  # cuDNN batch norm may keep a reserve buffer per layer
        assert abs(live_peak - cpu.peak) <= 0.01 * cpu.peak
        assert abs(live_saved - cpu.saved) <= 0.01 * cpu.saved
    elif name == "gpt2":  # dropout keeps bool masks on CUDA, float noise on CPU
        assert live_saved < cpu.saved
    else:
        assert (live_peak, live_saved) == (cpu.peak, cpu.saved)
    assert alloc.flops == cpu.flops
    assert live_peak <= alloc.peak and live_saved <= alloc.saved
    if name != "cnn":
        assert alloc.peak <= 1.10 * live_peak + MiB
        assert alloc.saved <= 1.10 * live_saved + MiB


# --------------------------------------------------------------------------- profile


@pytest.mark.parametrize("name", ["gpt2-nodrop", "mlp", "cnn"])
def test_profile_on_cuda_gives_the_cpu_bytes_and_flops(name):
    """Per node: forward FLOPs, saved bytes, what recompute frees, calls, parameters and the
    timeline, all as on CPU; in the CNN only BatchNorm nodes (cuDNN's reserve) and dropout
    (a bool mask) may save other bytes."""
    cpu = autoremat.profile(*example(name, "cpu"))
    cuda = autoremat.profile(*example(name))
    assert cuda.device == "cuda"
    assert [c.path for c in cuda] == [c.path for c in cpu]
    differ = []
    for c in cpu:
        g = cuda[c.path]
        assert (g.flops, g.calls, g.param_bytes, g.start, g.end) == (
            c.flops,
            c.calls,
            c.param_bytes,
            c.start,
            c.end,
        ), c.path
        if g.own_saved != c.own_saved:
            differ.append((c.path, type(cuda.tree.find(c.path).module).__name__))
    print(f"{name}: nodes whose own saved bytes differ on CUDA: {differ}")
    if name == "cnn":
        assert all("BatchNorm" in kind or "Dropout" in kind for _, kind in differ), differ
        assert abs(cuda.peak - cpu.peak) <= 0.01 * cpu.peak
    else:
        assert not differ, differ
        for c in cpu:
            g = cuda[c.path]
            assert (g.saved, g.freed, g.recompute_peak, g.runs) == (
                c.saved,
                c.freed,
                c.recompute_peak,
                c.runs,
            ), c.path
        assert cuda.peak == cpu.peak
        assert cuda.points == cpu.points


def test_profile_of_hf_gpt2_on_cuda():
    """scaled_dot_product_attention runs a fused kernel on CUDA (the math fallback on CPU, which
    keeps the attention matrices): the same forward FLOPs, fewer saved bytes."""
    cpu = autoremat.profile(*example("hf-gpt2", "cpu"))
    cuda = autoremat.profile(*example("hf-gpt2"))
    print(
        f"hf-gpt2 saved: cpu {cpu[''].saved / MiB:.2f} MiB, cuda {cuda[''].saved / MiB:.2f} MiB; "
        f"forward GFLOP cpu {cpu[''].flops / 1e9:.4f}, cuda {cuda[''].flops / 1e9:.4f}"
    )
    assert [c.path for c in cuda] == [c.path for c in cpu]
    assert abs(cuda[""].flops - cpu[""].flops) <= 0.005 * cpu[""].flops
    assert 0 < cuda[""].saved <= cpu[""].saved


# --------------------------------------------------------------------------- budget plans

_plans: dict[str, tuple[nn.Module, tuple, dict, autoremat.Plan]] = {}


def budget_plan(name: str, fraction: float = 0.5) -> tuple[nn.Module, tuple, dict, Any]:
    """A budget plan made on CUDA (the lowest feasible budget when ``fraction`` is not)."""
    if name not in _plans:
        model, args, kwargs = example(name)
        try:
            plan = autoremat.plan(model, args, kwargs, budget=fraction)
        except ValueError as exc:
            found = re.search(r"Try budget=(\d+)", str(exc))
            assert found, exc
            plan = autoremat.plan(model, args, kwargs, budget=int(found.group(1)))
        _plans[name] = (model, args, kwargs, plan)
    return _plans[name]


BUDGET_MODELS = ["gpt2", "cnn", "hf-gpt2", "hf-llama"]


@pytest.mark.parametrize("name", BUDGET_MODELS)
def test_budget_plan_on_cuda_meets_its_budget_in_storage_bytes(name):
    """The planner's own contract, on CUDA: the step's storage peak fits the budget and the
    estimate is within 10% of it; one step trains exactly as the plain model."""
    model, args, kwargs, plan = budget_plan(name)
    assert plan.modules and plan.estimated_peak is not None and plan.budget is not None
    wrapped = plan.apply(copy.deepcopy(model))
    peak, _ = live_step(wrapped, args, kwargs)
    print(
        f"{name}: budget {plan.budget} B, estimated {plan.estimated_peak}, storage peak {peak} "
        f"({(plan.estimated_peak - peak) / peak:+.2%}), no recompute {plan.baseline_peak}; "
        f"{len(plan.modules)} entries: {plan.modules[:4]}"
    )
    assert peak <= plan.budget
    assert abs(plan.estimated_peak - peak) <= 0.1 * peak
    assert_same_step(copy.deepcopy(model), wrapped, args, kwargs)


# Known gap, measured on an H200 (torch 2.11): the planner counts tensor storages; the allocator
# also hands out scratch memory inside ops (cuDNN convolution workspaces in the recompute, small
# blocks rounded up) that no op returns. At a budget 1 KiB above the estimate, gpt2 went
# 0.2 MB over (allocator +0.5 MB over the storages) and cnn 6.1 MB over (+6.1 MB);
# hf-gpt2 and hf-llama stayed within.
_SCRATCH = pytest.mark.xfail(
    reason="allocator scratch inside ops is not in the storage-byte profile", strict=False
)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=_SCRATCH) if n in ("gpt2", "cnn") else n for n in BUDGET_MODELS],
)
def test_budget_plan_on_cuda_meets_its_budget_in_allocator_bytes(name):
    """What a user sees (torch.cuda.max_memory_allocated, through measure): the applied plan's
    peak fits the budget and the estimate is within 10% of it. The allocator rounds blocks and
    counts scratch buffers the planner does not see (the message gives the gap)."""
    model, args, kwargs, plan = budget_plan(name)
    wrapped = plan.apply(copy.deepcopy(model))
    warm_up(wrapped, args, kwargs)
    live_peak, _ = live_step(wrapped, args, kwargs)
    settle()
    measured = autoremat.measure(wrapped, args, kwargs).peak
    baseline = autoremat.measure(model, args, kwargs).peak
    text = (
        f"{name}: budget {plan.budget} B, estimated {plan.estimated_peak}, allocator peak "
        f"{measured} ({(plan.estimated_peak - measured) / measured:+.2%} estimate error, "
        f"{measured - plan.budget:+d} B over the budget), storage peak {live_peak} (allocator "
        f"{measured - live_peak:+d} B over it); no recompute: allocator {baseline}, planner "
        f"{plan.baseline_peak}"
    )
    print(text)
    assert measured <= plan.budget, text
    assert abs(plan.estimated_peak - measured) <= 0.1 * measured, text


# --------------------------------------------------------------------------- RNG replay


def test_dropout_is_active_on_cuda():
    """Guards the tests below: two seeds give two losses on CUDA, so equal gradients under one
    seed mean the recompute replayed the forward's masks."""
    model, args, kwargs = example("gpt2")
    assert train_step(model, args, kwargs, seed=1) != train_step(model, args, kwargs, seed=2)


@pytest.mark.parametrize("segments", [3, 8])
@pytest.mark.parametrize("name", ["gpt2", "hf-gpt2", "cnn", "hf-llama"])
def test_wrapped_training_step_identical_on_cuda(name, segments):
    """Loss, gradients and buffers of one step (two in a row) equal the plain model's on CUDA,
    with dropout (CUDA RNG) and BatchNorm active."""
    model, args, kwargs = example(name)
    reference = copy.deepcopy(model)
    plan = autoremat.plan(model, args, kwargs, segments=segments)
    assert plan.modules
    plan.apply(model)
    print(f"{name} segments={segments}: {plan.modules}")
    assert_same_step(reference, model, args, kwargs)
    assert_same_step(reference, model, args, kwargs)


@pytest.mark.parametrize("name", ["gpt2", "hf-gpt2", "hf-llama"])
def test_every_selective_way_trains_identically_on_cuda(name):
    """Every block recomputed in each selective way (the kept ops' outputs cached, random ops
    replayed), on CUDA: same loss, gradients and buffers as the plain model."""
    from autoremat.core.selective import WAYS

    for way, ops in WAYS.items():
        model, args, kwargs = example(name)
        reference = copy.deepcopy(model)
        entries = [
            e for e in autoremat.plan(model, args, kwargs, segments=8).modules if "[" not in e
        ]
        wrap.apply(model, entries, selective=dict.fromkeys(entries, ops))
        print(f"{name} {way}: {entries}")
        assert_same_step(reference, model, args, kwargs)


def test_profile_times_ops_on_cuda_and_prices_plans_by_time():
    """Op times (synchronised around each op) and per-op overheads on CUDA are positive; a
    time-priced budget plan reports its seconds and meets its budget in storage bytes."""
    from autoremat.record.timing import overheads

    full, selective = overheads(torch.device(DEVICE))
    assert 0 < full <= selective
    model, args, kwargs = example("hf-gpt2")
    prof = autoremat.profile(model, args, kwargs)
    assert prof[""].op_seconds > 0 and prof.op_overhead == full
    plan = autoremat.plan(model, args, kwargs, budget=0.6)
    print(plan.summary())
    assert plan.objective == "time" and plan.recompute_seconds > 0
    plan.apply(model)
    assert autoremat.measure(model, args, kwargs, repeats=1).peak > 0


class KeywordDropout(nn.Module):
    """A module that receives its only tensor by keyword, as Hugging Face Llama's self_attn."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 256)
        self.drop = nn.Dropout(0.5)

    def forward(self, *, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x))


class CallsByKeyword(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.inner = KeywordDropout()
        self.head = nn.Linear(256, 1)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:  # torch's checkpoint alone, the tensor passed by keyword
            y = checkpoint(self.inner, use_reentrant=False, x=x)
        else:
            y = self.inner(x=x)
        return self.head(y)


def keyword_model(checkpointed: bool = False) -> CallsByKeyword:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return CallsByKeyword(checkpointed).to(DEVICE)


def test_torch_checkpoint_alone_redraws_dropout_for_keyword_tensors_on_cuda():
    """The trap autoremat avoids: torch's checkpoint saves the CUDA RNG state only for the
    devices of its positional tensors, so with the tensor passed by keyword the recompute draws
    another dropout mask and the gradient of the layer before the dropout is wrong."""
    x = torch.randn(64, 256, device=DEVICE)
    _, errors, _ = step_differences(keyword_model(), keyword_model(checkpointed=True), (x,), {})
    print(f"torch checkpoint with a keyword tensor: grad errors {errors}")
    assert errors["inner.lin.weight"] > 0.1  # a different mask, not rounding
    assert errors["head.weight"] < GRAD_RTOL  # the forward itself was right


def test_autoremat_replays_dropout_for_keyword_tensors_on_cuda():
    x = torch.randn(64, 256, device=DEVICE)
    model = keyword_model()
    wrap.apply(model, ["inner"])
    assert_same_step(keyword_model(), model, (x,), {})


def test_hf_llama_self_attention_wrapped_on_cuda():
    """Llama's decoder layer calls self_attn with keyword tensors only; attention dropout runs
    inside scaled_dot_product_attention on the CUDA RNG."""
    model, args, kwargs = example("hf-llama")
    reference = copy.deepcopy(model)
    paths = [p for p, _ in model.named_modules() if p.endswith("self_attn")]
    assert paths
    wrap.apply(model, paths)
    assert_same_step(reference, model, args, kwargs)


# --------------------------------------------------------------------------- benchmark harness


def test_bench_compare_on_cuda():
    """The harness benchmarks/gpu_bench.py relies on: every strategy trains as the baseline does,
    and the allocator's peaks fall with recompute."""
    from autoremat import comparison as bench

    model, args, kwargs = example("gpt2")
    rows = bench.compare(
        model,
        args,
        kwargs,
        [bench.no_recompute(), bench.every_block(), bench.levels_plan(3), bench.budget_plan(0.5)],
        repeats=2,
        name="gpt2",
    )
    print(bench.to_markdown(rows))
    by = {r.strategy: r for r in rows}
    assert {"none", "every block", "budget 50%"} <= set(by)
    for r in rows:
        assert r.grads_match, (r.strategy, r.note)
        assert r.peak is not None and r.seconds is not None and r.seconds > 0
    assert by["every block"].peak < by["none"].peak
    assert by["budget 50%"].peak < by["none"].peak

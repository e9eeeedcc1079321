"""Every plan kind under ``torch.compile`` (issue 16): whole modules, runs of a Sequential's
children, selective entries (both ways, and per-entry ops), and the planner's own budget plans.

Each compiles with ``fullgraph=True`` to one graph with one ``tag_activation_checkpoint``
region per plan entry, each of which the compiled backward graph runs again
(:func:`conftest.recomputed_regions`: a wrap that recomputed nothing fails) (backend
``aot_eager``: dynamo, AOTAutograd and the min-cut partitioner inductor uses, without
inductor's cold compile; one test runs inductor itself), and its loss
and gradients equal the compiled unwrapped model's, dropout on. Under ``aot_eager`` the random
ops run as eager ops in the forward graph and the partitioner never recomputes a random op
(it saves the mask), so the comparison is bitwise; under inductor it is equal up to float
rounding (other fusions) with ``torch._inductor.config.fallback_random`` (inductor's own
generator draws other numbers than eager PyTorch, with or without autoremat).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import autoremat
from autoremat.core.selective import WAYS
from autoremat.examples import Block, ConvNet, TinyGPT
from autoremat.wrap.wrapping import apply
from conftest import (
    aot_eager_keeping_backward,
    inductor_keeping_backward,
    loss_of,
    recomputed_regions,
    tiny_llama,
)


class Stack(nn.Module):
    """Three transformer blocks (attention, MLP, LayerNorm, dropout) in an ``nn.Sequential``,
    so plans can hold runs of its children, and a head."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width, 2, 0.1) for _ in range(3)))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).pow(2).mean()


PLANS: dict[str, dict[str, Any]] = {
    "whole": {"paths": ["blocks.0", "blocks.1.attn", "blocks.2.mlp"]},
    "runs": {"paths": ["blocks[0:2]", "blocks.2"]},
    "selective": {"paths": ["blocks.0", "blocks.1"], "selective": ["blocks.0", "blocks.1"]},
    "selective-bmm": {
        "paths": ["blocks.0", "blocks.2.attn"],
        "selective": {"blocks.0": WAYS["selective-bmm"], "blocks.2.attn": WAYS["selective-bmm"]},
    },
    "mixed": {
        "paths": ["blocks[0:2]", "blocks.2.attn", "blocks.2.mlp"],
        "selective": {"blocks.2.attn": ("aten.bmm",), "blocks.2.mlp": ("aten.addmm",)},
    },
}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    """Each test compiles from scratch: dynamo's caches (and its recompile limit, past which it
    would silently run eagerly) start empty."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _step(model: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, list]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = loss_of(model(*args, **kwargs))
    loss.backward()
    params = model.parameters() if not hasattr(model, "_orig_mod") else model._orig_mod.parameters()
    return loss.detach(), [p.grad for p in params]


def _assert_equal(step: tuple, reference: tuple, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Same loss and gradients: bitwise by default. (Other dropout masks would differ by far
    more than any tolerance used here.)"""
    torch.testing.assert_close(step[0], reference[0], rtol=rtol, atol=atol)
    assert len(step[1]) == len(reference[1])
    assert any(g is not None for g in step[1])
    for g, h in zip(step[1], reference[1], strict=True):
        assert (g is None) == (h is None)
        if g is not None:
            torch.testing.assert_close(g, h, rtol=rtol, atol=atol)


def _compiled_once(model: nn.Module, backend: Any = None) -> tuple[nn.Module, Any, list]:
    """``torch.compile(model, fullgraph=True)`` through a counting backend (by default
    ``aot_eager``), and the backward graphs it makes (for :func:`recomputed_regions`; empty
    for a backend given)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    backward: list = []
    if backend is None:
        backend, backward = aot_eager_keeping_backward()
    counter = CompileCounterWithBackend(backend)
    return torch.compile(model, backend=counter, fullgraph=True), counter, backward


def _regions(counter: Any) -> int:
    return sum(
        node.target is torch.ops.higher_order.tag_activation_checkpoint
        for gm in counter.graphs
        for node in gm.graph.nodes
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(PLANS))
def test_every_plan_kind_compiles_to_one_graph_with_exact_gradients(kind: str) -> None:
    torch.manual_seed(0)
    reference = Stack()
    x = torch.randn(2, 8, 32)
    model = copy.deepcopy(reference)
    spec = PLANS[kind]
    apply(model, spec["paths"], selective=spec.get("selective", ()))

    compiled, counter, backward = _compiled_once(model)
    step = _step(compiled, (x,), {})
    assert counter.frame_count == 1  # fullgraph=True: a graph break would have raised
    # one region per recomputed call: a run is one region, a module one; each recomputed
    assert _regions(counter) == len(spec["paths"]) == recomputed_regions(backward)

    expected = _step(torch.compile(copy.deepcopy(reference), backend="aot_eager"), (x,), {})
    _assert_equal(step, expected)
    _assert_equal(_step(model, (x,), {}), _step(reference, (x,), {}))  # eager too


@pytest.mark.slow
def test_the_planners_selective_budget_plan_compiles() -> None:
    """The issue's case: a budget plan with selective entries (the default ``selective=True``),
    made by :func:`autoremat.plan`, compiles with ``fullgraph=True`` on the GPT-shaped model."""
    torch.manual_seed(0)
    reference = TinyGPT(vocab=64, width=32, layers=3, heads=2, context=64)
    idx = torch.randint(0, 64, (2, 64))
    model = copy.deepcopy(reference)
    plan = autoremat.plan(model, (idx, idx), budget="50%", objective="flops")
    assert plan.selective, f"the plan has no selective entry, the test would be vacuous: {plan}"
    plan.apply(model)

    compiled, counter, backward = _compiled_once(model)
    step = _step(compiled, (idx, idx), {})
    assert counter.frame_count == 1
    assert _regions(counter) == len(plan.modules) == recomputed_regions(backward)
    _assert_equal(step, _step(torch.compile(reference, backend="aot_eager"), (idx, idx), {}))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mixed"])
def test_plan_kinds_compile_under_inductor_with_exact_gradients(kind: str) -> None:
    """Inductor itself, on a plan mixing a run, whole modules and selective entries (each kind
    under inductor cold-compiles for 10-60 s here, so the suite runs this one, which holds the
    others' entries; all five kinds passed by hand), with ``fallback_random`` (eager dropout
    masks): one graph, one region per entry, equal to the compiled unwrapped model up to float
    rounding (the two graphs fuse differently; measured: relative error below 1e-6)."""
    torch.manual_seed(0)
    reference = Stack(width=16)
    x = torch.randn(2, 4, 16)
    model = copy.deepcopy(reference)
    spec = PLANS[kind]
    apply(model, spec["paths"], selective=spec.get("selective", ()))
    with torch._inductor.config.patch(fallback_random=True):
        with inductor_keeping_backward() as backward:
            compiled, counter, _ = _compiled_once(model, "inductor")
            step = _step(compiled, (x,), {})
        expected = _step(torch.compile(copy.deepcopy(reference)), (x,), {})
    assert counter.frame_count == 1
    assert _regions(counter) == len(spec["paths"]) == recomputed_regions(backward)
    _assert_equal(step, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_hugging_face_budget_plan_compiles() -> None:
    """Hugging Face Llama (attention dropout on) with a selective 50% plan: compiles (graph
    breaks allowed: transformers decides that) and trains exactly as compiled unwrapped."""
    reference, ids = tiny_llama()
    kwargs = {"input_ids": ids, "labels": ids}
    model = copy.deepcopy(reference)
    plan = autoremat.plan(model, (), kwargs, budget="50%", objective="flops")
    assert plan.selective, f"the plan has no selective entry, the test would be vacuous: {plan}"
    plan.apply(model)
    backend, backward = aot_eager_keeping_backward()
    step = _step(torch.compile(model, backend=backend), (), kwargs)
    assert recomputed_regions(backward) == len(plan.modules)
    _assert_equal(step, _step(torch.compile(reference, backend="aot_eager"), (), kwargs))


@pytest.mark.slow
@pytest.mark.parametrize("selective", [False, True])
def test_batchnorm_statistics_move_once_under_compile(selective: bool) -> None:
    """BatchNorm in recomputed entries (a whole stage, a run of conv-BN-ReLU pairs), compiled:
    the recompute in the backward graph does not move the running statistics a second time
    (AOTAutograd writes buffer mutations back once, from the forward), so after a step the
    buffers equal the compiled unwrapped model's, and the gradients too."""
    torch.manual_seed(0)
    reference = ConvNet(widths=(4, 8))
    x = torch.randn(2, 3, 16, 16)
    model = copy.deepcopy(reference)
    apply(
        model,
        ["features.0", "features.1[0:2]"],
        selective=["features.0"] if selective else (),
    )
    compiled, counter, backward = _compiled_once(model)
    step = _step(compiled, (x,), {})
    assert counter.frame_count == 1 and _regions(counter) == 2 == recomputed_regions(backward)
    expected_model = copy.deepcopy(reference)
    _assert_equal(step, _step(torch.compile(expected_model, backend="aot_eager"), (x,), {}))
    moved = 0
    for (name, b), (_, c) in zip(
        expected_model.named_buffers(), model.named_buffers(), strict=True
    ):
        assert torch.equal(c, b), name
        moved += int(not torch.equal(b, dict(reference.named_buffers())[name]))
    assert moved > 0  # the statistics did move: the comparison is not vacuous


# --- measuring and planning a compiled model --------------------------------------------------


def _counting_calls() -> tuple[Any, list[int]]:
    """A dynamo backend (eager) that counts the calls of the graphs it compiled."""
    calls = [0]

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        def run(*args: Any) -> Any:
            calls[0] += 1
            return gm.forward(*args)

        return run

    return backend, calls


@pytest.mark.slow
def test_measure_and_plan_leave_a_compiled_model_compiled() -> None:
    """Dynamo skips, for good, code it meets while a dispatch mode is active (pytorch#190286):
    ``measure`` (FlopCounterMode) and ``plan`` (the profiler's modes) must run a compiled model
    eagerly instead, so that afterwards its compiled graph runs again."""
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(8, 64, 32)
    backend, calls = _counting_calls()
    compiled = torch.compile(model, backend=backend)
    compiled(x).backward()
    assert calls[0] == 1
    autoremat.measure(compiled, (x,))
    autoremat.plan(compiled, (x,), budget="75%", objective="flops")
    autoremat.plan(compiled, (x,), segments=2)
    before = calls[0]
    compiled(x).backward()
    assert calls[0] == before + 1, "the compiled graph no longer runs"


def test_the_cpu_allocator_tracker_agrees_with_the_storage_tracker_on_an_eager_step() -> None:
    """:class:`CpuAllocatorMemory` (the profiler's allocator events) and :class:`LiveMemory`
    (storages the ops return) on the same eager step: the same peak and saved bytes within 1%
    (the allocator also sees kernels' scratch memory and 0-d temporaries)."""
    torch.manual_seed(0)
    model = Stack(width=64)
    x = torch.randn(4, 16, 64)
    tensors = autoremat.measure(model, (x,), memory="tensors")
    allocator = autoremat.measure(model, (x,), memory="allocator")
    assert allocator.peak == pytest.approx(tensors.peak, rel=0.01)
    assert allocator.saved == pytest.approx(tensors.saved, rel=0.01)
    assert 0 < allocator.saved < allocator.peak


@pytest.mark.slow
def test_a_compiled_model_is_measured_by_the_cpu_allocator() -> None:
    """``measure`` of a compiled model replays the CPU allocator's events (a dispatch mode
    would measure an eager run): two runs agree, and under ``aot_eager`` (eager kernels; the
    compiled graphs free some temporaries earlier) the peak is at most the eager one and not
    far below it. ``memory="tensors"`` is refused for a compiled model."""
    torch.manual_seed(0)
    model = Stack(width=64)
    x = torch.randn(4, 16, 64)
    eager = autoremat.measure(model, (x,), memory="allocator")
    compiled = torch.compile(model, backend="aot_eager")
    compiled(x).backward()  # warm: the compile's own memory is not the step's
    first = autoremat.measure(compiled, (x,))
    second = autoremat.measure(compiled, (x,))
    assert first.peak == second.peak and first.saved == second.saved
    assert 0.8 * eager.peak < first.peak <= 1.01 * eager.peak
    assert 0 < first.saved < first.peak
    assert first.flops == eager.flops  # counted on the model run eagerly
    with pytest.raises(ValueError, match="memory='tensors' cannot measure a compiled model"):
        autoremat.measure(compiled, (x,), memory="tensors")


# --- a budget that holds under compile ---------------------------------------------------------


@pytest.mark.slow
def test_plan_with_compile_measures_the_compiled_step_within_the_budget() -> None:
    """End to end with ``aot_eager`` (``plan(..., compile="aot_eager")``): the plan's compiled
    peak is measured, within the budget, and the model is left unwrapped and as it was."""
    torch.manual_seed(0)
    model = Stack(width=64)
    x = torch.randn(4, 32, 64)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    chosen = autoremat.plan(model, (x,), budget="60%", compile="aot_eager", objective="flops")
    assert chosen.modules and chosen.budget is not None and chosen.compiled_peak is not None
    assert 0 < chosen.compiled_peak <= chosen.budget
    assert not autoremat.wrap.wrapped_paths(model)
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.slow
def test_plans_compiled_while_planning_leave_the_recompile_limit_to_the_user() -> None:
    """Each plan the search compiles is compiled apart (``isolate_recompiles``): planning twice
    compiles past dynamo's recompile limit for the model's code (2 here), every try still
    compiles (none runs eagerly while measured as compiled), and the user's own
    ``torch.compile`` of the model afterwards compiles too. Before, the tries filled the
    limit: later tries, and the user's compile, ran eagerly without a word."""
    torch.manual_seed(0)
    model, x = Stack(width=32), torch.randn(2, 16, 32)
    made = []
    with torch._dynamo.config.patch(recompile_limit=2):
        for budget in ("95%", "80%"):
            before = _graphs()
            plan = autoremat.plan(model, (x,), budget=budget, compile="aot_eager")
            made.append(_graphs() - before)
            assert plan.compiled_peak is not None and plan.compiled_peak <= plan.budget
        assert min(made) > 0
        before = _graphs()
        _step(torch.compile(model, backend="aot_eager"), (x,), {})
        assert _graphs() > before


def test_a_compile_that_compiles_nothing_is_refused_not_measured_eagerly() -> None:
    """Past dynamo's global cap on recompiles of one code (set to 1 here), a try would run its
    step eagerly: ``plan`` raises, naming the fix, instead of measuring that as compiled."""
    model, x = Stack(width=32), torch.randn(2, 16, 32)
    with torch._dynamo.config.patch(accumulated_recompile_limit=1):
        torch.compile(model, backend="aot_eager")(x)  # (the user's compile takes the one)
        with pytest.raises(RuntimeError, match=r"compiled no graph of Stack.*_dynamo\.reset"):
            autoremat.plan(model, (x,), budget="90%", compile="aot_eager")


@pytest.mark.parametrize(
    ("model", "error", "message"),
    [
        (nn.Linear(4, 4), ValueError, "Linear has no submodules that ran"),
        (lambda x: x, TypeError, "model must be a torch.nn.Module, got function"),
    ],
)
def test_plan_with_compile_refuses_what_plan_refuses(model: Any, error: type, message: str):
    """``plan(..., compile=...)`` checks the model as the eager ``plan`` does, before anything
    is compiled: a model with no submodules is no ``BudgetTooLow`` (there is nothing to
    recompute), and one that is no module a ``TypeError``, not an ``AttributeError``."""
    with pytest.raises(error, match=message):
        autoremat.plan(model, (torch.randn(2, 4),), budget="50%", compile="aot_eager")


@pytest.mark.parametrize(
    ("compile", "error", "message"),
    [
        ("nosuch", ValueError, "compile='nosuch' is not a torch.compile backend: .* inductor"),
        (1, TypeError, "compile must be True, False or a torch.compile backend's name"),
    ],
)
def test_plan_refuses_a_compile_that_names_no_backend(compile: Any, error: type, message: str):
    """A ``compile=`` torch does not know is refused by name before the model runs (torch
    itself would raise its own ``InvalidBackend``, a RuntimeError, after the profile)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(error, match=message):
        autoremat.plan(model, (torch.randn(2, 4),), budget="50%", compile=compile)
    assert not calls


@pytest.mark.slow
def test_plan_with_compile_plans_again_below_the_overshoot(monkeypatch: pytest.MonkeyPatch):
    """Each plan the search proposes is judged by its compiled step: when that peaks over the
    budget, the walk's limit falls by the overshoot and the next plan is compiled, until one
    fits; the plan keeps the budget asked for and states the compiled peak. When none fits,
    ``BudgetTooLow`` gives the lowest compiled peak found."""
    from autoremat.planning import compiled_plan as compile_plan
    from autoremat.planning.rehearsal import PlanFields, rehearsal_for

    torch.manual_seed(0)
    model = Stack(width=64)
    x = torch.randn(4, 32, 64)
    eager = autoremat.plan(model, (x,), budget="75%", objective="flops")
    assert eager.budget is not None and eager.estimated_peak is not None
    overshoot = eager.budget // 10
    compiled: list[tuple[str, ...]] = []
    runs = rehearsal_for(autoremat.profile(model, (x,)))

    def fake_peak(model: nn.Module, chosen: PlanFields, *a: Any, **k: Any) -> int:
        compiled.append(chosen.modules)
        eager_peak = runs.peak(chosen) if chosen.modules else eager.baseline_peak
        # the first plan compiled overshoots by 10% of the budget; the others as eager
        return eager_peak + (overshoot if len(compiled) == 1 else 0)  # type: ignore[operator]

    monkeypatch.setattr(compile_plan, "compiled_peak", fake_peak)
    chosen = autoremat.plan(model, (x,), budget="75%", objective="flops", compile=True)
    assert len(compiled) >= 2 and compiled[1] != compiled[0]
    assert chosen.budget == eager.budget and chosen.compiled_peak <= eager.budget
    assert chosen.compiled_peak == chosen.estimated_peak
    assert "torch.compile" in (chosen.estimated_by or "")

    monkeypatch.setattr(compile_plan, "compiled_peak", lambda *a, **k: 10 * eager.budget)
    with pytest.raises(autoremat.BudgetTooLow, match="below the lowest compiled peak"):
        autoremat.plan(model, (x,), budget="75%", objective="flops", compile=True)
    with pytest.raises(autoremat.BudgetTooLow, match="below the lowest peak"):  # (eager)
        autoremat.plan(model, (x,), budget=eager.budget // 10)


@pytest.mark.slow
def test_in_place_relu_inside_selective_entries_under_compile() -> None:
    """conv -> BatchNorm -> ReLU(inplace=True) blocks recomputed selectively, compiled: torch
    warns about in-place ops in a ``context_fn`` region; loss, gradients and statistics still
    equal the compiled unwrapped model's (an in-place op on a tensor made inside the region)."""

    def block() -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Dropout(0.1)
        )

    torch.manual_seed(0)
    reference = nn.Sequential(block(), block(), nn.Flatten(), nn.Linear(4 * 8 * 8, 1))
    x = torch.randn(2, 4, 8, 8)
    model = copy.deepcopy(reference)
    apply(model, ["0", "1"], selective=["0", "1"])
    compiled, counter, backward = _compiled_once(model)
    step = _step(compiled, (x,), {})
    assert counter.frame_count == 1 and _regions(counter) == 2 == recomputed_regions(backward)
    expected_model = copy.deepcopy(reference)
    _assert_equal(step, _step(torch.compile(expected_model, backend="aot_eager"), (x,), {}))
    for (name, b), (_, c) in zip(
        expected_model.named_buffers(), model.named_buffers(), strict=True
    ):
        assert torch.equal(c, b), name

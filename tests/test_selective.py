"""Selective recompute (issue 6): modules that keep the outputs of their expensive ops and
recompute the rest, priced by the profile and chosen by the budget planner.

Toy model for exact bytes: ``nn.Sequential`` of two blocks ``Linear(512, 512, bias=False), act,
Linear``, fed ``x`` (2048, 512) float32 that does not require grad. Every activation is
2048 x 512 x 4 B = 4 MiB (``A``). In block 0: ``h0 = x @ W0.T``, ``m0 = act(h0)``,
``g0 = m0 @ W1.T`` (the block's output, saved by block 1's first matmul).

* GELU saves its input ``h0``; the second matmul saves ``m0``. Recomputing block 0 whole frees
  ``h0`` and ``m0`` (2A). Selectively it keeps ``h0`` and ``g0`` (matmul outputs): ``g0`` is
  saved anyway, ``h0`` is not freed, so it frees ``m0`` alone (1A), and recomputes only GELU.
* ReLU saves its output ``m0`` and nothing saves ``h0``: whole frees ``m0`` (1A); selectively
  ``m0`` is freed but ``h0``, which was dropped at once, is now kept: it frees nothing.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import autoremat
from autoremat import wrap
from autoremat.examples import EXAMPLES
from autoremat.plan import Plan
from autoremat.selective import DEFAULT_SAVE_OPS, op_name
from conftest import assert_same_step

MiB = 2**20
A = 4 * MiB
MATMUL = 2 * 2048 * 512 * 512  # FLOPs of one forward matmul


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def toy(act: type[nn.Module]) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)

        def block() -> nn.Sequential:
            return nn.Sequential(
                nn.Linear(512, 512, bias=False), act(), nn.Linear(512, 512, bias=False)
            )

        return nn.Sequential(block(), block())


def x() -> torch.Tensor:
    return torch.randn(2048, 512, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    ("act", "full_frees", "selective_frees"), [(nn.GELU, 2 * A, A), (nn.ReLU, A, 0)]
)
def test_profile_prices_selective_recompute_to_the_byte(act, full_frees, selective_frees):
    model = toy(act)
    prof = autoremat.profile(model, (x(),))
    cost = prof["0"]
    assert cost.freeable == full_frees
    assert cost.selective_freeable == selective_frees
    assert cost.flops == 2 * MATMUL and cost.selective_flops == 0
    assert cost.written == 3 * A  # h0, m0, g0
    assert cost.selective_written == A  # m0 alone is written again
    # and the measurement agrees: saved-for-backward bytes (selective's cache included) drop
    # by what the profile said, and FLOPs grow by what it said
    base = autoremat.measure(model, (x(),))
    wrap.apply(model, ["0"])
    full = autoremat.measure(model, (x(),))
    wrap.remove(model)
    wrap.apply(model, ["0"], selective=["0"])
    sel = autoremat.measure(model, (x(),))
    wrap.remove(model)
    assert base.saved - full.saved == full_frees
    assert base.saved - sel.saved == selective_frees
    # (checkpoint's early stop: the whole recompute ends once m0 is back, before the second
    # matmul, whose output nothing saved; the profile counts both matmuls, a safe overestimate)
    assert full.flops - base.flops == MATMUL
    assert sel.flops == base.flops


def test_selective_wrap_keeps_the_matmul_outputs_and_reruns_the_rest(monkeypatch):
    model = toy(nn.GELU)
    wrap.apply(model, ["0"], selective=["0"])
    ran: list[str] = []

    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ran.append(op_name(func))
            return func(*args, **(kwargs or {}))

    loss = model(x()).sum()
    with Log():
        loss.backward()
    # the backward of block 0 reran GELU but not its matmuls: exactly two forward mm calls in
    # backward would be the recompute; backward's own mms for block 0/1 grads are 2 per Linear
    assert "aten.gelu" in ran
    assert ran.count("aten.mm") == 2 * 4 - 1  # no recompute mm (the first input needs no grad)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_selective_training_step_identical_on_every_example(name):
    reference, args, kwargs = EXAMPLES[name]()
    model = copy.deepcopy(reference)
    entries = [
        m for m in autoremat.plan(reference, args, kwargs, segments=8).modules if "[" not in m
    ]
    assert entries
    wrap.apply(model, entries, selective=entries)
    assert wrap.selective_paths(model) == dict.fromkeys(entries, DEFAULT_SAVE_OPS)
    assert_same_step(reference, model, args, kwargs)
    assert_same_step(reference, model, args, kwargs)  # a second step: buffers, RNG, caches


def test_budget_plan_chooses_selective_recompute_and_meets_the_budget():
    reference, args, kwargs = EXAMPLES["hf-gpt2"]()
    model = copy.deepcopy(reference)
    plan = autoremat.plan(model, args, kwargs, budget="50%")
    assert plan.selective and set(plan.selective) <= set(plan.modules)
    assert {c.mode for c in plan.choices} <= {"full", "selective"}
    assert {c.path for c in plan.choices if c.mode == "selective"} == set(plan.selective)
    base = autoremat.measure(model, args, kwargs)
    plan.apply(model)
    assert set(wrap.selective_paths(model)) == set(plan.selective)
    got = autoremat.measure(model, args, kwargs)
    assert got.peak <= plan.budget
    assert abs(plan.estimated_peak - got.peak) <= 0.10 * got.peak
    # the recompute FLOPs are the full-recompute choices' alone
    assert got.flops - base.flops == plan.recompute_flops
    assert_same_step(reference, model, args, kwargs)
    text = str(plan)
    assert "selective" in text and "aten.mm" in text


def test_selective_can_be_turned_off():
    model, args, kwargs = EXAMPLES["hf-gpt2"]()
    plan = autoremat.plan(model, args, kwargs, budget="50%", selective=False)
    assert plan.selective == () and {c.mode for c in plan.choices} == {"full"}


def test_selective_plan_round_trips_through_json():
    model, args, kwargs = EXAMPLES["gpt2"]()
    plan = autoremat.plan(model, args, kwargs, budget="75%")
    assert plan.selective
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["save_ops"] == list(DEFAULT_SAVE_OPS)
    assert data["selective"] == list(plan.selective)
    loaded = Plan.from_dict(data)
    assert loaded == plan
    loaded.apply(model)
    assert set(wrap.selective_paths(model)) == set(plan.selective)


def test_custom_save_ops_are_honoured():
    model = toy(nn.GELU)
    wrap.apply(model, ["0"], selective=["0"], save_ops=["aten.gelu"])
    prof_like = autoremat.measure(model, (x(),))
    wrap.remove(model)
    base = autoremat.measure(model, (x(),))
    # keeping GELU's output m0 instead: the first matmul is recomputed for h0, which GELU's
    # backward needs; the second is not (early stop: its output is needed by nothing)
    assert prof_like.flops - base.flops == MATMUL
    assert prof_like.saved < base.saved


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"selective": ["1"]}, ValueError, "'1' is not"),
        ({"selective": ["0"], "save_ops": ["mm"]}, ValueError, "'mm' is not an op name"),
        ({"selective": ["0"], "save_ops": "aten.mm"}, TypeError, "sequence of op names"),
    ],
)
def test_bad_selective_arguments_are_refused_and_change_nothing(kwargs, error, match):
    model = toy(nn.GELU)
    with pytest.raises(error, match=match):
        wrap.apply(model, ["0"], **kwargs)
    assert wrap.wrapped_paths(model) == ()


def test_a_run_cannot_be_selective():
    model = toy(nn.GELU)
    with pytest.raises(ValueError, match=r"'0\[0:2\]' is not"):
        wrap.apply(model, ["0[0:2]"], selective=["0[0:2]"])


class Noise(nn.Module):
    """Multiplies by fresh noise, uniform or normal (``aten.rand_like``, ``aten.randn_like``:
    both draw random numbers)."""

    def __init__(self, normal: bool = False) -> None:
        super().__init__()
        self.normal = normal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.randn_like(x) if self.normal else torch.rand_like(x))


def test_ops_that_draw_random_numbers_are_always_recomputed():
    """A kept op that draws random numbers would be skipped in the recompute, and every random
    op after it would draw other numbers (checkpoint replays the RNG from the module's start):
    a plain selective checkpoint that keeps ``rand_like`` gets the ``randn_like`` after it wrong;
    autoremat's policy recomputes random ops whatever ``save_ops`` says."""
    import functools

    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    def net() -> nn.Sequential:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            block = nn.Sequential(nn.Linear(32, 32), Noise(), nn.Linear(32, 32), Noise(True))
            return nn.Sequential(block, nn.Linear(32, 1))

    inputs = torch.randn(64, 32)
    reference, model, naive = net(), net(), net()

    def keep_noise(ctx, func, *args, **kwargs):
        if func.overloadpacket in (torch.ops.aten.rand_like, torch.ops.aten.addmm):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(3)
    out = checkpoint(
        naive[0],
        inputs,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, keep_noise),
    )
    naive[1](out).sum().backward()
    torch.manual_seed(3)
    reference(inputs).sum().backward()
    assert not torch.allclose(naive[0][0].weight.grad, reference[0][0].weight.grad)

    reference.zero_grad(set_to_none=True)
    wrap.apply(model, ["0"], selective=["0"], save_ops=["aten.rand_like", "aten.addmm"])
    assert_same_step(reference, model, (inputs,), {})

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
import re

import pytest
import torch
from torch import nn

import autoremat
from autoremat import wrap
from autoremat.core.selective import DEFAULT_SAVE_OPS, WAYS, op_name, ops_on
from autoremat.examples import EXAMPLES
from autoremat.planning.plan import plan_from_profile
from autoremat.planning.planning_tree import planning_tree, way_seconds
from autoremat.planning.plans import Plan
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


RNG = int(torch.get_rng_state().numel())  # a checkpoint keeps one on the CPU


def x() -> torch.Tensor:
    return torch.randn(2048, 512, generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("act", "full_frees", "selective_frees"), [(nn.GELU, 2 * A, A), (nn.ReLU, A, 0)]
)
def test_profile_prices_selective_recompute_to_the_byte(act, full_frees, selective_frees):
    model = toy(act)
    prof = autoremat.profile(model, (x(),))
    cost = prof["0"]
    assert cost.freed == full_frees
    assert cost.ways[0].freed == selective_frees
    assert cost.flops == 2 * MATMUL and cost.ways[0].flops == 0
    assert cost.written == 3 * A  # h0, m0, g0
    assert cost.ways[0].written == A  # m0 alone is written again
    # and the measurement agrees: saved-for-backward bytes (selective's cache included) drop
    # by what the profile said (less the RNG state the checkpoint keeps, which the tracker
    # counts on the CPU and the planner adds), and FLOPs grow by what it said
    base = autoremat.measure(model, (x(),))
    wrap.apply(model, ["0"])
    full = autoremat.measure(model, (x(),))
    wrap.remove(model)
    wrap.apply(model, ["0"], selective=["0"])
    sel = autoremat.measure(model, (x(),))
    wrap.remove(model)
    assert base.saved - full.saved == full_frees - RNG
    assert base.saved - sel.saved == selective_frees - RNG
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


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(WAYS))
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_selective_training_step_identical_on_every_example(name, mode):
    reference, args, kwargs = EXAMPLES[name]()
    model = copy.deepcopy(reference)
    prof = autoremat.profile(reference, args, kwargs)
    entries = [
        m
        for m in autoremat.plan(reference, args, kwargs, segments=8).modules
        if "[" not in m and not any(prof[c].way(mode).kept_changed for c in prof.calls_of(m))
    ]  # (a way whose kept outputs are changed in place would fail: tested below)
    if not entries:
        pytest.skip("every entry keeps an output changed in place (an LSTMCell): tested below")
    if mode == "selective":  # the default ops, given as one list
        wrap.apply(model, entries, selective=entries)
    else:
        wrap.apply(model, entries, selective=dict.fromkeys(entries, WAYS[mode]))
    assert wrap.selective_paths(model) == dict.fromkeys(entries, WAYS[mode])
    assert_same_step(reference, model, args, kwargs)
    assert_same_step(reference, model, args, kwargs)  # a second step: buffers, RNG, caches


@pytest.mark.slow
def test_budget_plan_chooses_selective_recompute_and_meets_the_budget():
    reference, args, kwargs = EXAMPLES["hf-gpt2"]()
    model = copy.deepcopy(reference)
    plan = autoremat.plan(model, args, kwargs, budget="50%", objective="flops")
    assert plan.selective and set(plan.selective) <= set(plan.modules)
    assert {c.way for c in plan.choices} <= {"full", *WAYS}
    assert plan.selective == {c.path: WAYS[c.way] for c in plan.choices if c.way != "full"}
    base = autoremat.measure(model, args, kwargs)
    plan.apply(model)
    assert wrap.selective_paths(model) == plan.selective
    got = autoremat.measure(model, args, kwargs)
    assert got.peak <= plan.budget
    assert abs(plan.estimated_peak - got.peak) <= 0.10 * got.peak
    # the FLOPs the plan adds are an upper bound (checkpoint's early stop can skip the last
    # ops of a recompute), and close
    added = got.flops - base.flops
    assert 0.9 * plan.recompute_flops <= added <= plan.recompute_flops
    assert added < 0.05 * base.flops  # far below a forward (a third of the step)
    assert_same_step(reference, model, args, kwargs)
    text = str(plan)
    assert "selective" in text and "aten.mm" in text and "minimised flops" in text


def test_selective_can_be_turned_off():
    model, args, kwargs = EXAMPLES["hf-gpt2"]()
    plan = autoremat.plan(model, args, kwargs, budget="50%", selective=False)
    assert plan.selective == {} and {c.way for c in plan.choices} == {"full"}


def test_selective_plan_round_trips_through_json():
    model, args, kwargs = EXAMPLES["gpt2"]()
    plan = autoremat.plan(model, args, kwargs, budget="50%", objective="flops")
    assert {c.way for c in plan.choices} >= {"selective", "selective-bmm"}
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["selective"] == {p: list(ops) for p, ops in plan.selective.items()}
    assert data["objective"] == "flops" and data["recompute_seconds"] > 0
    loaded = Plan.from_dict(data)
    assert loaded == plan
    loaded.apply(model)
    assert wrap.selective_paths(model) == plan.selective
    assert "aten.bmm" not in str(wrap.selective_paths(model)[plan.choices[0].path])


def test_the_summary_lists_the_ops_kept_on_the_plans_device():
    """A CPU plan's summary names the ops a CPU run can keep; the default list's CUDA-only
    attention kernels are counted, not listed. A plan from a ``meta`` profile (the device is
    not known) and a loaded plan list them all."""
    model, args, kwargs = EXAMPLES["gpt2"]()
    plan = autoremat.plan(model, args, kwargs, budget="50%", objective="flops")
    assert plan.device == "cpu"
    lines = [line for line in plan.summary().splitlines() if "keeps the outputs of" in line]
    assert lines
    cuda_only = ("aten._scaled_dot_product_efficient_attention", "aten._flash_attention_forward")
    for line in lines:
        assert "aten.addmm" in line and "aten._scaled_dot_product_flash_attention_for_cpu" in line
        assert not any(op in line for op in cuda_only), line
        assert re.search(r"\(and \d+ kernels of other devices\)$", line), line
    assert ops_on(DEFAULT_SAVE_OPS, "meta") == DEFAULT_SAVE_OPS
    loaded = Plan.from_dict(plan.to_dict())
    assert loaded.device is None and cuda_only[0] in loaded.summary()


def test_plans_saved_in_the_first_form_still_load():
    """Before per-module policies, 'selective' was a list of paths sharing 'save_ops'."""
    model, args, kwargs = EXAMPLES["gpt2"]()
    plan = autoremat.plan(model, args, kwargs, budget="75%", objective="flops")
    data = plan.to_dict()
    paths = list(plan.selective)
    data["selective"] = paths
    data["save_ops"] = ["aten.mm", "aten.addmm"]
    del data["objective"], data["recompute_seconds"]
    for c in data["choices"]:
        del c["seconds"]
    loaded = Plan.from_dict(data)
    assert loaded.selective == dict.fromkeys(paths, ("aten.mm", "aten.addmm"))
    assert loaded.objective is None and loaded.recompute_seconds is None


def attention_toy() -> nn.Module:
    """One head of unfused attention: q, k, v projections (mm), scores ``q @ k^T`` and
    ``probs @ v`` (bmm), softmax between; then a projection (mm)."""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(64, 64, bias=False) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scores = torch.bmm(self.q(x), self.k(x).transpose(1, 2))
            return torch.bmm(scores.softmax(-1), self.v(x))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(Attention(), nn.Linear(64, 64, bias=False))


T = 256  # tokens; batch 2: a score matrix is 2 x 256 x 256 x 4 B = 512 KiB


def test_second_way_recomputes_the_batched_matmuls_and_is_priced_exactly():
    """Autograd saves q, k, v (inputs of the products) and probs (softmax's output and the
    second product's input). Keeping every matmul output ("selective") keeps the scores too,
    which nothing else saves: it frees probs and holds scores, net 0. "selective-bmm" keeps
    q, k, v (saved anyway) and recomputes scores, softmax and the second product: it frees
    probs for the two products' FLOPs."""
    model = attention_toy()
    inputs = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(2))
    scores = 2 * T * T * 4
    product = 2 * 2 * T * T * 64  # FLOPs of one bmm
    cost = autoremat.profile(model, (inputs,))["0"]
    ways = {w.way: w for w in cost.ways}
    assert set(ways) == set(WAYS)
    assert cost.freed == 3 * (2 * T * 64 * 4) + scores
    assert ways["selective"].freed == 0 and ways["selective"].flops == 0
    assert ways["selective-bmm"].freed == scores
    assert ways["selective-bmm"].flops == 2 * product
    # what it runs again: fewer FLOPs than a whole recompute, and its time (timed op by op)
    # by construction no more than the whole recompute's (no two measured times compared)
    assert ways["selective-bmm"].flops < cost.flops
    assert ways["selective-bmm"].op_seconds <= cost.op_seconds
    base = autoremat.measure(model, (inputs,))
    wrap.apply(model, ["0"], selective={"0": WAYS["selective-bmm"]})
    got = autoremat.measure(model, (inputs,))
    wrap.remove(model)
    assert base.saved - got.saved == scores - RNG  # (less the checkpoint's RNG state)
    # early stop: the second product's output is needed by nothing, so it is not rerun
    assert got.flops - base.flops == product
    reference = attention_toy()
    wrap.apply(model, ["0"], selective={"0": WAYS["selective-bmm"]})
    assert_same_step(reference, model, (inputs,), {})


@pytest.mark.slow
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


def test_per_op_overheads_are_measured_and_selective_costs_more(monkeypatch):
    from autoremat.record import timing
    from autoremat.record.timing import DEFAULT_OVERHEADS, overheads, per_op

    # The arithmetic on fixed step times: what checkpoint and selective checkpointing add over
    # the plain chain, per op; never negative, and selective never below checkpoint.
    assert per_op({"plain": 1.0, "full": 1.5, "selective": 3.0}, ops=10) == (0.05, 0.2)
    assert per_op({"plain": 1.0, "full": 0.9, "selective": 0.8}, ops=10) == (0.0, 0.0)
    assert per_op({"plain": 1.0, "full": 2.0, "selective": 1.5}, ops=10) == (0.1, 0.1)
    # Measured: (no lower bound above zero: on a busy machine a plain step can be the slower)
    full, selective = overheads(torch.device("cpu"))
    assert 0 <= full <= selective < 0.01
    assert overheads(torch.device("meta")) == DEFAULT_OVERHEADS
    # measured with gradients whatever the caller's mode (else nothing is recomputed)
    grad_modes = []
    plain_checkpoint = timing.checkpoint

    def spy(*args, **kwargs):
        grad_modes.append(torch.is_grad_enabled())
        return plain_checkpoint(*args, **kwargs)

    monkeypatch.setattr(timing, "checkpoint", spy)
    with torch.no_grad():
        again = overheads.__wrapped__(torch.device("cpu"), ops=8, repeats=1)
    assert grad_modes == [True, True] and 0 <= again[0] <= again[1]


def test_op_seconds_reconcile_down_the_tree():
    model, args, kwargs = EXAMPLES["gpt2"]()
    prof = autoremat.profile(model, args, kwargs)
    for node in prof.tree.walk():
        cost = prof[node.path]
        assert cost.op_seconds >= sum(prof[c.path].op_seconds for c in node.children) - 1e-12
        assert cost.ops >= sum(prof[c.path].ops for c in node.children)
        for way in cost.ways:
            assert 0 <= way.op_seconds <= cost.op_seconds + 1e-12
    assert prof[""].op_seconds > 0 and prof[""].ops > 100


def test_time_objective_prices_selective_checkpointing_by_its_overhead():
    """The same profile planned by time: free per-op overhead makes selective ways (which rerun
    no matmuls) the cheapest; a large one rules them out. By FLOPs they win either way."""
    import dataclasses

    from autoremat.planning.planning_tree import planning_tree
    from autoremat.planning.solver import solve

    # Profiled on meta: op times are then estimated from FLOPs and bytes written, the same on
    # every run. Times measured on a busy machine could make a whole recompute look cheaper
    # than a selective one and fail this test by chance.
    with torch.device("meta"):
        model, args, kwargs = EXAMPLES["gpt2"]()
    prof = autoremat.profile(model, args, kwargs)
    assert prof.device == "meta"
    budget = int(0.6 * prof.peak)

    def modes(objective: str, overhead: float) -> set[str]:
        priced = dataclasses.replace(prof, selective_op_overhead=overhead, op_overhead=0.0)
        return {
            i.way for i in solve(planning_tree(priced, objective=objective), prof.points, budget)
        }

    assert modes("time", 0.0) & set(WAYS)
    assert modes("time", 1.0) == {"full"}
    assert modes("flops", 1.0) & set(WAYS)
    root = planning_tree(prof, objective="flops")
    assert all(i.seconds is None for i in root.walk())
    root = planning_tree(prof, objective="time")
    assert all(i.seconds is not None for i in root.walk())


def test_a_time_plan_reports_the_seconds_it_adds():
    """Each choice adds what the profile prices its way at (its ops' time plus the way's per-op
    overhead), the plan the sum; ``"flops"`` is refused with the objectives named."""
    model, args, kwargs = EXAMPLES["gpt2"]()
    prof = autoremat.profile(model, args, kwargs)
    plan = plan_from_profile(model, prof, "50%")
    assert plan.objective == "time" and plan.choices
    for c in plan.choices:
        assert c.seconds == pytest.approx(way_seconds(prof, prof[c.path], c.way)), c
    assert plan.recompute_seconds == pytest.approx(sum(c.seconds for c in plan.choices))
    assert plan.recompute_seconds > 0 and "ms (as profiled)" in str(plan)
    with pytest.raises(ValueError, match="objective must be one of 'time', 'flops'"):
        autoremat.plan(model, args, kwargs, budget="50%", objective="speed")


def test_the_cache_is_emptied_when_the_recompute_ends():
    """Checkpoint's early stop ends the recompute of ``Linear, GELU, Linear`` once GELU's output
    (what the last matmul saved) is back, so the last matmul never takes its output from the
    cache: plain selective checkpointing keeps it there until the autograd graph is freed
    (measured on a ViT block: held through the rest of the backward). autoremat's context
    empties the cache when the recompute ends."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from autoremat.core.selective import context_fn

    block = toy(nn.GELU)[0]
    made: list[tuple] = []

    def ours():
        made.append(context_fn(("aten.mm",))())
        return made[-1]

    def plain():
        made.append(create_selective_checkpoint_contexts([torch.ops.aten.mm.default]))
        return made[-1]

    left = []
    for fn in (ours, plain):
        out = checkpoint(block, x().requires_grad_(), use_reentrant=False, context_fn=fn)
        assert sum(map(len, made[-1][1].storage.values())) > 0  # filled by the forward
        out.relu().sum().backward()
        cache = made[-1][1].storage
        left.append(
            [v for entries in cache.values() for v in entries.values() if hasattr(v, "get_val")]
        )
    assert left[0] == []  # ours: nothing held
    assert len(left[1]) == 1  # plain: the last matmul's output, never taken back


def _changes_a_kept_output() -> list[tuple[str, nn.Module, torch.Tensor]]:
    """Modules whose forward changes a kept op's output in place: an LSTMCell (``addmm`` then
    ``add_``) and a Linear followed by ``ReLU(inplace=True)``."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 64), nn.ReLU(inplace=True), nn.Linear(64, 8))
    return [
        ("cell", nn.LSTMCell(8, 64), torch.randn(16, 8)),
        ("mlp", mlp, torch.randn(16, 8)),
    ]


@pytest.mark.parametrize("case", range(2))
def test_a_way_whose_kept_output_is_changed_in_place_is_never_offered(case: int) -> None:
    """The profile marks such a way (``kept_changed``), the planner never offers it, and the
    mark is needed: applied by hand, torch refuses the changed cached tensor in backward."""
    name, inner, x = _changes_a_kept_output()[case]
    model = nn.Sequential(nn.Linear(8, 8), inner, nn.Linear(64 if name == "cell" else 8, 4))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.body[1](self.body[0](x))
            return self.body[2](h[0] if isinstance(h, tuple) else h)

    head = Head()
    prof = autoremat.profile(head, (x,))
    assert all(w.kept_changed for w in prof["body.1"].ways)
    items = [i for i in planning_tree(prof).walk() if i.path == "body.1"]
    assert items and not items[0].other_ways
    wrapped = wrap.apply(copy.deepcopy(head), ["body.1"], selective=["body.1"])
    with pytest.raises(RuntimeError, match="cached during selective activation checkpoint"):
        wrapped(x).pow(2).mean().backward()
    whole = wrap.apply(copy.deepcopy(head), ["body.1"])
    assert_same_step(copy.deepcopy(head), whole, (x,), {})


def test_a_way_the_same_as_one_offered_is_offered_once() -> None:
    """Without batched matmuls the two ways keep the same outputs: the profile prices them
    alike and the planning tree offers one; with ``bmm`` they differ and both are offered.
    (RNG states counted, as a rehearsal counts them: the items' bytes are shifted by them.)"""

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.out = nn.Linear(16, 16), nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = nn.functional.gelu(self.q(x))
            return self.out(torch.bmm(q, q.transpose(1, 2)).sin().cos())

    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.Tanh())
    for inner, ways in ((mlp, 1), (Attention(), 2)):
        model = nn.Sequential(nn.Linear(16, 16), inner, nn.Linear(16, 4))
        prof = autoremat.profile(model, (torch.randn(4, 32, 16),))
        one, bmm = prof["1"].way("selective"), prof["1"].way("selective-bmm")
        assert (one.freed == bmm.freed and one.flops == bmm.flops) == (ways == 1)
        item = next(i for i in planning_tree(prof, rng_state=5056).walk() if i.path == "1")
        assert len(item.other_ways) == ways

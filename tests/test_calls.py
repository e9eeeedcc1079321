"""Modules that run many times in one forward: each call is a node, planned and recomputed on
its own (issue 14).

Every wrapping test compares loss, gradients and buffers with the unwrapped model (dropout on);
every plan's estimate (its step run) is compared with the measured peak.
"""

from __future__ import annotations

import copy
import itertools
import pickle
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import autoremat
from autoremat.core.entries import call_entry, first_nested, module_of, parse_call
from autoremat.examples import EXAMPLES, Block
from autoremat.examples.repeated import LoopedTransformer
from autoremat.planning.planning_tree import planning_tree
from autoremat.planning.rehearsal import PlanFields, rehearsal_for
from autoremat.planning.solver import walk_peak
from autoremat.planning.strategies.budget import choices_for
from autoremat.wrap.calls import NewStep
from autoremat.wrap.checkpointed import selective_paths, wrapped_paths
from autoremat.wrap.wrapping import apply
from conftest import (
    aot_eager_keeping_backward,
    assert_same_step,
    recomputed_regions,
    recomputed_step,
    train_step,
    under_autocast,
)

REPEATED = ["looped", "lstm-cell", "two-tower", "hf-albert"]
# the module each example runs many times, which hand-placed per-call checkpointing wraps
SHARED = {
    "looped": "block",
    "lstm-cell": "cell",
    "two-tower": "encoder",
    "hf-albert": "albert.encoder.albert_layer_groups.0",
}


def _example(name: str) -> tuple[nn.Module, tuple, dict]:
    if name == "hf-albert":
        pytest.importorskip("transformers")
    return EXAMPLES[name]()


def _assert_predicted(plan: autoremat.Plan, measured: int) -> None:
    """The plan's estimate (its step run) is the measured peak to the byte, the budget held."""
    assert plan.estimated_peak is not None and plan.budget is not None
    assert plan.estimated_peak == measured
    assert measured <= plan.budget


# --- the profile ----------------------------------------------------------------------------


def test_the_profile_has_a_node_per_call_each_placed_where_it_ran() -> None:
    model, args, kwargs = _example("looped")
    prof = autoremat.profile(model, args, kwargs)
    calls = prof.calls_of("block")
    assert calls == [f"block@{k}" for k in range(8)]
    costs = [prof[c] for c in calls]
    assert len({(c.flops, c.saved, c.calls) for c in costs}) == 1 and costs[0].calls == 8
    for before, after in itertools.pairwise(costs):
        assert before.end < after.start <= after.end  # one after the other, never interleaved
    # a call's children are that call's calls of the module's children
    node = next(n for n in prof.tree.walk() if n.path == "block@3")
    assert {c.path for c in node.children} >= {"block.attn@3", "block.mlp@3"}
    assert node.call == 3 and node.module_path == "block" and node.module is model.block
    with pytest.raises(KeyError, match=r"ran 8 times: its nodes are its calls 'block@0'"):
        prof["block"]
    assert prof.calls_of("wte") == ["wte"] and prof["wte"].calls == 1


class Unrolled(nn.Module):
    """:class:`LoopedTransformer` with its block copied at each depth: the same computation,
    each call a module of its own."""

    def __init__(self, looped: LoopedTransformer) -> None:
        super().__init__()
        self.looped = looped
        self.blocks = nn.ModuleList(copy.deepcopy(looped.block) for _ in range(looped.depth))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        m = self.looped
        pos = torch.arange(idx.shape[1])
        x = m.drop(m.wte(idx) + m.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = m.lm_head(m.ln_f(x))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return {"logits": logits, "loss": loss}


@pytest.mark.slow
def test_a_call_costs_what_the_same_block_costs_unrolled() -> None:
    """Per call, the cost model gives the figures of the unrolled model's separate blocks
    (saved, freed, FLOPs, held, span), and the forward's points are the same (backward, and
    with it the recompute peaks, differs: the unrolled blocks each have gradients of their
    own): a shared module is priced as if each call were a module of its own."""
    model, args, kwargs = _example("looped")
    looped = autoremat.profile(model, args, kwargs)
    unrolled = autoremat.profile(Unrolled(model), args, kwargs)
    assert looped.peak == unrolled.peak
    assert looped.forward_points == unrolled.forward_points
    for k in range(8):
        a, b = looped[f"block@{k}"], unrolled[f"blocks.{k}"]
        fields = ("saved", "freed", "flops", "held", "held_from", "written")
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields], k
        assert (a.end - a.start) == (b.end - b.start)


# --- plans on the zoo -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", REPEATED)
def test_a_half_budget_is_held_predicted_and_trains_exactly(name: str) -> None:
    model, args, kwargs = _example(name)
    plan = autoremat.plan(model, args, kwargs, budget=0.5, objective="flops")
    assert any(parse_call(e) for e in plan.modules) or SHARED[name] in map(module_of, plan.modules)
    wrapped = plan.apply(copy.deepcopy(model))
    _assert_predicted(plan, autoremat.measure(wrapped, args, kwargs).peak)
    assert_same_step(copy.deepcopy(model), wrapped, args, kwargs)
    assert_same_step(copy.deepcopy(model), wrapped, args, kwargs)  # and a second step


def _hand_per_call(model: nn.Module, args: tuple, kwargs: dict, shared: str) -> int:
    """The lowest measured peak of per-call checkpointing placed by hand on the shared module:
    every call, or every call but the last (whose activations backward uses first)."""
    calls = autoremat.profile(model, args, kwargs).calls_of(shared)
    peaks = []
    for chosen in ([shared], calls[:-1]):
        wrapped = apply(copy.deepcopy(model), chosen)
        peaks.append(autoremat.measure(wrapped, args, kwargs).peak)
    return min(peaks)


@pytest.mark.slow
@pytest.mark.parametrize("name", REPEATED)
def test_the_lowest_reachable_peak_is_within_10_percent_of_hand_per_call(name: str) -> None:
    """The issue's target; the lowest budget the planner states is one it meets, and 4 KiB
    less is refused; every call recomputed by hand (one of the plans it runs) measures no
    lower."""
    model, args, kwargs = _example(name)
    hand = _hand_per_call(model, args, kwargs, SHARED[name])
    every = apply(copy.deepcopy(model), [SHARED[name]])
    lowest = autoremat.lowest_budget(model, args, kwargs)
    assert autoremat.measure(every, args, kwargs).peak >= lowest
    plan = autoremat.plan(model, args, kwargs, budget=lowest)
    measured = autoremat.measure(plan.apply(copy.deepcopy(model)), args, kwargs).peak
    assert measured <= 1.10 * hand, (measured, hand)
    _assert_predicted(plan, measured)
    with pytest.raises(autoremat.BudgetTooLow) as info:
        autoremat.plan(model, args, kwargs, budget=lowest - 4096)
    assert info.value.lowest == lowest


@pytest.mark.slow
def test_every_call_chosen_alike_is_one_entry_and_the_table_groups_calls() -> None:
    model, args, kwargs = _example("looped")
    prof = autoremat.profile(model, args, kwargs)
    items = {i.path: i for i in planning_tree(prof, selective=False).walk()}
    every = [items[f"block@{k}"] for k in range(8)]
    (merged,) = choices_for(prof, every)
    assert merged.path == "block" and merged.freed == sum(i.freed for i in every)
    assert [c.path for c in choices_for(prof, every[:7])] == [f"block@{k}" for k in range(7)]
    low = autoremat.plan(model, args, kwargs, budget=0.3, selective=False, objective="flops")
    for entry in low.modules:  # a module has call entries or its path, never both
        call = parse_call(entry)
        if call is not None:
            assert call[0] not in low.modules and low.calls[call[0]] == 8
    plan = autoremat.Plan(
        modules=("block@1", "block@2", "block@3", "block@5"),
        strategy="budget",
        model_class="LoopedTransformer",
        budget=1,
        estimated_peak=1,
        baseline_peak=2,
        choices=tuple(autoremat.planning.choice.Choice(f"block@{k}", 10, 20) for k in (1, 2, 3, 5)),
        calls={"block": 8},
    )
    table = plan.table()
    assert "block@1..3 (3 of 8 calls)" in table and "block@5 " in table
    assert "30 B" in table  # the three calls' bytes summed


# --- the wrap -------------------------------------------------------------------------------


@pytest.mark.slow
def test_only_the_chosen_calls_are_recomputed() -> None:
    """Recomputing calls 0..6 of the cell frees about 7/64 of what recomputing all 64 frees."""
    model, args, kwargs = _example("lstm-cell")
    base = autoremat.measure(model, args, kwargs).peak
    every = autoremat.measure(apply(copy.deepcopy(model), ["cell"]), args, kwargs).peak
    some = apply(copy.deepcopy(model), [call_entry("cell", k) for k in range(7)])
    assert wrapped_paths(some) == tuple(f"cell@{k}" for k in range(7))
    part = autoremat.measure(some, args, kwargs).peak
    share = (base - part) / (base - every)
    assert 0.5 * 7 / 64 < share < 2 * 7 / 64, share


def test_selective_calls_keep_their_ops_and_train_exactly() -> None:
    model, args, kwargs = _example("looped")
    wrapped = apply(
        copy.deepcopy(model),
        ["block@0", "block@2", "block.mlp@5"],
        selective={"block@2": ("aten.addmm",), "block.mlp@5": ("aten.mm", "aten.addmm")},
        calls={"block": 8, "block.mlp": 8},
    )
    assert selective_paths(wrapped) == {
        "block@2": ("aten.addmm",),
        "block.mlp@5": ("aten.mm", "aten.addmm"),
    }
    assert_same_step(copy.deepcopy(model), wrapped, args, kwargs)


def test_nested_call_entries_replay_their_choices_exactly() -> None:
    """Calls of a child inside a recomputed call (chosen by hand: the planner never nests)
    are checkpointed in the recompute as in the forward, dropout masks and all."""
    model, args, kwargs = _example("looped")
    entries = ["block@1", "block.attn@1", "block.mlp.drop@1", "block.attn@2", "block.mlp@6"]
    assert first_nested(entries) is None
    wrapped = apply(copy.deepcopy(model), entries)
    assert_same_step(copy.deepcopy(model), wrapped, args, kwargs)


class TwoNorms(nn.Module):
    """One BatchNorm block applied twice (running statistics move twice per step)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1)
        )
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.head(self.block(x))))


@pytest.mark.parametrize("entries", [["block@0"], ["block@1"], ["block@0", "block@1"], ["block"]])
def test_stateful_calls_move_their_statistics_once_per_call(entries: list[str]) -> None:
    torch.manual_seed(0)
    model = TwoNorms()
    x = torch.randn(32, 16)
    wrapped = apply(copy.deepcopy(model), entries)
    assert_same_step(copy.deepcopy(model), wrapped, (x,), {})
    assert int(wrapped.block[1].num_batches_tracked) == 2


# --- another number of calls ----------------------------------------------------------------


def _lstm_step(model: nn.Module, steps: int) -> torch.Tensor:
    torch.manual_seed(3)
    x = torch.randn(32, steps, 64)
    return train_step(model, (x,), {"targets": torch.randint(0, 10, (32,))})


@pytest.mark.slow
def test_more_calls_than_profiled_warn_once_and_train_exactly() -> None:
    model, args, kwargs = _example("lstm-cell")
    plan = autoremat.plan(model, args, kwargs, budget=0.6, objective="flops")
    assert plan.calls == {"cell": 64}, plan.modules
    wrapped = plan.apply(copy.deepcopy(model))
    reference = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            loss = recomputed_step(wrapped, lambda: _lstm_step(wrapped, 80), plan.modules)
            torch.testing.assert_close(loss, _lstm_step(reference, 80))
            for p, q in zip(wrapped.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    messages = [str(w.message) for w in seen if "autoremat" in str(w.message)]
    assert len(messages) == 1, messages
    assert "module 'cell' ran more than the 64 calls the plan was made for" in messages[0]
    assert "plan on inputs with the longest loop" in messages[0]


def test_fewer_calls_than_profiled_warn_when_the_step_ends() -> None:
    model, _, _ = _example("lstm-cell")
    wrapped = apply(copy.deepcopy(model), ["cell@0", "cell@40", "cell@63"], calls={"cell": 64})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss = _lstm_step(wrapped, 48)
        assert len(seen) == 1 and "ran 48 instead of the 64 calls" in str(seen[0].message)
        torch.testing.assert_close(loss, _lstm_step(copy.deepcopy(model), 48))
        _lstm_step(wrapped, 48)  # the same count again: no second warning
        _lstm_step(wrapped, 30)  # another one: warned too
    assert len(seen) == 2 and "ran 30 instead of the 64" in str(seen[1].message)


def test_evaluation_without_gradients_warns_nothing_and_hides_nothing() -> None:
    """A longer evaluation loop under no_grad costs no memory worth a warning; the training
    step with the same length still warns."""
    model, _, _ = _example("lstm-cell")
    wrapped = apply(copy.deepcopy(model), ["cell@3"], calls={"cell": 64})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad():
            wrapped(torch.randn(4, 80, 64))
        assert not seen
        _lstm_step(wrapped, 80)
    assert len(seen) == 1 and "ran more than the 64 calls" in str(seen[0].message)


def test_a_longer_loop_after_a_shorter_one_is_reported_too() -> None:
    model, _, _ = _example("lstm-cell")
    wrapped = apply(copy.deepcopy(model), ["cell@1", "cell@4"], calls={"cell": 5})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for steps in (2, 10):
            _lstm_step(wrapped, steps)
    messages = [str(w.message) for w in seen]
    assert len(messages) == 2, messages
    assert "ran 2 instead of the 5" in messages[0] and "ran more than the 5" in messages[1]


class LossMethod(nn.Module):
    """Trained through ``compute_loss``, not ``forward``: the model's pre-hook never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = LoopedTransformer(width=32, depth=4, context=16)

    def compute_loss(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(idx, idx)["loss"]


def test_calls_restart_when_backward_ends_a_step_whatever_the_entry_point() -> None:
    torch.manual_seed(0)
    model = LossMethod()
    idx = torch.randint(0, 512, (4, 16))
    wrapped = apply(
        copy.deepcopy(model), ["inner.block@1", "inner.block@2"], calls={"inner.block": 4}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            for m in (model, wrapped):
                m.zero_grad(set_to_none=True)
                torch.manual_seed(1)
                m.compute_loss(idx).backward()
            for p, q in zip(model.parameters(), wrapped.parameters(), strict=True):
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7)
    assert wrapped.inner.block.__dict__["_autoremat_calls"].count == 0


@pytest.mark.slow
def test_a_module_named_without_a_call_index_recomputes_any_number_of_calls() -> None:
    model, _, _ = _example("lstm-cell")
    wrapped = apply(copy.deepcopy(model), ["cell"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for steps in (64, 100, 10):
            loss = recomputed_step(wrapped, lambda s=steps: _lstm_step(wrapped, s), ["cell"])
            torch.testing.assert_close(loss, _lstm_step(copy.deepcopy(model), steps))


@pytest.mark.slow
def test_calls_restart_at_every_forward_of_the_model() -> None:
    """Call k is the k-th call of each forward: an evaluation forward in between, without
    gradients, does not shift the next step's calls."""
    model, args, kwargs = _example("looped")
    wrapped = apply(copy.deepcopy(model), ["block@7"], calls={"block": 8})
    with torch.no_grad():
        wrapped(*args, **kwargs)
    chosen = wrapped.block.__dict__["_autoremat_calls"]
    assert chosen.count == 8
    base = autoremat.measure(model, args, kwargs).peak
    assert autoremat.measure(wrapped, args, kwargs).peak < base  # call 7 still recomputed
    assert chosen.count == 0 and not chosen.warned  # backward ended the step


# --- saving, copying, removing --------------------------------------------------------------


def test_a_call_plan_saves_loads_and_applies(tmp_path: Any) -> None:
    model, args, kwargs = _example("looped")
    plan = autoremat.plan(model, args, kwargs, budget=0.5, objective="flops")
    assert plan.calls
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = autoremat.Plan.load(path)
    assert (loaded.modules, loaded.calls, loaded.selective) == (
        plan.modules,
        plan.calls,
        plan.selective,
    )
    assert_same_step(copy.deepcopy(model), loaded.apply(copy.deepcopy(model)), args, kwargs)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"modules": ["block@9"], "calls": {"block": 8}}, "names call 9, but field 'calls'"),
        ({"modules": ["block@1"], "calls": {"block": 0}}, "expected a module of the plan's"),
        ({"modules": ["block@1"], "calls": {"nothere": 2}}, "expected a module of the plan's"),
        ({"modules": ["nothere@1"]}, "is not a module of the plan's 'structure'"),
        ({"modules": ["block", "block@1"]}, "recomputes would nest"),
        ({"modules": ["block@1@2"]}, "is not a module path, path@k or path"),
    ],
)
def test_a_wrong_calls_field_or_call_entry_is_refused(change: dict, message: str) -> None:
    model, args, kwargs = _example("looped")
    data = autoremat.plan(model, args, kwargs, segments=1).to_dict()
    data.update(change, choices=[], selective={})
    with pytest.raises(ValueError, match=message):
        autoremat.Plan.from_dict(data)


def test_remove_copy_and_pickle_of_a_call_plan() -> None:
    model, args, kwargs = _example("looped")
    wrapped = apply(copy.deepcopy(model), ["block@1", "block.mlp@3"], calls={"block": 8})
    assert any(isinstance(h, NewStep) for h in wrapped._forward_pre_hooks.values())
    twin = copy.deepcopy(wrapped)
    assert wrapped_paths(twin) == ("block@1", "block.mlp@3")
    assert_same_step(copy.deepcopy(model), twin, args, kwargs)
    plain = pickle.loads(pickle.dumps(wrapped))
    assert wrapped_paths(plain) == () and not plain._forward_pre_hooks
    assert "_autoremat_calls" not in plain.block.__dict__
    autoremat.remove(wrapped)
    assert wrapped_paths(wrapped) == () and not wrapped._forward_pre_hooks
    assert type(wrapped.block) is Block and "_autoremat_calls" not in wrapped.block.__dict__
    assert "__reduce_ex__" not in wrapped.__dict__
    assert wrapped_paths(twin) == ("block@1", "block.mlp@3")  # the copy stays wrapped


def test_an_apply_that_fails_half_way_leaves_no_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _, _ = _example("looped")

    def fail(model: nn.Module) -> None:
        raise RuntimeError("failed after the calls' hook was added")

    monkeypatch.setattr("autoremat.wrap.wrapping.huggingface.turn_cache_off_in_training", fail)
    with pytest.raises(RuntimeError, match="failed after"):
        apply(model, ["block@1", "block.mlp@2"])
    assert not model._forward_pre_hooks and wrapped_paths(model) == ()
    assert "__reduce_ex__" not in model.__dict__ and type(model.block) is Block


# --- levels, compile ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("segments", [1, 3])
def test_levels_split_points_recompute_every_call(segments: int) -> None:
    """The levels strategy works on the module tree (the claims): a split point that runs
    several times is one entry, its module path, and every call of it is recomputed."""
    model, args, kwargs = _example("looped")
    plan = autoremat.plan(model, args, kwargs, segments=segments)
    assert plan.modules and not plan.calls and not any(map(parse_call, plan.modules))
    prof = autoremat.profile(model, args, kwargs)
    assert all(len(prof.calls_of(p)) == 8 for p in plan.modules), plan.modules
    wrapped = plan.apply(copy.deepcopy(model))
    by_hand = apply(copy.deepcopy(model), [f"{p}@{k}" for p in plan.modules for k in range(8)])
    peak = autoremat.measure(wrapped, args, kwargs).peak
    assert peak == autoremat.measure(by_hand, args, kwargs).peak  # every call of each
    assert peak < autoremat.measure(model, args, kwargs).peak
    assert_same_step(copy.deepcopy(model), wrapped, args, kwargs)


@pytest.mark.slow
def test_a_call_plan_compiles_to_one_graph_with_exact_gradients() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = LoopedTransformer(width=32, depth=4, context=16, dropout=0.0)
    idx = torch.randint(0, 512, (2, 16))
    kwargs = {"targets": idx}
    model = apply(
        copy.deepcopy(reference),
        ["block@1", "block@3", "block.mlp@0"],
        selective={"block@3": ("aten.addmm",)},
        calls={"block": 4, "block.mlp": 4},
    )
    backend, backward = aot_eager_keeping_backward()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for _ in range(2):
        loss = train_step(compiled, (idx,), kwargs)
        grads = [p.grad for p in model.parameters()]
        expected = train_step(reference, (idx,), kwargs)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
        for g, p in zip(grads, reference.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1  # the second step reused the graph
    regions = sum(
        node.target is torch.ops.higher_order.tag_activation_checkpoint
        for gm in counter.graphs
        for node in gm.graph.nodes
    )
    assert regions == 3 == recomputed_regions(backward)
    torch._dynamo.reset()


# --- entries --------------------------------------------------------------------------------

_names = st.sampled_from(["a", "b", "a.x", "a.y", "b.x", "a.x.z"])


@given(st.lists(st.tuples(_names, st.integers(0, 5)), max_size=8))
def test_call_entries_never_nest_with_each_other(calls: list[tuple[str, int]]) -> None:
    assert first_nested([call_entry(p, k) for p, k in calls]) is None


@given(_names, _names, st.integers(0, 5))
def test_a_call_nests_with_its_module_its_ancestors_and_descendants(
    module: str, other: str, k: int
) -> None:
    entry = call_entry(module, k)
    related = other == module or module.startswith(other + ".") or other.startswith(module + ".")
    found = first_nested([entry, other])
    assert (found is not None) == related
    if found is not None:
        assert set(found) == {entry, other}


def test_calls_profiled_on_meta_cost_what_they_cost_on_real_tensors() -> None:
    with torch.device("meta"):
        on_meta = LoopedTransformer(depth=4).train()
        idx = torch.randint(0, 512, (2, 32))
    real = LoopedTransformer(depth=4).train()
    real_idx = torch.randint(0, 512, (2, 32))
    a = autoremat.profile(on_meta, (idx,), {"targets": idx})
    b = autoremat.profile(real, (real_idx,), {"targets": real_idx})
    assert a.peak == b.peak and list(a.costs) == list(b.costs)
    assert a.calls_of("block") == [f"block@{k}" for k in range(4)]
    for path in a.costs:
        fields = ("freed", "saved", "flops", "recompute_peak", "start", "end")
        assert [getattr(a[path], f) for f in fields] == [getattr(b[path], f) for f in fields]


def test_a_call_entry_without_its_modules_call_count_is_refused() -> None:
    model, args, kwargs = _example("looped")
    data = autoremat.plan(model, args, kwargs, segments=1).to_dict()
    data.update(modules=["lm_head@3"], calls={}, choices=[], selective={})
    with pytest.raises(ValueError, match=r"names a call of 'lm_head', but field 'calls' does not"):
        autoremat.Plan.from_dict(data)


@pytest.mark.slow
@pytest.mark.parametrize("entries", [["block"], ["block@0", "block@3"], ["block.mlp@2"]])
def test_selective_calls_under_autocast_train_exactly(entries: list[str]) -> None:
    """Under autocast a weight is cast once per forward (autocast caches the cast) but again
    in each recompute: selective checkpointing must not mistake those casts for a mismatch."""
    model, args, kwargs = under_autocast("looped")
    wrapped = apply(copy.deepcopy(model), entries, selective=entries)

    def step(m: nn.Module) -> tuple[torch.Tensor, list[Any]]:
        m.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(*args, **kwargs)["loss"]
        loss.backward()
        return loss.detach(), [p.grad for p in m.parameters()]

    loss_a, grads_a = step(model)
    loss_b, grads_b = recomputed_step(wrapped, lambda: step(wrapped))
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=0)
    for g, h in zip(grads_b, grads_a, strict=True):
        torch.testing.assert_close(g, h, rtol=0, atol=0)


BF16 = ("cpu", torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "chosen"),
    [
        ("looped", ["block@7"]),
        ("looped", [f"block@{k}" for k in range(1, 8)]),
        ("looped", ["block@1", "block@3", "block@5", "block@7"]),
        ("looped", ["block"]),
        ("two-tower", ["encoder@1"]),
        ("two-tower", ["encoder"]),
    ],
)
def test_under_autocast_plans_recomputing_later_calls_are_predicted(
    name: str, chosen: list[str]
) -> None:
    """Recomputing calls of a shared module under autocast: the step run is the measured
    peak to the byte (a derived estimate was 1.3% to 3.5% under on these plans of the looped
    block: a recompute casts the shared weights again), and the walk, which leaves those
    copies to the runs, prices it at most 5% under (at this size: at batch 2 or 4, where the
    copies weigh more, up to 14% under)."""
    model, args, kwargs = _example(name)
    prof = autoremat.profile(model, args, kwargs, autocast=BF16)
    rng = int(torch.get_rng_state().numel())
    items = {i.path: i for i in planning_tree(prof, selective=False, rng_state=rng).walk()}
    calls = [c for e in chosen for c in (prof.calls_of(e) if "@" not in e else [e])]
    counts = {parse_call(c)[0]: len(prof.calls_of(parse_call(c)[0])) for c in calls}  # type: ignore[index]
    run = rehearsal_for(prof).peak(PlanFields(tuple(calls), {}, counts))
    measured = autoremat.measure(apply(copy.deepcopy(model), calls, calls=counts), args, kwargs,
                                 autocast=BF16)  # fmt: skip
    assert run == measured.peak
    priced = walk_peak([items[c] for c in calls], prof.backward_points, prof.forward_points)
    assert priced >= 0.95 * measured.peak


@pytest.mark.slow
def test_under_autocast_a_budget_plan_for_a_shared_module_holds_it() -> None:
    """Planned under autocast at budgets where the plan recomputes later calls of the shared
    block (priced by FLOPs: the same plan on any machine), the plan holds its budget, and its
    estimate is the measured peak."""
    model, args, kwargs = under_autocast("looped")
    for budget in (0.35, 0.6, 0.9):
        plan = autoremat.plan(model, args, kwargs, budget=budget, autocast=BF16, objective="flops")
        wrapped = plan.apply(copy.deepcopy(model))
        measured = autoremat.measure(wrapped, args, kwargs, autocast=BF16).peak
        assert plan.estimated_peak is not None and plan.budget is not None
        assert measured <= plan.budget, (budget, plan.modules)
        _assert_predicted(plan, measured)

"""Plans persist as JSON (issue 5): save, load, and refuse a model whose structure changed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import autoremat
from autoremat.examples import EXAMPLES
from autoremat.planning.choice import Choice
from autoremat.planning.fingerprint import fingerprint, structure
from autoremat.planning.plan_json import FORMAT
from autoremat.planning.plans import Plan
from autoremat.wrap.checkpointed import wrapped_paths
from conftest import assert_same_step


@pytest.fixture(scope="module")
def gpt2_budget_plan() -> Plan:
    model, args, kwargs = EXAMPLES["gpt2"]()
    # (FLOPs: the plan is the same on every run; by time it follows the measured op times, and
    # a test below needs it to name a module of the last block, as this one does)
    return autoremat.plan(model, args, kwargs, budget="50%", objective="flops")


@pytest.mark.slow
def test_saved_plan_loads_equal_and_applies_with_the_same_gradients(
    gpt2_budget_plan: Plan, tmp_path: Path
) -> None:
    path = tmp_path / "plan.json"
    gpt2_budget_plan.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT
    assert data["model_class"] == "TinyGPT"
    assert data["modules"] == list(gpt2_budget_plan.modules)
    assert len(data["fingerprint"]) == 16
    loaded = Plan.load(path)
    assert loaded == gpt2_budget_plan
    assert loaded.tree is None
    reference, args, kwargs = EXAMPLES["gpt2"]()
    model, _, _ = EXAMPLES["gpt2"]()
    model.load_state_dict(reference.state_dict())
    loaded.apply(model)
    assert set(wrapped_paths(model)) == set(gpt2_budget_plan.modules)
    assert_same_step(reference, model, args, kwargs)


def test_levels_plan_round_trips_through_a_dict() -> None:
    model, args, kwargs = EXAMPLES["cnn"]()
    plan = autoremat.plan(model, args, kwargs, segments=3)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    assert again.segments == 3 and again.strategy == "levels"


def test_loaded_plan_refuses_a_changed_model_naming_what_is_gone(
    gpt2_budget_plan: Plan, tmp_path: Path
) -> None:
    path = tmp_path / "plan.json"
    gpt2_budget_plan.save(path)
    loaded = Plan.load(path)
    model, _, _ = EXAMPLES["gpt2"]()
    del model.h[3]  # the last block is gone, and with it the plan's "h.3.attn"
    before = structure(model)
    gone = r"the plan's modules 'h\.3\.\w+'[^;]* no longer exist"
    with pytest.raises(ValueError, match=gone) as info:
        loaded.apply(model)
    assert "'h.3 Block'" in str(info.value)
    assert "autoremat.plan(model" in str(info.value)
    assert wrapped_paths(model) == () and structure(model) == before


def test_structure_change_outside_the_plan_is_refused_too(gpt2_budget_plan: Plan) -> None:
    model, _, _ = EXAMPLES["gpt2"]()
    model.extra = nn.Linear(2, 2)  # every planned module is still there
    with pytest.raises(ValueError, match=r"new modules: 'extra Linear'"):
        gpt2_budget_plan.apply(model)
    assert wrapped_paths(model) == ()


def test_plan_applied_to_a_different_model_is_refused(gpt2_budget_plan: Plan) -> None:
    model, _, _ = EXAMPLES["cnn"]()
    with pytest.raises(ValueError, match="made for a TinyGPT, not a ConvNet"):
        gpt2_budget_plan.apply(model)
    assert wrapped_paths(model) == ()


def test_fingerprint_ignores_sizes_and_wrapping_but_not_structure() -> None:
    a = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    b = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    c = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)
    before = fingerprint(a)
    autoremat.wrap.apply(a, ["0"])
    assert type(a[0]).__name__ == "CheckpointedLinear"
    assert fingerprint(a) == before


def test_a_plan_on_a_model_of_its_structure_with_other_parameters_warns(caplog) -> None:
    """A fresh user applied a saved plan to the same model built 4x wider, without a word:
    the entries apply (the structure is the same), but the plan's budget and figures were the
    other model's. The plan keeps its model's parameter bytes and says so; a file saved
    before it kept them loads and applies without the check."""

    def mlp(width: int) -> nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 4))

    plan = autoremat.plan(mlp(4), (torch.randn(8, 4),), segments=2)
    assert plan.modules and plan.parameter_bytes == (4 * 4 + 4) * 2 * 4
    loaded = Plan.from_json(json.dumps(plan.to_dict()))
    assert loaded == plan and loaded.parameter_bytes == plan.parameter_bytes
    said = lambda: [r.getMessage() for r in caplog.records if r.name == "autoremat.planning.plans"]  # noqa: E731
    with caplog.at_level("WARNING", logger="autoremat.planning.plans"):
        loaded.apply(mlp(4))
        assert not said()
        for other in (mlp(16), mlp(4).to(torch.bfloat16)):
            loaded.apply(other)
            assert wrapped_paths(other) == tuple(plan.modules)
        assert [m.split(";")[0] for m in said()] == [
            "this plan was made for a Sequential whose parameters hold 160 B",
            "this plan was made for a Sequential whose parameters hold 160 B",
        ]
        assert "this one's hold 592 B" in said()[0] and "this one's hold 80 B" in said()[1]
        assert "Make a plan from this model" in said()[0]
        caplog.clear()
        old = plan.to_dict()
        del old["parameter_bytes"]
        Plan.from_dict(old).apply(mlp(16))
        assert not said()


def test_plan_without_fingerprint_applies_by_names_alone() -> None:
    plan = Plan(modules=("0",), strategy="levels", model_class="Sequential")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    plan.apply(model)
    assert wrapped_paths(model) == ("0",)


def test_not_json_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a saved plan: not JSON"):
        Plan.load(path)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"format": "autoremat.plan/0"}, "'format'"),
        ({"strategy": "greedy"}, "'strategy'"),
        ({"modules": "h.0"}, "'modules'"),
        ({"modules": ["h.0", 3]}, "'modules'"),
        ({"modules": ["h.0[1:x]"]}, "module entry"),
        ({"budget": -5}, "'budget'"),
        ({"budget": True}, "'budget'"),
        ({"choices": [{"path": "h.0"}]}, "choice"),
        ({"fingerprint": 12}, "'fingerprint'"),
        ({"parameter_bytes": -1}, "'parameter_bytes'"),
        ({"parameter_bytes": "160"}, "'parameter_bytes'"),
    ],
)
def test_malformed_plan_names_the_field(
    gpt2_budget_plan: Plan, change: dict[str, object], field: str
) -> None:
    data = {**gpt2_budget_plan.to_dict(), **change}
    with pytest.raises(ValueError, match="not a saved autoremat plan") as info:
        Plan.from_dict(data)
    assert field in str(info.value)


def test_missing_field_is_named(gpt2_budget_plan: Plan) -> None:
    data = gpt2_budget_plan.to_dict()
    del data["modules"]
    with pytest.raises(ValueError, match="field 'modules' is missing"):
        Plan.from_dict(data)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_json)
def test_loader_fuzz_any_json_is_a_plan_or_a_value_error(data: object) -> None:
    try:
        plan = Plan.from_dict(data)
    except ValueError as e:
        assert "not a saved autoremat plan" in str(e)
    else:
        assert isinstance(plan, Plan)


class M(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ModuleDict({"b": nn.Linear(1, 1)})
        self.c = nn.Sequential(nn.Linear(1, 1), nn.ReLU())


def _small_plan() -> Plan:
    model = M()
    return Plan(
        modules=("a.b", "c[0:2]"),
        strategy="levels",
        model_class="M",
        segments=2,
        fingerprint=fingerprint(model),
        structure=structure(model),
    )


def test_the_small_plan_loads() -> None:
    assert Plan.from_dict(_small_plan().to_dict()) == _small_plan()


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(sorted(_small_plan().to_dict())), value=_json)
def test_loader_fuzz_one_field_changed_is_a_plan_or_a_value_error(key: str, value: object) -> None:
    data = _small_plan().to_dict()
    data[key] = value
    try:
        plan = Plan.from_dict(data)
    except ValueError as e:
        assert "not a saved autoremat plan" in str(e)
    else:
        # whatever was accepted round-trips
        assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_state_dict_of_a_model_wrapped_by_a_loaded_plan_keeps_its_keys(
    gpt2_budget_plan: Plan, tmp_path: Path
) -> None:
    model, _, _ = EXAMPLES["gpt2"]()
    keys = list(model.state_dict())
    path = tmp_path / "p.json"
    gpt2_budget_plan.save(path)
    Plan.load(path).apply(model)
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(
        model.state_dict()["h.0.attn.qkv.weight"], model.h[0].attn.qkv.weight.detach()
    )


def test_a_budget_plans_table_says_what_a_run_entry_is() -> None:
    """``c[0:2]`` reads as a slice: the table says, once, that it is children 0 to 1 of the
    Sequential ``c`` recomputed as one; a plan without runs says nothing of it."""
    choices = (Choice("a.b", 64, 10, "full", None), Choice("c[0:2]", 128, 20, "full", None))
    plan = dataclasses.replace(_small_plan(), strategy="budget", segments=None, choices=choices)
    lines = [line for line in plan.table().splitlines() if "recomputed as one" in line]
    assert lines == ["c[0:2]: children 0 to 1 of the nn.Sequential c, recomputed as one "
                     "(path[i:j] as in slicing)"]  # fmt: skip
    alone = dataclasses.replace(plan, modules=("a.b",), choices=choices[:1])
    assert "recomputed as one" not in alone.table()

"""Plan files from elsewhere (issue 13): the loader is bounded by the file's size, refuses a
plan without a fingerprint, checks every field and op name without side effects, and raises
nothing but ``ValueError``."""

from __future__ import annotations

import copy
import itertools
import json
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import autoremat
from autoremat import wrap
from autoremat.core.entries import covered, first_nested, inside
from autoremat.core.selective import DEFAULT_SAVE_OPS, check_names, resolve
from autoremat.planning import plan_json
from autoremat.planning.choice import Choice
from autoremat.planning.fingerprint import fingerprint, structure
from autoremat.planning.plans import Plan

MiB = 2**20


@contextmanager
def peak_below(limit: int) -> Iterator[None]:
    """Fail unless the body's peak of traced allocations stays below ``limit`` bytes."""
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit, f"peak {peak / MiB:.1f} MiB"


def small_model() -> nn.Module:
    return nn.Sequential(
        nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)),
        nn.Linear(4, 4),
        nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
    )


def valid_plan(model: nn.Module | None = None) -> dict[str, Any]:
    """A budget plan of :func:`small_model`, with every field set, as JSON data."""
    model = small_model() if model is None else model
    return Plan(
        modules=("0", "1", "2[0:2]"),
        strategy="budget",
        model_class=type(model).__name__,
        budget=1000,
        estimated_peak=900,
        baseline_peak=2000,
        recompute_flops=10**9,
        objective="time",
        recompute_seconds=0.25,
        choices=(
            Choice("0", 500, 0, "selective", 0.1),
            Choice("1", 300, 64, "full", 0.05),
            Choice("2[0:2]", 300, 64, "full", None),
        ),
        selective={"0": DEFAULT_SAVE_OPS},
        fingerprint=fingerprint(model),
        structure=structure(model),
    ).to_dict()


def refused(data: Any, *fragments: str) -> str:
    """The loader's message for ``data``, which must be refused with a ValueError holding
    every fragment."""
    with pytest.raises(ValueError, match="not a saved autoremat plan") as info:
        Plan.from_dict(data)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    return str(info.value)


def test_the_valid_plan_loads_applies_prints_and_round_trips(tmp_path: Path) -> None:
    data = valid_plan()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data, indent=2))
    plan = Plan.load(path)
    assert plan.to_dict() == data
    assert "predicted peak" in str(plan)
    model = small_model()
    plan.apply(model)
    assert set(wrap.wrapped_paths(model)) == {"0", "1", "2[0:2]"}


# --- a run is never expanded -------------------------------------------------------------


def _written(tmp_path: Path, model: nn.Module, modules: tuple[str, ...], cls: str) -> Path:
    """A levels plan of ``modules`` for ``model``, saved as JSON; its path."""
    data = Plan(
        modules=modules,
        strategy="levels",
        model_class=cls,
        fingerprint=fingerprint(model),
        structure=structure(model),
    ).to_dict()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


def test_a_huge_run_in_a_small_file_is_refused_without_expanding_it(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    path = _written(tmp_path, model, ("[0:3000000]",), "Sequential")
    data = json.loads(path.read_text())
    assert path.stat().st_size < 500
    with peak_below(2 * MiB), pytest.raises(ValueError, match=r"module entry '\[0:3000000\]'"):
        Plan.load(path)
    path.write_text(json.dumps({**data, "fingerprint": None}))
    with peak_below(2 * MiB), pytest.raises(ValueError, match="'fingerprint' is null"):
        Plan.load(path)


def test_a_huge_run_applied_from_python_is_refused_arithmetically() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    plan = Plan(modules=("[0:3000000]", "0"), strategy="levels", model_class="Sequential")
    with peak_below(2 * MiB), pytest.raises(ValueError, match="inside"):
        plan.apply(model)
    with peak_below(2 * MiB), pytest.raises(ValueError, match=r"children 0\.\.2999999"):
        wrap.apply(model, ["[0:3000000]"])
    assert wrap.wrapped_paths(model) == ()


def test_a_huge_run_of_a_changed_model_is_named_without_expanding_it() -> None:
    made_for = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    plan = Plan(
        modules=("[0:3000000]",),
        strategy="levels",
        model_class="Sequential",
        fingerprint=fingerprint(made_for),
        structure=structure(made_for),
    )
    with peak_below(2 * MiB), pytest.raises(ValueError, match="and 2999994 more no longer"):
        plan.apply(nn.Sequential(nn.Linear(2, 2)))


def test_run_bounds_are_checked_against_the_plan_structure() -> None:
    data = valid_plan()
    for entry in ("2[0:3]", "2[1:1]", "2[1:0]", "9[0:1]", "1[0:1]", "[0:4]"):
        refused({**data, "modules": [entry], "choices": [], "selective": {}}, repr(entry))
    refused({**data, "modules": ["0.7"], "choices": [], "selective": {}}, "'0.7'")
    refused({**data, "modules": ["[0:" + "9" * 5000 + "]"]}, "module entry")
    assert Plan.from_dict({**data, "modules": ["[0:3]"], "choices": [], "selective": {}})


# --- nesting, in O(n log n) --------------------------------------------------------------


def wide(n: int) -> nn.Module:
    model = nn.Module()
    for i in range(n):
        model.add_module(f"m{i}", nn.Linear(1, 1))
    return model


@pytest.mark.slow
def test_three_thousand_entries_load_and_apply_in_little_memory(tmp_path: Path) -> None:
    model = wide(3000)
    modules = tuple(f"m{i}" for i in range(3000))
    path = _written(tmp_path, model, modules, "Module")
    data = json.loads(path.read_text())
    with peak_below(5 * MiB):
        plan = Plan.load(path)
        plan.apply(model)
    assert len(wrap.wrapped_paths(model)) == 3000
    seq = nn.Sequential(*(nn.Identity() for _ in range(6000)))
    runs = [f"[{2 * k}:{2 * k + 1}]" for k in range(3000)]
    data = {**data, "modules": runs, "model_class": "Sequential"}
    data |= {"fingerprint": fingerprint(seq), "structure": list(structure(seq))}
    with peak_below(5 * MiB):
        Plan.from_dict(data).apply(seq)
    with pytest.raises(ValueError, match=r"'5999' is inside '\[5999:6000\]'"):
        Plan.from_dict({**data, "modules": [*runs, "[5999:6000]", "5999"]})
    with pytest.raises(ValueError, match=r"'\[5998:5999\]' is inside '\[5998:6000\]'"):
        Plan.from_dict({**data, "modules": [*runs, "[5998:6000]"]})


@pytest.mark.slow
def test_nesting_among_many_entries_is_found() -> None:
    entries = [f"a.{i}" for i in range(30_000)] + [f"s[{2 * i}:{2 * i + 2}]" for i in range(30_000)]
    assert first_nested(entries) is None
    assert first_nested([*entries, "a.17.x"]) == ("a.17.x", "a.17")
    assert first_nested([*entries, "s[59999:60001]"]) == ("s[59998:60000]", "s[59999:60001]")
    assert first_nested([*entries, "s.41.y"]) == ("s.41.y", "s[40:42]")
    assert first_nested([*entries, ""]) is not None


def brute_nested(entries: list[str]) -> tuple[str, str] | None:
    """The rule ``wrap`` checked pairwise before: any covered path of one inside one of
    another's."""
    for a, b in itertools.combinations(sorted(set(entries)), 2):
        for x, y in itertools.product(covered(a), covered(b)):
            if inside(x, y) or inside(y, x):
                return (a, b) if inside(x, y) else (b, a)
    return None


_paths = st.sampled_from(["", "a", "a.0", "a.1", "a.1.b", "a.10", "a.01", "0", "1", "1.c", "b"])
_runs = st.builds(
    "{}[{}:{}]".format,
    st.sampled_from(["", "a", "a.1", "b"]),
    st.integers(0, 11),
    st.integers(0, 12),
)


@given(entries=st.lists(_paths | _runs, max_size=6))
def test_first_nested_agrees_with_the_pairwise_rule(entries: list[str]) -> None:
    found, expected = first_nested(entries), brute_nested(entries)
    assert (found is None) == (expected is None)
    if found is not None:
        inner, outer = found
        assert inner != outer
        assert any(inside(x, y) for x in covered(inner) for y in covered(outer))
        if len(set(entries)) == 2:  # one pair: the same one, the same way round
            assert found == expected


# --- the text: size and depth ------------------------------------------------------------


def test_deep_nesting_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match="nested deeper than"):
        Plan.load(path)
    path.write_text("[" * 200_000)
    with pytest.raises(ValueError, match="nested deeper than"):
        Plan.load(path)
    deep = json.dumps(valid_plan()).replace('"budget": 1000', '"budget": ' + "[" * 40 + "]" * 40)
    with pytest.raises(ValueError, match="nested deeper than"):
        Plan.from_json(deep)
    shallow = json.dumps(valid_plan()).replace('"budget": 1000', '"budget": [[["[[[[[["]]]')
    with pytest.raises(ValueError, match="field 'budget'"):
        Plan.from_json(shallow)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


_tricky = st.text(alphabet='[]{}"\\\n aé\u2028\ud7ff', max_size=6)
_deep_json = st.recursive(
    st.none() | st.integers() | _tricky,
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(_tricky, inner, max_size=2),
    max_leaves=40,
)


@given(value=_deep_json, wraps=st.integers(0, 20), ascii_only=st.booleans())
def test_the_scan_before_parsing_measures_depth_exactly(
    value: Any, wraps: int, ascii_only: bool
) -> None:
    """Strings holding brackets, quotes and escapes do not fool the scan: JSON is refused as
    nested too deep exactly when it is."""
    for k in range(wraps):
        value = [value] if k % 2 else {'[\\"': value}
    text = json.dumps(value, ensure_ascii=ascii_only)
    with pytest.raises(ValueError) as info:
        Plan.from_json(text)
    assert ("nested deeper" in str(info.value)) == (_depth(value) > plan_json.MAX_JSON_DEPTH)


def test_more_arrays_than_a_plan_has_are_refused_before_parsing() -> None:
    with peak_below(MiB), pytest.raises(ValueError, match="more than a plan has"):
        Plan.from_json("[" + "[]," * 100_000 + "{}]")
    crowded = '"budget": [' + "[]," * 100 + "[]]"
    crowded = json.dumps(valid_plan()).replace('"budget": 1000', crowded)
    with pytest.raises(ValueError, match="more than a plan has"):
        Plan.from_json(crowded)


def test_a_file_over_the_size_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "plan.json"
    text = json.dumps(valid_plan())
    path.write_text(text)
    monkeypatch.setattr(plan_json, "MAX_PLAN_BYTES", len(text))
    assert Plan.load(path)
    path.write_text(text + " ")
    with pytest.raises(ValueError, match=f"larger than {len(text)} bytes"):
        Plan.load(path)
    monkeypatch.undo()
    path.write_bytes(b" " * (plan_json.MAX_PLAN_BYTES + 10))
    with peak_below(2 * plan_json.MAX_PLAN_BYTES + MiB), pytest.raises(ValueError, match="larger"):
        Plan.load(path)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"budget": NaN}', "not JSON"),
        (b'{"budget": Infinity}', "not JSON"),
        (b'{"budget": 1' + b"0" * 5000 + b"}", "not JSON"),
        (b"", "not JSON"),
    ],
)
def test_text_that_is_not_strict_json_is_refused(tmp_path: Path, text: bytes, why: str) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(text)
    with pytest.raises(ValueError, match=why):
        Plan.load(path)


# --- fields ------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["modules", "structure", "choices", "selective", "strategy"])
def test_null_where_a_value_belongs_names_the_field(field: str) -> None:
    refused({**valid_plan(), field: None}, repr(field))


def test_null_inside_lists_and_objects_names_the_field() -> None:
    data = valid_plan()
    refused({**data, "selective": {"0": None}}, "'selective'")
    refused({**data, "selective": {"0": ["aten.mm", None]}}, "'selective'")
    refused({**data, "selective": ["0"], "save_ops": None}, "'save_ops'")
    refused({**data, "selective": ["0"], "save_ops": "aten.mm"}, "'save_ops'")
    refused({**data, "modules": ["0", None]}, "'modules'")
    refused({**data, "structure": [*data["structure"], None]}, "'structure'")
    for key in ("path", "freed", "flops", "way"):
        bad = copy.deepcopy(data)
        bad["choices"][1][key] = None
        refused(bad, "'choices'")


def test_a_plan_without_a_fingerprint_is_refused_with_the_fix() -> None:
    data = valid_plan()
    message = refused({**data, "fingerprint": None}, "'fingerprint' is null")
    assert "autoremat.plan(model" in message and "Plan.save" in message
    del data["fingerprint"]
    refused(data, "'fingerprint' is missing", "Plan.save")


def test_a_fingerprint_that_is_not_the_structure_is_refused() -> None:
    data = valid_plan()
    refused({**data, "fingerprint": "0" * 16}, "hashes to", "Plan.save")
    refused({**data, "fingerprint": "xyz"}, "16 hex digits")
    edited = [*data["structure"][:-1], "2.1 GELU"]
    refused({**data, "structure": edited}, "hashes to")
    refused({**data, "structure": []}, "'structure'")
    refused({**data, "structure": ["0 Linear", *data["structure"]]}, "'structure'")


@pytest.mark.parametrize(
    "figure", ["budget", "estimated_peak", "baseline_peak", "recompute_flops", "segments"]
)
def test_a_budget_plan_with_a_null_figure_loads_and_prints(figure: str) -> None:
    plan = Plan.from_dict({**valid_plan(), figure: None})
    assert getattr(plan, figure) is None
    assert "predicted peak" in str(plan)
    for value in (-1, 2**63, 10**400, 1.5, True, "1", [1]):
        refused({**valid_plan(), figure: value}, repr(figure))


def test_seconds_must_be_finite_and_choices_consistent() -> None:
    data = valid_plan()
    for value in (-0.5, float("inf"), float("nan"), 1e300, "1", [0.1]):
        refused({**data, "recompute_seconds": value}, "'recompute_seconds'")
    bad = copy.deepcopy(data)
    bad["choices"][0]["seconds"] = float("inf")
    refused(bad, "'choices'")
    bad = copy.deepcopy(data)
    bad["choices"][0]["path"] = "2"
    refused(bad, "'choices'", "'modules'")
    refused({**data, "selective": {}}, "'choices'", "'selective'")
    refused({**data, "selective": {"2[0:2]": ["aten.mm"]}}, "'selective'")
    refused({**data, "selective": {"2.0": ["aten.mm"]}}, "'selective'")
    refused({**data, "model_class": "os.system()"}, "'model_class'")
    refused({**data, "objective": ["time"]}, "'objective'")


# --- op names: checked without side effects -----------------------------------------------


def namespaces() -> set[str]:
    return set(vars(torch.ops))


@pytest.mark.parametrize("name", ["os.system", "builtins.eval", "nonexistent_ns.mm"])
def test_an_op_of_no_namespace_of_torch_is_refused_and_creates_nothing(name: str) -> None:
    before = namespaces()
    refused({**valid_plan(), "selective": {"0": [name]}}, "'selective'", repr(name))
    assert namespaces() == before
    assert name.partition(".")[0] not in vars(torch.ops)


@pytest.mark.parametrize("name", ["aten", "aten.mm.default", "aten.", ".mm", "a b.mm", "aten.m-m"])
def test_a_malformed_op_name_is_refused(name: str) -> None:
    before = namespaces()
    refused({**valid_plan(), "selective": {"0": [name]}}, "not an op name")
    assert namespaces() == before


def test_an_op_this_build_lacks_loads_and_is_skipped_without_side_effects() -> None:
    data = {**valid_plan(), "selective": {"0": ["aten.nonexistent_op", "aten.mm"]}}
    aten = set(vars(torch.ops.aten))
    plan = Plan.from_dict(data)
    assert plan.selective["0"] == ("aten.nonexistent_op", "aten.mm")
    assert set(vars(torch.ops.aten)) == aten
    assert resolve(("aten.nonexistent_op", "aten.mm")) == {torch.ops.aten.mm}
    assert "nonexistent_op" not in vars(torch.ops.aten)


def test_the_python_api_keeps_its_errors_and_creates_no_namespace() -> None:
    before = namespaces()
    assert check_names(["os.system"]) == ("os.system",)  # skipped, as a missing kernel is
    assert resolve(("os.system",)) == frozenset()
    assert namespaces() == before
    with pytest.raises(ValueError, match="not an op name"):
        check_names(["aten.mm.default"])
    with pytest.raises(TypeError, match="sequence of op names"):
        check_names(["aten.mm", 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="sequence of op names"):
        check_names("aten.mm")
    with pytest.raises(ValueError, match="sequence of op names"):
        check_names(["aten.mm", 3], strict=True)  # type: ignore[list-item]


def test_every_default_op_this_build_has_resolves() -> None:
    have = {n.split(".")[0].replace("::", ".") for n in torch._C._dispatch_get_all_op_names()}
    packets = resolve(DEFAULT_SAVE_OPS)
    for name in DEFAULT_SAVE_OPS:
        if name in have:
            assert getattr(torch.ops.aten, name.partition(".")[2]) in packets, name
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in packets
    assert check_names(DEFAULT_SAVE_OPS, strict=True) == DEFAULT_SAVE_OPS


def test_a_custom_op_library_loaded_later_is_found() -> None:
    lib = torch.library.Library("autoremat_test_ns", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    assert check_names(["autoremat_test_ns.twice"], strict=True)
    assert resolve(("autoremat_test_ns.twice",)) == {torch.ops.autoremat_test_ns.twice}


# --- fuzz --------------------------------------------------------------------------------

_json: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([-1, 0, 2**63, 10**30, 10**400, 1e308, -0.0, 0.5])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["", "0", "2[0:2]", "[0:3000000]", "aten.mm", "os.system", " Linear"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=10,
)


def _places(data: Any, where: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in ``data``: the keys and indices that lead to it."""
    yield where
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _places(v, (*where, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _places(v, (*where, i))


_VALID = valid_plan()
_PLACES = list(_places(_VALID))[1:]


def _mutate(data: Any, where: tuple[Any, ...], how: str, value: Any) -> None:
    *path, last = where
    for key in path:
        data = data[key]
    if how == "drop":
        del data[last]
    elif how == "wrap":
        data[last] = [data[last]]
    elif how == "append" and isinstance(data[last], list):
        data[last].append(value)
    else:
        data[last] = value


@pytest.mark.slow
@given(
    changes=st.lists(
        st.tuples(
            st.sampled_from(_PLACES), st.sampled_from(["set", "drop", "wrap", "append"]), _json
        ),
        min_size=1,
        max_size=3,
    )
)
def test_fuzz_a_mutated_valid_plan_loads_or_is_a_value_error(
    changes: list[tuple[tuple[Any, ...], str, Any]],
) -> None:
    data = copy.deepcopy(_VALID)
    for where, how, value in changes:
        try:
            _mutate(data, where, how, value)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier change removed that place
    text = json.dumps(data)
    for load in (lambda: Plan.from_dict(data), lambda: Plan.from_json(text)):
        _loads_or_refuses(load)


def _loads_or_refuses(load: Callable[[], Plan]) -> None:
    before = namespaces()
    try:
        plan = load()
    except ValueError as e:
        assert "not a saved" in str(e)
        assert len(str(e)) < 2000
    else:
        str(plan)  # prints, whatever figures it has
        assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
        plan.apply(small_model())
    assert namespaces() == before


@given(text=st.text(alphabet='{}[]",:0123456789.-eEnulltrfas \\', max_size=60))
def test_fuzz_any_text_is_a_plan_or_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        Plan.from_json(text)


def test_a_made_plan_round_trips_through_its_data() -> None:
    model = small_model()
    plan = autoremat.plan(model, (torch.randn(2, 4),), segments=2)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan

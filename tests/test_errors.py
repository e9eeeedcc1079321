"""Bad input (issue 5): a ValueError or TypeError that names the argument or module path and
the fix, and the model left as it was; warnings logged for what a user must know."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
from torch import nn

import autoremat
from autoremat.planning.plan import plan_from_profile
from autoremat.planning.plans import Plan
from autoremat.record.recording import SelfCheckpointingError
from autoremat.wrap.checkpointed import wrapped_paths


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.mlp(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _under_inference_mode(call: Callable[[], object]) -> object:
    with torch.inference_mode():
        return call()


def x() -> torch.Tensor:
    return torch.randn(32, 16)


def state(model: nn.Module) -> tuple:
    """Everything a failed call must leave unchanged."""
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [(p, type(m)) for p, m in model.named_modules()],
        [bool(m._forward_hooks or m._forward_pre_hooks) for m in model.modules()],
        model.training,
        wrapped_paths(model),
    )


def assert_same_state(before: tuple, after: tuple) -> None:
    assert before[0].keys() == after[0].keys()
    for k in before[0]:
        assert torch.equal(before[0][k], after[0][k]), k
    assert before[1:] == after[1:]


CASES: dict[str, tuple[Callable[[nn.Module], object], type, str]] = {
    "negative budget": (
        lambda m: autoremat.plan(m, (x(),), budget=-5),
        ValueError,
        r"budget must be positive.*2GiB",
    ),
    "malformed budget": (
        lambda m: autoremat.plan(m, (x(),), budget="lots"),
        ValueError,
        r"'lots' is not understood.*\"800MB\"",
    ),
    "budget of another type": (
        lambda m: autoremat.plan(m, (x(),), budget=[1]),
        TypeError,
        r"budget must be.*got list",
    ),
    "segments and budget": (
        lambda m: autoremat.plan(m, (x(),), segments=2, budget="50%"),
        ValueError,
        r"budget and segments are different aims: pass budget=.*device_memory=.*segments=",
    ),
    "budget and device memory": (
        lambda m: autoremat.plan(m, (x(),), budget="50%", device_memory="1GiB"),
        ValueError,
        r"budget and device_memory are different aims",
    ),
    "an optimizer without a device": (
        lambda m: autoremat.plan(m, (x(),), budget="50%", optimizer="sgd"),
        ValueError,
        r"optimizer= counts in the whole step on a device: pass device_memory=\.\.\. too",
    ),
    "a sharding without a device": (
        lambda m: autoremat.plan(m, (x(),), sharding=autoremat.Sharding("ddp", 2)),
        ValueError,
        r"sharding= counts in the whole step on a device: pass device_memory=\.\.\. too",
    ),
    "a sharding by name": (
        lambda m: autoremat.plan(m, (x(),), device_memory="1GiB", sharding="fsdp2"),
        TypeError,
        r"sharding must be an autoremat.Sharding, such as Sharding\('fsdp2', world_size=8\)",
    ),
    "a plan under inference mode": (  # (it named torch.no_grad, under which plan works)
        lambda m: _under_inference_mode(lambda: autoremat.plan(m, (x(),), budget="50%")),
        ValueError,
        r"the step ran under torch.inference_mode\(\), where no graph is recorded",
    ),
    "an objective for the walk": (  # (the levels walk runs no step: these were ignored)
        lambda m: autoremat.plan(m, (x(),), segments=2, objective="flops"),
        ValueError,
        r"objective= applies to the steps budget= and device_memory= plans run; segments=",
    ),
    "step settings with no aim": (
        lambda m: autoremat.plan(m, (x(),), selective=False, autocast=torch.bfloat16),
        ValueError,
        r"selective= and autocast= apply to the steps .* the aim when none is given\) runs none",
    ),
    "an inductor config without compile": (
        lambda m: autoremat.plan(m, (x(),), budget="50%", inductor_config={"x": 1}),
        ValueError,
        r"inductor_config= patches the compiled step: pass compile=True too",
    ),
    "compile without a budget": (
        lambda m: autoremat.plan(m, (x(),), segments=2, compile=True),
        ValueError,
        r"compile= checks a budget on the compiled step: pass budget=",
    ),
    "negative segments": (
        lambda m: autoremat.plan(m, (x(),), segments=-1),
        ValueError,
        r"segments must be >= 0.*try segments=3",
    ),
    "infeasible budget": (
        lambda m: autoremat.plan(m, (x(),), budget=1000),
        ValueError,
        r"below the lowest peak.*Try budget=\d+",
    ),
    "inputs that fail in forward": (
        lambda m: autoremat.plan(m, (torch.randn(32, 15),), budget="50%"),
        ValueError,
        r"module 'blocks\.0\.mlp\.0'.*pass args/kwargs",
    ),
    "plan of another model": (
        lambda m: autoremat.plan(nn.Sequential(nn.Linear(16, 16), nn.ReLU()), (x(),)).apply(m),
        ValueError,
        r"made for a Sequential, not a Net.*autoremat\.plan\(model",
    ),
    "plan applied to a wrapper of its model (DDP's .module)": (
        lambda m: autoremat.plan(m, (x(),), segments=2).apply(nn.DataParallel(m)),
        ValueError,
        r"made for a Net, not a DataParallel.*the model inside \(DataParallel\.module\)",
    ),
    "path that does not exist": (
        lambda m: Plan(modules=("blocks.7",), strategy="levels", model_class="Net").apply(m),
        ValueError,
        r"'blocks\.7'.*make the plan from this model",
    ),
    "nested paths": (
        lambda m: Plan(modules=("blocks", "blocks.0"), strategy="levels", model_class="Net").apply(
            m
        ),
        ValueError,
        r"'blocks\.0' is inside 'blocks'.*keep only one",
    ),
    "model that is not a module": (
        lambda m: autoremat.plan(lambda t: t, (x(),)),
        TypeError,
        r"model must be a torch\.nn\.Module",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_a_clear_error_and_changes_nothing(case: str) -> None:
    call, error, match = CASES[case]
    model = Net()
    before = state(model)
    with pytest.raises(error, match=match):
        call(model)
    assert_same_state(before, state(model))


def test_forward_failure_is_also_the_runtime_error_it_wraps() -> None:
    with pytest.raises(RuntimeError, match=r"blocks\.0\.mlp\.0") as info:
        autoremat.build_tree(Net(), (torch.randn(32, 15),))
    assert isinstance(info.value, autoremat.ExampleInputsError)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_model_without_submodules_is_refused_for_both_strategies() -> None:
    for kwargs in ({"segments": 2}, {"budget": "50%"}):
        model = nn.Linear(16, 16)
        before = state(model)
        with pytest.raises(ValueError, match=r"no submodules.*nothing to recompute"):
            autoremat.plan(model, (x(),), **kwargs)
        assert_same_state(before, state(model))


def test_remove_on_a_model_never_wrapped_is_a_no_op() -> None:
    model = Net()
    before = state(model)
    assert autoremat.remove(model) is model
    assert_same_state(before, state(model))


class CountingMLP(nn.Sequential):
    """Counts its calls in a Python attribute (a recompute could not replay that)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 16))
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return super().forward(x)


class Counting(nn.Module):
    """``mlp`` counts its calls and runs before and after ``other``."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = CountingMLP()
        self.other = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.other(self.mlp(x)))


def test_skipped_module_is_logged_once_with_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    """A module left out is named once, by its path (not once per call), with the reason;
    no call of it is in the plan, while ``other`` between its calls can be."""
    model = nn.Sequential(Counting(), nn.Linear(16, 4))
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        plan = autoremat.plan(model, (torch.randn(64, 16),), budget="90%")
    messages = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(messages) == 1
    assert messages[0].count("'0.mlp': its forward changes the Python attribute 'seen'") == 1
    assert not any(e.startswith("0.mlp") for e in plan.modules), plan.modules
    assert "0.mlp" in plan.left_out and plan.modules


def test_budget_near_the_lowest_peak_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    model = Net()
    with pytest.raises(ValueError, match=r"Try budget=(\d+)") as info:
        autoremat.plan(model, (x(),), budget=1000)
    lowest = int(str(info.value).split("Try budget=")[1].split(",")[0])
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        autoremat.plan(model, (x(),), budget=lowest)
    assert any("recomputes about all it can" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        autoremat.plan(model, (x(),), budget="95%")
    assert not any("recomputes about all it can" in r.getMessage() for r in caplog.records)


def test_the_planner_returns_its_warnings_and_plan_logs_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What a strategy has to say is on the plan (``Plan.warnings``, by kind), ``plan()`` logs
    it on its module's logger (under ``autoremat``), and ``plan_from_profile`` (what ``fit``
    uses) logs nothing: no caller filters records by their text."""
    model = nn.Sequential(Counting(), nn.Linear(16, 4))
    inputs = (torch.randn(64, 16),)
    prof = autoremat.profile(model, inputs)
    lowest = autoremat.lowest_budget(model, inputs)
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        quiet = plan_from_profile(model, prof, lowest)
    assert caplog.records == []
    assert set(quiet.warnings) == {"left_out", "near_lowest"}
    assert "'0.mlp'" in quiet.warnings["left_out"]
    assert "recomputes about all it can" in quiet.warnings["near_lowest"]
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        logged = autoremat.plan(model, inputs, budget=lowest)
    assert sorted(r.getMessage() for r in caplog.records) == sorted(logged.warnings.values())
    assert {r.name for r in caplog.records} == {"autoremat.training.plan"}
    assert autoremat.plan(model, inputs, budget="100%").warnings.keys() == {"left_out"}


def test_a_lowest_peak_just_under_the_peak_is_not_called_100_percent_of_it() -> None:
    """The refusal's share of the peak is floored: a lowest at 99.8% of the peak (this model's
    weights' gradients dominate its step) reads 99%, not 100%, which would say recompute
    lowers nothing."""
    m = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(3)))
    with pytest.raises(autoremat.BudgetTooLow) as refused:
        autoremat.plan(m, (torch.randn(88, 256),), budget=1000)
    assert 0.995 * refused.value.baseline < refused.value.lowest < refused.value.baseline
    assert "(99% of the" in str(refused.value)


def test_a_budget_plan_made_in_eval_mode_says_its_training_step_may_exceed_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """In eval mode the planned step runs without dropout: its plan, applied to the training
    step, measures over the budget (the danger), so ``plan`` warns once and says the fix; in
    training mode, and for the levels strategy (no step run), it says nothing."""
    torch.manual_seed(0)
    blocks = (nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.5)) for _ in range(6))
    model = nn.Sequential(*blocks)
    inputs = (torch.randn(256, 64),)
    model.eval()
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        made = autoremat.plan(model, inputs, budget="60%", objective="flops")  # (not by timing)
    assert "call model.train() before planning" in made.warnings["eval_mode"]
    assert [r.getMessage() for r in caplog.records] == [made.warnings["eval_mode"]]
    assert model.training is False  # (left as found)
    model.train()
    made.apply(model)
    assert autoremat.measure(model, inputs).peak > made.budget
    autoremat.remove(model)
    assert "eval_mode" not in autoremat.plan(model, inputs, budget="95%").warnings
    assert "eval_mode" not in autoremat.plan(model.eval(), inputs, segments=2).warnings
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        found = autoremat.fit(model, lambda b: ((torch.randn(b, 64),), {}), device_memory="4MiB")
    assert "may exceed the device's memory" in found.plan.warnings["eval_mode"]
    assert found.plan.warnings["eval_mode"] in [r.getMessage() for r in caplog.records]


def test_a_budget_of_a_few_bytes_or_below_zero_says_what_it_may_have_meant() -> None:
    """``"50"`` is 50 bytes (too low for any plan): the refusal offers ``"50%"``; ``"-1"`` is
    refused as negative."""
    with pytest.raises(autoremat.BudgetTooLow, match=r"for 50 percent, give '50%'"):
        autoremat.plan(Net(), (x(),), budget="50")
    with pytest.raises(autoremat.BudgetTooLow) as far:
        autoremat.plan(Net(), (x(),), budget=1000)
    assert "percent" not in str(far.value)
    with pytest.raises(ValueError, match=r"budget '-1' is negative"):
        autoremat.plan(Net(), (x(),), budget="-1")


def test_too_low_says_when_recompute_frees_nothing_and_gives_bytes_once() -> None:
    """Where no plan lowers the step's peak (its lowest is the peak without recompute), the
    refusal says so rather than quoting 100%; a budget given in bytes is not repeated, nor
    the lowest when it is written in bytes already."""
    model, inputs = nn.Sequential(nn.Linear(64, 64)), (torch.randn(32, 64),)
    least = autoremat.lowest_budget(model, inputs)
    with pytest.raises(autoremat.BudgetTooLow) as info:
        autoremat.plan(model, inputs, budget=least - 1)
    text = str(info.value)
    assert info.value.lowest == info.value.baseline == least
    assert "recompute frees nothing at this step's peak" in text and "100%" not in text
    assert text.startswith(f"budget {least - 1:,} bytes is below the lowest peak")
    assert text.count(str(least)) == 1 and text.count(f"{least:,}") == 1, text


def test_the_library_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    model = Net()
    plan = autoremat.plan(model, (x(),), budget="90%")
    plan.apply(model)
    model(x()).sum().backward()
    autoremat.remove(model)
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


class ChecksItself(nn.Module):
    """Calls ``torch.utils.checkpoint`` in its own forward, with no switch to turn it off."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(2))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def test_a_model_that_recomputes_itself_without_a_switch_is_refused_by_name() -> None:
    """Not a bare ``KeyError``: the error names the module recomputed in backward and the fix,
    and the model is left as it was."""
    model = ChecksItself()
    before = state(model)
    with pytest.raises(SelfCheckpointingError, match=r"module 'blocks\.1' ran its forward during"):
        autoremat.plan(model, (x(),), budget="50%")
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        autoremat.profile(model, (x(),))
    assert_same_state(before, state(model))

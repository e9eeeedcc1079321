"""What a recompute cannot replay is found while planning (issue 13): Python state a forward
changes, and inputs changed in place. Such a module is left out of both strategies' plans, with
its reason in ``plan.left_out``, in the log and in the saved plan.

Each case plans a model, applies the plan and compares training steps (loss, every gradient,
every buffer; dropout on, same seeds) with an unwrapped copy made after planning (planning runs
the forward, which moves the very state under test). Most also force the module in with
``wrap.apply`` and show that this breaks (gradients differ, a side effect happens twice, or
backward fails), so that what is left out really had to be; and the common torchvision shape
(an in-place ReLU after a BatchNorm) shows what need not be.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoremat
from autoremat import wrap
from autoremat.planning.planning_tree import planning_tree
from autoremat.planning.plans import Plan
from autoremat.planning.rehearsal import PlanFields, rehearsal_for
from autoremat.planning.solver import walk_peak
from autoremat.planning.strategies.levels import choose_levels
from autoremat.record.tree import Node
from conftest import assert_same_step

WIDTH = 32


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDTH, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, WIDTH))


class Around(nn.Module):
    """``a``, then ``mid`` (the module under test), then ``b``: plain blocks on either side."""

    def __init__(self, mid: nn.Module) -> None:
        super().__init__()
        self.a = mlp()
        self.mid = mid
        self.b = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.mid(self.a(x)))


class WarmUp(nn.Module):
    """Scales its output by a warm-up factor that grows with a step counter it keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        return torch.tanh(self.lin(x) * min(1.0, self.step / 1000))


class Recorder(nn.Module):
    """Appends the norm of each input it sees to a list (for a regulariser, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.seen: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(float(x.detach().norm()))
        return torch.tanh(self.lin(x))


class ReluInPlace(nn.Module):
    """Applies ReLU to its own input in place, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(F.relu(x, inplace=True))


class Both(nn.Module):
    """Returns its input and a function of it (nothing inside saves the input itself)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.tanh(x * 3)


class Doubling(nn.Module):
    """Calls ``Both`` and doubles the first output, its input, in place; then calls ``b``, or
    (``last``) no module: the doubled tensor is gone before any other hook runs."""

    def __init__(self, view: bool = False, last: bool = False) -> None:
        super().__init__()
        self.a = mlp()
        self.both = Both()
        self.b = mlp()
        self.view, self.last = view, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        same, other = self.both(self.a(x))
        (same.view(-1) if self.view else same).mul_(2)
        if self.last:
            return torch.cat([same, other], dim=-1)
        return self.b(same + other)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) * self.factor)


class SetsChild(nn.Module):
    """Sets its child's ``factor`` before each of two calls: the child's first call cannot be
    replayed alone (the factor is 2.0 by then), this module's can."""

    def __init__(self) -> None:
        super().__init__()
        self.child = Scaled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.child.factor = 0.5
        y = self.child(x)
        self.child.factor = 2.0
        return self.child(y)


class Carries(nn.Module):
    """Starts from the state it kept, if any, and keeps its output as the next state: a
    recurrent layer with a cache (RecurrentGemma's ``rg_lru.recurrent_states``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x) + (0 if self.state is None else self.state))
        self.state = y.detach()
        return y


class ResetsChild(nn.Module):
    """Resets its child's state before calling it, as RecurrentGemma's recurrent block resets
    ``rg_lru.recurrent_states`` when the cache is off."""

    def __init__(self) -> None:
        super().__init__()
        self.child = Carries()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.child.state = None
        return self.child(x)


class Noisy(nn.Module):
    """Adds noise drawn from a generator of its own (not the global one checkpoint replays)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) + torch.rand(x.shape, generator=self.gen))


class LazySetUp(nn.Module):
    """Sets an attribute on its first forward only, as Hugging Face heads set
    ``config.problem_type``: nothing changes once set, so a recompute replays it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.kind: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is None:
            self.kind = "regression"
        return torch.tanh(self.lin(x))


def x_in() -> torch.Tensor:
    return torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(0))


def planned(model: nn.Module, args: tuple[Any, ...], **how: Any) -> tuple[Plan, nn.Module]:
    """The plan for ``model``, applied to it, and an unwrapped copy made after planning."""
    plan = autoremat.plan(model, args, **how)
    reference = copy.deepcopy(model)
    plan.apply(model)
    return plan, reference


def same_two_steps(
    reference: nn.Module, model: nn.Module, args: tuple[Any, ...], kwargs: Any = None
) -> None:
    for _ in range(2):
        assert_same_step(reference, model, args, kwargs or {})


def breaks(model: nn.Module, paths: list[str], args: tuple[Any, ...]) -> bool:
    """Whether wrapping ``paths`` of ``model`` (a copy) trains otherwise than ``model``: other
    losses, gradients or buffers, or an error in forward or backward."""
    reference, forced = copy.deepcopy(model), copy.deepcopy(model)
    wrap.apply(forced, paths)
    try:
        same_two_steps(reference, forced, args)
    except (AssertionError, RuntimeError):
        return True
    return False


STRATEGIES = [
    pytest.param({"segments": 1}, id="levels"),
    pytest.param({"budget": 0.75}, id="budget"),
]


# --- Python state ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", STRATEGIES)
def test_a_warm_up_counter_is_left_out_with_every_module_around_it(how, caplog) -> None:
    model = Around(nn.Sequential(WarmUp(), nn.Dropout(0.1), mlp()))
    tree = autoremat.build_tree(model, (x_in(),))
    assert tree.find("mid.0").replay_reason == (
        "its forward changes the Python attribute 'step' (a recompute would see the changed value)"
    )
    for around in ("mid", ""):
        assert "attribute 'step' of its submodule 'mid.0'" in tree.find(around).replay_reason
    assert all(tree.find(p).recompute_reason is None for p in ("a", "b", "mid.2", "mid.0.lin"))
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        plan, reference = planned(model, (x_in(),), **how)
    assert plan.modules and not {"", "mid", "mid.0"} & set(plan.modules)
    assert "mid" in plan.left_out and "'step'" in plan.left_out["mid"]
    logged = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(logged) == 1 and "'mid': the Python attribute 'step'" in logged[0]
    same_two_steps(reference, model, (x_in(),))
    assert model.mid[0].step == reference.mid[0].step
    autoremat.remove(model)
    assert breaks(model, ["mid.0"], (x_in(),)) and breaks(model, ["mid"], (x_in(),))


def test_a_module_appending_to_a_list_is_left_out() -> None:
    model = Around(Recorder())
    plan, reference = planned(model, (x_in(),), segments=1)
    assert plan.left_out["mid"] == (
        "its forward changes the Python attribute 'seen' (a recompute would see the changed value)"
    )
    assert plan.modules == ("a", "b")
    same_two_steps(reference, model, (x_in(),))
    assert len(model.mid.seen) == len(reference.mid.seen)
    autoremat.remove(model)
    forced = copy.deepcopy(model)
    wrap.apply(forced, ["mid"])
    before = len(forced.mid.seen)
    forced(x_in()).sum().backward()
    assert len(forced.mid.seen) == before + 2  # the recompute appended again


def test_a_parent_that_sets_its_childs_attribute_replays_it_and_is_kept() -> None:
    model = Around(SetsChild())
    tree = autoremat.build_tree(model, (x_in(),))
    assert "is changed by another module's forward" in tree.find("mid.child").replay_reason
    assert tree.find("mid").recompute_reason is None
    plan, reference = planned(model, (x_in(),), segments=2)
    assert "mid" in plan.modules and plan.left_out == {}  # mid.child is inside mid
    same_two_steps(reference, model, (x_in(),))
    autoremat.remove(model)
    assert breaks(model, ["mid.child"], (x_in(),))
    assert not breaks(model, ["mid"], (x_in(),))


def test_a_parent_that_resets_its_childs_state_before_each_call_is_kept() -> None:
    """The child's state changes in every forward (a new tensor each time), but its parent
    sets it to the same value before each call: the parent, and every module around it,
    replays it and is kept; the child alone would start its recompute from the state its
    forward left, and is left out, named with the attribute (issue 40)."""
    model = Around(ResetsChild())
    tree = autoremat.build_tree(model, (x_in(),))
    reason = tree.find("mid.child").replay_reason
    assert reason is not None and "its forward changes the Python attribute 'state'" in reason
    assert tree.find("mid").recompute_reason is None and tree.recompute_reason is None
    plan, reference = planned(model, (x_in(),), segments=2)
    assert "mid" in plan.modules and plan.left_out == {}
    same_two_steps(reference, model, (x_in(),))
    autoremat.remove(model)
    assert breaks(model, ["mid.child"], (x_in(),))
    assert not breaks(model, ["mid"], (x_in(),))


def test_recurrent_gemma_is_planned_around_its_recurrent_layers_state() -> None:
    """transformers' RecurrentGemma: its recurrent block resets ``rg_lru.recurrent_states``
    before each call when the cache is off (as the wrapped model trains): only the two
    ``rg_lru`` layers are left out, and the lowest plan measures below the decoder layers
    checkpointed by hand (before: 8 modules up to the root left out, lowest above them)."""
    t = pytest.importorskip("transformers")
    t.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = t.RecurrentGemmaConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, intermediate_size=128, lru_width=64, attention_window_size=16,
        block_types=("recurrent", "recurrent", "attention"), head_dim=16,
    )  # fmt: skip
    model = t.RecurrentGemmaForCausalLM(config).train()
    ids = torch.randint(0, 128, (2, 32))
    kwargs = {"input_ids": ids, "labels": ids}
    lowest = autoremat.lowest_budget(model, (), kwargs)
    plan = autoremat.plan(model, (), kwargs, budget=lowest, objective="flops")
    assert sorted(plan.left_out) == [f"model.layers.{i}.temporal_block.rg_lru" for i in (0, 1)]
    assert all("'recurrent_states'" in why for why in plan.left_out.values())
    layers = [f"model.layers.{i}" for i in range(3)]
    by_hand = autoremat.measure(wrap.apply(copy.deepcopy(model), layers), (), kwargs).peak
    reference = copy.deepcopy(model)
    plan.apply(model)
    assert autoremat.measure(model, (), kwargs).peak <= lowest < by_hand
    same_two_steps(reference, model, (), kwargs)


@pytest.mark.parametrize("how", STRATEGIES)
def test_a_private_random_generator_is_left_out(how) -> None:
    model = Around(nn.Sequential(Noisy(), mlp()))
    plan, reference = planned(model, (x_in(),), **how)
    assert "Python attribute 'gen'" in plan.left_out["mid"]
    assert not {"", "mid", "mid.0"} & set(plan.modules)
    same_two_steps(reference, model, (x_in(),))
    autoremat.remove(model)
    assert breaks(model, ["mid.0"], (x_in(),))


class Decays(nn.Module):
    """Shrinks its own weight in place as its forward begins (a constraint applied inside
    forward), then uses it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.mul_(0.9)
        return torch.tanh(self.lin(x))


@pytest.mark.filterwarnings("ignore:autoremat. the model wrote in place:RuntimeWarning")
@pytest.mark.parametrize("how", STRATEGIES)
def test_a_forward_that_writes_a_parameter_in_place_is_left_out(how) -> None:
    """A recompute would write the weight a second time (before: planned, nothing left out,
    the weight 0.9 times the unwrapped model's after a step); the Linear it calls is not left
    out (its own forward writes nothing). Planning says it wrote the user's weight."""
    model = Around(nn.Sequential(Decays(), mlp()))
    with pytest.warns(RuntimeWarning, match="wrote in place to 'mid.0.lin.weight'"):
        plan, reference = planned(model, (x_in(),), **how)
    assert "the parameter 'weight' of its submodule 'mid.0.lin'" in plan.left_out["mid"]
    assert not {"", "mid", "mid.0"} & set(plan.modules) and "mid.0.lin" not in plan.left_out
    tree = autoremat.build_tree(Around(nn.Sequential(Decays(), mlp())), (x_in(),))
    assert "its submodule 'mid.0.lin' changes" in tree.find("mid.0").replay_reason
    assert tree.find("mid.0.lin").recompute_reason is None
    same_two_steps(reference, model, (x_in(),))
    autoremat.remove(model)
    assert breaks(model, ["mid.0"], (x_in(),))


class ReadsShared(nn.Module):
    """Scales its output by ``shared``, a buffer another module changes later."""

    def __init__(self, shared: torch.Tensor) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 64), nn.Linear(64, WIDTH)
        self.register_buffer("shared", shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * self.shared.clone()  # (not saved itself)


class UpdatesShared(nn.Module):
    def __init__(self, shared: torch.Tensor) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("shared", shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        with torch.no_grad():
            self.shared.mul_(0.9).add_(0.1 * y.abs().mean())
        return y


@pytest.mark.parametrize("how", STRATEGIES)
def test_a_buffer_another_module_changes_after_the_call_is_left_out(how) -> None:
    """One tensor, a buffer of both: the reader's recompute would read what the updater wrote
    after its call (before: planned, nothing left out, gradients off; the wrap replays only
    the buffers a module's own forward changes). Around both, the sequence is recomputed
    exactly: the change happens inside its call."""
    shared = torch.ones(WIDTH)
    model = Around(nn.Sequential(ReadsShared(shared), UpdatesShared(shared), mlp()))
    tree = autoremat.build_tree(model, (x_in(),))
    assert "its buffer 'shared' is changed after its call" in tree.find("mid.0").replay_reason
    assert tree.find("mid").recompute_reason is None
    plan, reference = planned(model, (x_in(),), **how)
    assert "mid.0" not in plan.modules
    same_two_steps(reference, model, (x_in(),))
    autoremat.remove(model)
    assert breaks(model, ["mid.0"], (x_in(),)) and not breaks(model, ["mid"], (x_in(),))


class DrawsFrom(nn.Module):
    """Adds noise drawn from the generator its caller passes (``gen``), counting the draws
    made while recomputing."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 64), nn.Linear(64, WIDTH)
        self.recomputed = 0

    def forward(self, x: torch.Tensor, gen: Any) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if isinstance(gen, torch.Generator):
            noise = torch.randn(h.shape, generator=gen)
        else:  # (random.Random, NumPy's: one number for the whole batch)
            noise = torch.tensor(gen.random() if hasattr(gen, "random") else gen.rand())
        self.recomputed += autoremat.is_recomputing()
        return self.fc2(torch.tanh(h + noise))


class PassesGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = DrawsFrom(), DrawsFrom()

    def forward(self, x: torch.Tensor, gen: Any) -> torch.Tensor:
        return self.second(self.first(x, gen), gen=gen)  # (positionally, then by keyword)


@pytest.mark.parametrize("kind", ["torch", "python", "numpy", "numpy legacy"])
def test_a_generator_passed_in_is_replayed_for_the_recompute(kind) -> None:
    """A forward that draws from a generator its caller passes draws the same in its
    recompute (before: other noise, gradients off by most of their scale, with nothing
    left out), and the generator ends where the unwrapped step leaves it."""
    import random

    import numpy as np

    make = {"torch": lambda: torch.Generator().manual_seed(7), "python": lambda: random.Random(7),
            "numpy": lambda: np.random.default_rng(7),
            "numpy legacy": lambda: np.random.RandomState(7)}[kind]  # fmt: skip
    torch.manual_seed(0)
    model, x = PassesGenerator(), x_in()
    wrapped = wrap.apply(copy.deepcopy(model), ["first", "second"])
    ends = []
    for m in (model, wrapped):
        gen = make()
        loss = m(x, gen).square().mean()
        loss.backward()
        ends.append(torch.rand(1, generator=gen).item() if kind == "torch"
                    else gen.random() if hasattr(gen, "random") else gen.rand())  # fmt: skip
    assert [wrapped.first.recomputed, wrapped.second.recomputed] == [1, 1]
    for (name, p), q in zip(model.named_parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert ends[0] == ends[1]
    plan = autoremat.plan(model, (x,), {"gen": make()}, budget=0.9)
    assert plan.modules and not plan.left_out


def test_what_only_a_first_forward_sets_up_is_not_left_out() -> None:
    model = Around(LazySetUp())
    assert all(n.recompute_reason is None for n in autoremat.build_tree(model, (x_in(),)).walk())
    plan, reference = planned(model, (x_in(),), segments=2)
    assert plan.left_out == {} and "mid" in plan.modules
    same_two_steps(reference, model, (x_in(),))


def test_an_attribute_inside_an_object_is_named_by_its_path() -> None:
    class State:
        def __init__(self) -> None:
            self.count = 0

    class Counts(Scaled):
        def __init__(self) -> None:
            super().__init__()
            self.state = State()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.state.count += 1
            return super().forward(x)

    tree = autoremat.build_tree(Around(Counts()), (x_in(),))
    assert "the Python attribute 'state.count'" in tree.find("mid").replay_reason


def test_long_lists_and_plain_tensor_attributes_are_seen_at_bounded_cost() -> None:
    class Keeps(Scaled):
        def __init__(self) -> None:
            super().__init__()
            self.history = list(range(100_000))  # compared by length and first items
            self.slots = [slice(0, 1), range(3)]  # objects without a __dict__
            self.ema = torch.zeros(WIDTH)  # a plain attribute, no buffer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)

    class Appends(Keeps):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.history.append(0)
            return super().forward(x)

    class Averages(Keeps):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.ema.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)
            return super().forward(x)

    assert autoremat.build_tree(Around(Keeps()), (x_in(),)).find("mid").replay_reason is None
    tree = autoremat.build_tree(Around(Appends()), (x_in(),))
    assert "attribute 'history'" in tree.find("mid").replay_reason
    tree = autoremat.build_tree(Around(Averages()), (x_in(),))
    assert "attribute 'ema'" in tree.find("mid").replay_reason


# --- inputs changed in place ----------------------------------------------------------------


@pytest.mark.parametrize("how", STRATEGIES)
def test_a_module_that_changes_its_input_in_place_is_left_out_its_parent_is_not(how) -> None:
    model = Around(ReluInPlace())
    tree = autoremat.build_tree(model, (x_in(),))
    assert tree.find("mid").inplace_reason == (
        "its forward changes its input 'args[0]' in place (checkpoint keeps its inputs for the "
        "recompute, so backward would fail)"
    )
    assert tree.recompute_reason is None  # the input it changes is made inside the root
    plan, reference = planned(model, (x_in(),), **how)
    assert "mid" not in plan.modules and "in place" in plan.left_out["mid"]
    same_two_steps(reference, model, (x_in(),))
    autoremat.remove(model)
    assert breaks(model, ["mid"], (x_in(),))
    assert not breaks(model, [""], (x_in(),))


@pytest.mark.parametrize(
    "view, last", [(False, False), (True, False), (False, True)], ids=["itself", "view", "last"]
)
def test_an_output_that_is_the_input_changed_in_place_by_the_caller_is_left_out(
    view: bool, last: bool
) -> None:
    model = Doubling(view, last)
    tree = autoremat.build_tree(model, (x_in(),))
    assert tree.find("both").inplace_reason == (
        "its output 'out[0]' is its input 'args[0]' or a view of it, and is changed in place "
        "after it returns (checkpoint keeps its inputs for the recompute, so backward would "
        "fail)"
    )
    assert tree.recompute_reason is None
    plan, reference = planned(model, (x_in(),), segments=0)
    assert plan.modules == ("",) and "both" not in plan.left_out  # never met by the walk
    same_two_steps(reference, model, (x_in(),))
    autoremat.remove(model)
    assert breaks(model, ["both"], (x_in(),))


def test_an_output_changed_in_place_that_is_no_input_is_recomputed_exactly() -> None:
    class Caller(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = mlp()
            self.after = mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.inner(x)
            y.mul_(2)
            return self.after(y)

    model = Caller()
    assert all(n.recompute_reason is None for n in autoremat.build_tree(model, (x_in(),)).walk())
    assert not breaks(model, ["inner"], (x_in(),))


class BasicBlock(nn.Module):
    """torchvision's ResNet block: one in-place ReLU module used twice, ``out += identity``."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class ResNetLike(nn.Module):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)
        )
        self.layer1 = nn.Sequential(BasicBlock(c), BasicBlock(c))
        self.layer2 = nn.Sequential(BasicBlock(c), BasicBlock(c))
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(c, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer2(self.layer1(self.stem(x))))


def image() -> torch.Tensor:
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("how", [{"segments": 3}, {"budget": 0.6}], ids=["levels", "budget"])
def test_in_place_relu_after_batchnorm_leaves_out_only_the_relu(how) -> None:
    model = ResNetLike()
    tree = autoremat.build_tree(model, (image(),))
    flagged = {n.path for n in tree.walk() if n.recompute_reason}
    assert flagged == {"stem.2"} | {f"layer{i}.{j}.relu" for i in (1, 2) for j in (0, 1)}
    plan, reference = planned(model, (image(),), **how)
    assert plan.modules and set(plan.left_out) <= flagged
    same_two_steps(reference, model, (image(),))
    autoremat.remove(model)
    # the BatchNorm whose output the ReLU changes in place, and the Sequential around both,
    # are recomputed exactly; the ReLU alone is not
    assert not breaks(model, ["stem.1"], (image(),))
    assert not breaks(model, ["stem"], (image(),))
    assert not breaks(model, ["stem[1:3]", "layer1.0.bn1"], (image(),))
    assert breaks(model, ["stem.2"], (image(),))


def test_runs_that_start_at_an_in_place_module_are_not_offered() -> None:
    model = nn.Sequential(
        nn.Linear(WIDTH, 64), nn.ReLU(inplace=True), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)
    )
    prof = autoremat.profile(model, (x_in(),))
    assert prof.tree.find("1").inplace_reason is not None
    runs = planning_tree(prof).runs
    assert runs and all(i != 1 for i, *_ in runs)
    assert any(i == 0 and j > 1 for i, j, *_ in runs)  # the ReLU's input is made inside these


def test_inference_tensors_have_no_version_and_are_skipped() -> None:
    with torch.inference_mode():
        x = x_in()
    tree = autoremat.build_tree(Around(mlp()), (x,))
    assert all(n.recompute_reason is None for n in tree.walk())


# --- the levels walk ------------------------------------------------------------------------


def node(path: str, *children: Node, reason: str | None = None) -> Node:
    return Node(
        name=path.rsplit(".", 1)[-1],
        path=path,
        module=nn.Identity(),
        children=list(children),
        replay_reason=reason,
    )


def leaf(path: str, reason: str | None = None) -> Node:
    return node(path, reason=reason)


def test_levels_dissolve_a_split_point_that_cannot_be_recomputed() -> None:
    def tree(reason: str | None) -> Node:
        a = node("a", node("a.x", leaf("a.x.l")), node("a.y", leaf("a.y.l")), reason=reason)
        return node("", a, node("b", node("b.x", leaf("b.x.l")), node("b.y", leaf("b.y.l"))))

    assert [n.path for n in choose_levels(tree(None), 1)] == ["a", "b"]
    left_out: dict[str, str] = {}
    chosen = choose_levels(tree("changes 'step'"), 1, left_out)
    assert [n.path for n in chosen] == ["a.x", "a.y", "b"]  # a's children take its place
    assert left_out == {"a": "changes 'step'"}


def test_levels_root_that_cannot_be_recomputed_is_never_the_scheme() -> None:
    root = node("", node("a", leaf("a.l")), node("b", leaf("b.l")), reason="changes 'n'")
    left_out: dict[str, str] = {}
    assert [n.path for n in choose_levels(root, 0, left_out)] == ["a", "b"]
    assert left_out == {"": "changes 'n'"}


def test_levels_a_parent_of_a_dissolved_node_with_only_leaves_is_a_split_point() -> None:
    root = node("", node("p", node("u", leaf("u.l"), reason="in place"), leaf("p.l")), leaf("z"))
    left_out: dict[str, str] = {}
    assert [n.path for n in choose_levels(root, 0, left_out)] == [""]
    assert [n.path for n in choose_levels(root, 1, left_out)] == ["p"]
    assert left_out == {}  # u was never met on a level: p, around it, was chosen


def test_levels_a_leaf_with_a_reason_stays_a_leaf() -> None:
    root = node("", node("p", leaf("p.a", reason="in place"), leaf("p.b")), leaf("z"))
    assert [n.path for n in choose_levels(root, 1)] == ["p"]


# --- the plan carries the reasons -----------------------------------------------------------


def test_reasons_are_printed_saved_and_loaded(tmp_path: Path) -> None:
    model = Around(nn.Sequential(WarmUp(), mlp()))
    plan = autoremat.plan(model, (x_in(),), segments=1)
    assert set(plan.left_out) == {"", "mid", "mid.0"}
    text = plan.summary()
    assert "left out (3 modules):" in text and "  mid.0: its forward changes" in text
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan and again.left_out == plan.left_out
    data = json.loads(path.read_text())
    del data["left_out"]  # a plan saved before the field existed
    assert Plan.from_dict(data).left_out == {}


@pytest.mark.parametrize(
    "left_out, fragment",
    [
        ([], "field 'left_out' is [], expected an object"),
        ({"nope": "x"}, "'nope' is not a module"),
        ({"mid": 3}, "expected a reason"),
        ({"mid": "x" * 5000}, "expected a reason"),
        (None, "field 'left_out' is None"),
    ],
)
def test_a_wrong_left_out_is_refused(left_out: object, fragment: str) -> None:
    model = Around(mlp())
    data = autoremat.plan(model, (x_in(),), segments=1).to_dict()
    data["left_out"] = left_out
    with pytest.raises(ValueError, match="not a saved autoremat plan") as info:
        Plan.from_dict(data)
    assert fragment in str(info.value)


# --- no false positives ---------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*torch.nn.utils.weight_norm.*:FutureWarning")
@pytest.mark.parametrize("norm", [nn.utils.spectral_norm, nn.utils.weight_norm])
def test_torch_hook_based_norms_leave_nothing_out(norm) -> None:
    """The hook-based ``spectral_norm`` and ``weight_norm`` set ``weight`` as each call begins,
    from the module's own parameters and buffers (which the wrap replays): before, every
    module around one was left out for it, and a model of such blocks got no plan (its lowest
    budget the peak without recompute, a helper's discriminator-style model)."""

    def blocks() -> nn.Module:  # (built twice: weight_norm's hook makes a model no deepcopy takes)
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Sequential(norm(nn.Linear(WIDTH, 64)), nn.GELU(),
                                             nn.Linear(64, WIDTH)) for _ in range(3)))  # fmt: skip

    model, reference = blocks(), blocks()
    tree = autoremat.build_tree(model, (x_in(),))
    assert {n.path: n.recompute_reason for n in tree.walk() if n.recompute_reason} == {}
    lowest = autoremat.lowest_budget(model, (x_in(),))
    assert lowest < autoremat.measure(model, (x_in(),)).peak
    plan = autoremat.plan(model, (x_in(),), budget=lowest)
    assert plan.modules and not plan.left_out
    same_two_steps(reference, plan.apply(model), (x_in(),))


def test_no_example_model_has_anything_left_out(example) -> None:
    _, model, args, kwargs = example
    tree = autoremat.build_tree(model, args, kwargs)
    assert {n.path: n.recompute_reason for n in tree.walk() if n.recompute_reason} == {}
    assert autoremat.plan(model, args, kwargs, segments=3).left_out == {}


@pytest.mark.parametrize("name", ["gpt2", "cnn"])
def test_budget_plans_of_examples_leave_nothing_out(name: str) -> None:
    from autoremat.examples import EXAMPLES

    model, args, kwargs = EXAMPLES[name]()
    assert autoremat.plan(model, args, kwargs, budget=0.7).left_out == {}


def test_budget_too_low_names_the_modules_left_out() -> None:
    """When modules that would have freed memory were left out, the infeasible budget's
    message says so (they may be why it cannot be met)."""

    class Warm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)
            self.step = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.step += 1
            return self.b(torch.tanh(self.a(x))) * min(1.0, self.step / 10)

    torch.manual_seed(0)
    model = nn.Sequential(Warm(), nn.Linear(16, 1))
    with pytest.raises(autoremat.BudgetTooLow, match=r"left out \('\(root\)', '0'"):
        autoremat.plan(model, (torch.randn(512, 16),), budget="30%")


class DenseLayer(nn.Module):
    """torchvision's ``_DenseLayer``: takes the list of features so far."""

    def __init__(self, cin: int, growth: int = 4) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(cin)
        self.conv = nn.Conv2d(cin, growth, 3, padding=1)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.conv(torch.relu(self.norm(torch.cat(features, 1))))


class DenseBlock(nn.Module):
    """torchvision's ``_DenseBlock``: appends each layer's output to the list it passed in."""

    def __init__(self, cin: int = 4, layers: int = 3, growth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(cin + k * growth, growth) for k in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


@pytest.mark.parametrize("how", [{"segments": 8}, {"budget": "95%"}])
def test_a_list_its_caller_appends_to_after_the_call_is_recomputed_as_called(how) -> None:
    """DenseNet's dense layers get the list of features their block appends to afterwards:
    the recompute gets the list as it was at the call (before: a ``CheckpointError`` in
    backward), so the planned model trains exactly, BatchNorm included."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), DenseBlock(), nn.Flatten())
    x = torch.randn(16, 3, 16, 16)  # (large enough that a checkpoint frees its RNG state)
    options = {"objective": "flops"} if "budget" in how else {}
    chosen = autoremat.plan(model, (x,), **how, **options)
    assert any(e.startswith("1.layers.") for e in chosen.modules), chosen.modules
    reference, wrapped = copy.deepcopy(model), chosen.apply(copy.deepcopy(model))
    assert_same_step(reference, wrapped, (x,), {})
    assert_same_step(reference, wrapped, (x,), {})  # the statistics moved once per step


def test_a_checkpoint_keeps_the_list_as_called_not_what_the_caller_appends_to_it() -> None:
    """The checkpoint of a dense layer keeps the tensors of its list as it was called, not the
    caller's list: holding the list kept everything the block appended to it later alive
    until the layer's backward (torchvision DenseNet's lowest plan measured 4.1% over its
    budget). The measured peak is its step's run, and the walk prices it no lower."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), DenseBlock(8, layers=3, growth=8))
    x = torch.randn(8, 3, 16, 16)
    prof = autoremat.profile(model, (x,))
    chosen = autoremat.Plan(modules=("1.layers.0",), strategy="budget", model_class="Sequential")
    wrapped = chosen.apply(copy.deepcopy(model))
    item = planning_tree(prof, rng_state=RNG).children[1].children[0]
    assert item.path == "1.layers.0"
    measured = autoremat.measure(wrapped, (x,)).peak
    assert rehearsal_for(prof).peak(PlanFields(chosen.modules)) == measured
    assert walk_peak([item], prof.backward_points, prof.forward_points) >= measured


RNG = int(torch.get_rng_state().numel())  # a checkpoint keeps one on the CPU


class SwinMLP(nn.Module):
    """torchvision Swin's MLP: ``mlp[2:5]`` starts at a Dropout whose input (a GELU output)
    nothing saves, so checkpointing that run keeps it."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1),
            nn.Linear(4 * width, width), nn.Dropout(0.1),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def test_a_run_holds_its_first_childs_input_while_its_forward_runs() -> None:
    """A run's checkpoint keeps its input from its start: the solver prices that (the run item
    was priced with nothing held: Swin's lowest plan measured 4.4% over its budget)."""
    torch.manual_seed(0)
    model = nn.Sequential(SwinMLP(), SwinMLP())
    x = torch.randn(8, 64, 64)
    prof = autoremat.profile(model, (x,))
    mlp = planning_tree(prof, rng_state=RNG).children[0].children[1]
    assert mlp.path == "0.mlp"
    run = next(r for i, j, r in mlp.runs if (i, j) == (2, 5))
    assert run.held == x.numel() * 4 * 4 + RNG  # the GELU output: 4 x width floats per token
    chosen = autoremat.Plan(modules=("0.mlp[2:5]",), strategy="budget", model_class="Sequential")
    wrapped = chosen.apply(copy.deepcopy(model))
    measured = autoremat.measure(wrapped, (x,)).peak
    assert rehearsal_for(prof).peak(PlanFields(chosen.modules)) == measured
    assert walk_peak([run], prof.backward_points, prof.forward_points) >= measured
    assert_same_step(copy.deepcopy(model), wrapped, (x,), {})


@pytest.mark.parametrize("view", [False, True], ids=["itself", "view"])
def test_an_aliased_output_changed_by_the_caller_names_the_module_when_forced(view: bool) -> None:
    """Forced past the planner (wrapped by hand), a module whose output is its input, changed
    in place by the caller afterwards, fails in backward with an error naming the module and
    the fix, not torch's nameless "modified by an inplace operation"."""
    model = Doubling(view)
    wrap.apply(model, ["both"])
    loss = model(x_in()).sum()
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match=r"module 'both'.*Fix"):
        loss.backward()

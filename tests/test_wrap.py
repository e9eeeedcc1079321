"""Claim 4 and what users expect of a wrapped model: identical training, same names, undoable."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError

import autoremat
from autoremat import wrap
from autoremat.examples import EXAMPLES
from autoremat.wrap import checkpointed
from autoremat.wrap.checkpointed import Checkpointed, CheckpointedRuns
from conftest import assert_same_step, train_step


@pytest.mark.slow
@pytest.mark.parametrize("segments", [1, 3, 8])
def test_training_step_identical_on_every_example(example, segments):
    """Loss, gradients and buffers after one step equal the unwrapped model's, with dropout and
    BatchNorm active, on GPT-2, BERT, Llama, ViT (Hugging Face), a BatchNorm CNN, a UNet with
    skips, a plain GPT-2-like model and an MLP chain."""
    _, model, args, kwargs = example
    reference = copy.deepcopy(model)
    plan = autoremat.plan(model, args, kwargs, segments=segments)
    assert plan.modules
    plan.apply(model)
    assert set(autoremat.wrap.wrapped_paths(model)) == set(plan.modules)
    assert_same_step(reference, model, args, kwargs)
    # a second step too: nothing left over from the first one (buffers moved once each time)
    assert_same_step(reference, model, args, kwargs)


def test_dropout_is_really_active_in_the_examples():
    """Guards the test above: with dropout on, two seeds give two losses, so equal losses under
    one seed mean the recompute replayed the same masks."""
    model, args, kwargs = EXAMPLES["gpt2"]()
    assert train_step(model, args, kwargs, seed=1) != train_step(model, args, kwargs, seed=2)


def test_plain_checkpoint_double_counts_batchnorm_but_autoremat_does_not():
    """pytorch#96136: the recompute of a checkpointed BatchNorm updates its statistics again.
    The first half shows the trap exists in torch 2.13; the second that the wrap avoids it."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    bn = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    torch.utils.checkpoint.checkpoint(bn, x, use_reentrant=False).sum().backward()
    assert int(bn[1].num_batches_tracked) == 2  # the trap: counted twice

    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    wrap.apply(model, ["0"])
    assert_same_step(reference, model, (x,), {})
    assert int(model[0][1].num_batches_tracked) == 1


def test_wrapping_follows_claim_4(monkeypatch):
    """The wrapped module's class inherits nn.Module and the module's own class, and its forward
    calls torch.utils.checkpoint.checkpoint (non-reentrant) with a function that runs the
    module's own forward."""
    calls = []
    real = checkpointed.checkpoint

    def spy(fn, *args, **kwargs):
        calls.append(kwargs)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(checkpointed, "checkpoint", spy)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 1))
    wrap.apply(model, ["0"])
    inner = model[0]
    assert isinstance(inner, nn.Module)
    assert isinstance(inner, nn.Sequential)
    assert isinstance(inner, Checkpointed)
    assert type(inner).__name__ == "CheckpointedSequential"
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert len(calls) == 1
    assert calls[0]["use_reentrant"] is False
    assert calls[0]["preserve_rng_state"] is True
    with torch.no_grad():  # nothing is stored for backward, so nothing is checkpointed
        model(torch.randn(2, 4))
    assert len(calls) == 1


def test_names_and_state_dict_unchanged_and_loadable_both_ways():
    model, args, kwargs = EXAMPLES["hf-gpt2"]()
    original = copy.deepcopy(model)
    keys = list(model.state_dict())
    params = [n for n, _ in model.named_parameters()]
    modules = [n for n, _ in model.named_modules()]
    autoremat.plan(model, args, kwargs, segments=3).apply(model)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == params
    assert [n for n, _ in model.named_modules()] == modules
    model.load_state_dict(original.state_dict())  # unwrapped -> wrapped
    original.load_state_dict(model.state_dict())  # wrapped -> unwrapped


def test_remove_gives_back_the_original_modules():
    model, args, kwargs = EXAMPLES["gpt2"]()
    before = [(n, m, type(m)) for n, m in model.named_modules()]
    plan = autoremat.plan(model, args, kwargs, segments=3)
    assert autoremat.remove(plan.apply(model)) is model
    assert [(n, m, type(m)) for n, m in model.named_modules()] == before
    assert autoremat.wrap.wrapped_paths(model) == ()
    assert "_autoremat_path" not in model.h[0].__dict__
    assert autoremat.remove(model) is model  # never-applied (again): a no-op


def test_apply_twice_is_a_no_op_and_another_plan_is_refused():
    model, args, kwargs = EXAMPLES["gpt2"]()
    reference = copy.deepcopy(model)
    blocks = autoremat.plan(model, args, kwargs, segments=3)
    blocks.apply(model)
    blocks.apply(model)
    assert type(model.h[0]).__mro__.count(Checkpointed) == 1
    other = autoremat.plan(reference, args, kwargs, segments=0)
    with pytest.raises(ValueError, match="remove"):
        other.apply(model)
    assert set(autoremat.wrap.wrapped_paths(model)) == set(blocks.modules)
    assert_same_step(reference, model, args, kwargs)


def test_apply_refuses_unknown_and_nested_paths_and_changes_nothing():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"'0\.7'"):
        wrap.apply(model, ["0", "0.7"])
    with pytest.raises(ValueError, match="inside"):
        wrap.apply(model, ["0", "0.0"])
    with pytest.raises(ValueError, match="inside"):
        wrap.apply(model, ["", "1"])
    assert autoremat.wrap.wrapped_paths(model) == ()


class Keywords(nn.Module):
    """A module with positional, keyword and non-tensor arguments and a nested output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, scale: float, *, mode: str = "a", extra=None):
        y = self.drop(self.lin(x)) * scale
        if mode == "b":
            y = y + extra["bias"]
        return {"out": y, "aux": (y.tanh(), mode), "n": 3}


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    note: str


class UsesKeywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Keywords()
        self.head = nn.Linear(4, 1)

    def forward(self, x, bias):
        r = self.inner(x, 2.0, mode="b", extra={"bias": bias})
        assert r["aux"][1] == "b" and r["n"] == 3
        return Output(self.head(r["out"] + r["aux"][0]), "ok")


def test_keyword_and_non_tensor_arguments_and_nested_outputs_pass_through():
    torch.manual_seed(0)
    model = UsesKeywords()
    reference = copy.deepcopy(model)
    args = (torch.randn(3, 4), torch.randn(4, requires_grad=True))
    wrap.apply(model, ["inner"])
    out = model(*args)
    assert isinstance(out, Output) and out.note == "ok"
    assert_same_step(reference, model, args, {})


class TwiceUsed(nn.Module):
    """One block called twice per forward, and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Dropout(0.1))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.block(self.block(self.emb(ids))))


def test_module_called_twice_and_tied_weights():
    model = TwiceUsed()
    ids = torch.randint(0, 10, (4, 6))
    tree = autoremat.build_tree(model, (ids,))
    assert tree.find("block").calls == 2
    reference = copy.deepcopy(model)
    wrap.apply(model, ["block"])
    assert_same_step(reference, model, (ids,), {})


def test_frozen_inputs_still_train_the_wrapped_module():
    """No input of the wrapped block requires grad (frozen embedding): the reentrant default
    would give the block no gradients; the wrap trains it exactly like the unwrapped model."""
    model = TwiceUsed()
    model.emb.weight.requires_grad_(False)
    model.head = nn.Linear(8, 10)  # untie so the head still trains
    ids = torch.randint(0, 10, (4, 6))
    reference = copy.deepcopy(model)
    wrap.apply(model, ["block"])
    assert_same_step(reference, model, (ids,), {})
    assert model.block[0].weight.grad is not None


class Cache:
    """A key/value-cache-like object that a layer appends to."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []


class CachingLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, cache=None):
        k = self.lin(x)
        if cache is not None:
            cache.keys.append(k)
            k = torch.cat(cache.keys, dim=0)[-x.shape[0] :]
        return k


def test_input_changed_in_place_gives_a_clear_error_naming_the_module():
    model = nn.Sequential()
    model.add_module("layer", CachingLayer())
    wrap.apply(model, ["layer"])
    cache = Cache()
    out = model.layer(torch.randn(2, 4), cache=cache)
    with pytest.raises(CheckpointError, match=r"'layer'.*inputs.*use_cache=False"):
        out.sum().backward()
    wrap.remove(model)
    x = torch.randn(2, 4)
    reference = copy.deepcopy(model)
    wrap.apply(model, ["layer"])
    assert_same_step(reference, model, (x,), {})  # without a cache it trains normally


def test_hf_cache_is_turned_off_in_training_and_kept_otherwise(caplog):
    model, args, kwargs = EXAMPLES["hf-gpt2"]()
    kwargs = {**kwargs, "use_cache": True}
    reference = copy.deepcopy(model)
    autoremat.plan(model, args, kwargs, segments=3).apply(model)
    autoremat.core.huggingface._warned.clear()  # the warning is logged once per process
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        assert_same_step(reference, model, args, kwargs)
    assert "use_cache=False" in caplog.text
    assert model(*args, **kwargs).cache is None
    with torch.no_grad():  # inference keeps its cache
        assert model(*args, **kwargs).cache is not None
    model.eval()
    assert model(*args, **kwargs).cache is not None
    autoremat.remove(model)
    model.train()
    assert model(*args, **kwargs).cache is not None  # the hook is gone


@pytest.mark.slow
def test_a_plan_that_recomputes_nothing_still_trains_the_step_it_was_priced_on():
    """A budget the model meets without recompute gives a plan with no entry; applied, it
    turns the Hugging Face cache off in training as every plan does, so the measured step is
    the predicted one (untouched, the model's step fills its cache: 2% more)."""
    model, args, kwargs = EXAMPLES["hf-gpt2"]()
    untouched = autoremat.measure(copy.deepcopy(model), args, kwargs).peak
    plan = autoremat.plan(model, args, kwargs, budget=1.0)
    assert plan.modules == () and plan.estimated_peak is not None
    assert untouched > plan.estimated_peak  # what the cache costs
    plan.apply(model)
    assert autoremat.measure(model, args, kwargs).peak == plan.estimated_peak
    assert model(*args, **kwargs).cache is None
    autoremat.remove(model)
    assert model(*args, **kwargs).cache is not None


@pytest.mark.parametrize("name", ["cnn", "hf-bert"])
def test_build_tree_and_plan_leave_the_model_as_found(name):
    model, args, kwargs = EXAMPLES[name]()
    train_step(model, args, kwargs)  # give it gradients and moved statistics
    model.get_submodule(next(n for n, _ in model.named_children())).eval()
    state = copy.deepcopy(model.state_dict())
    grads = {n: p.grad for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    rng = torch.random.get_rng_state()
    autoremat.build_tree(model, args, kwargs)
    autoremat.plan(model, args, kwargs, segments=2)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(p.grad is grads[n] for n, p in model.named_parameters())
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_runs_of_sequential_children_are_recomputed_as_one():
    """A plan entry ``path[i:j]`` recomputes children i..j-1 of a plain Sequential as one
    checkpoint: the same step, names and keys unchanged, and remove undoes it."""
    torch.manual_seed(0)
    inner = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 8)
    )
    model = nn.Sequential(nn.Linear(8, 8), inner, nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    x = (torch.randn(32, 8),)
    wrap.apply(model, ["1[0:4]", "[2:3]"])
    assert set(autoremat.wrap.wrapped_paths(model)) == {"1[0:4]", "[2:3]"}
    assert isinstance(model[1], CheckpointedRuns) and isinstance(model, nn.Sequential)
    assert list(model.state_dict()) == keys
    assert_same_step(reference, model, x, {})
    assert int(model[1][1].num_batches_tracked) == 1
    autoremat.remove(model)
    assert type(model) is nn.Sequential and type(model[1]) is nn.Sequential
    assert "_autoremat_runs" not in model[1].__dict__


def test_bad_runs_are_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"plain nn\.Sequential"):
        wrap.apply(model, ["[1:5]"])
    with pytest.raises(ValueError, match="inside"):
        wrap.apply(model, ["[0:2]", "1"])
    with pytest.raises(ValueError, match="inside"):
        wrap.apply(model, ["[0:2]", "[1:3]"])
    with pytest.raises(ValueError, match="does not have"):
        wrap.apply(model, ["nope[0:2]"])
    assert autoremat.wrap.wrapped_paths(model) == ()

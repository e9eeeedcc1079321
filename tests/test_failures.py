"""State is never lost (issue 13): every failure in ``build_tree``, ``profile``, ``plan``,
``measure`` and ``apply`` leaves the model exactly as it was (parameters and buffers with their
shapes, dtypes and values, gradients, classes, hooks, modes, the torch, Python and NumPy random
states), and ``apply`` is all or nothing.

A forward that changes state and then raises is the failure here: it resizes, rebinds,
registers or deletes a buffer, changes a buffer's dtype, rebinds a parameter, adds a submodule
or a hook, switches a submodule's mode or class, sets a ``.grad``, freezes a parameter, draws
from torch's, Python's and NumPy's generators; then it raises on its n-th call (so in any of
the runs a call makes: the tree, the recorded step, the timed forwards, the measured steps) or
in backward. A successful call must leave the same state.
"""

from __future__ import annotations

import copy
import gc
import random
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import autoremat
import autoremat.comparison.recomputed
from autoremat import wrap
from autoremat.core import huggingface
from autoremat.record.snapshot import RestoreError, all_or_nothing, modules_kept, preserved
from autoremat.training.scale_batch import scale_batch
from autoremat.wrap.checkpointed import Checkpointed
from conftest import assert_same_step, tiny_llama
from conftest import train_step as conftest_train_step


class Boom(RuntimeError):
    """The failure the test models raise."""


class FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise Boom("failed in backward")


class OtherNorm(nn.BatchNorm1d):
    """The class a forward swaps its norm's class for."""


def _resize(m: Faulty) -> None:
    b = m._buffers.get("stat")
    if b is not None:
        b.resize_(b.numel() + 5).fill_(1.0)


def _dtype(m: Faulty) -> None:
    b = m._buffers.get("stat")
    if b is not None:
        b.data = b.data.double()


def _lazy_stat(m: Faulty) -> None:
    if m._buffers.get("stat") is not None and m.stat.numel() != 11:
        m.stat = torch.zeros(11)  # as a lazily sized statistic does: rebinds the buffer


def _register(m: Faulty) -> None:
    if "extra" not in m._buffers:
        m.register_buffer("extra", torch.ones(3))


def _delete(m: Faulty) -> None:
    if "spare" in m._buffers:
        del m.spare


def _class(m: Faulty) -> None:
    m.norm.__class__ = OtherNorm


ACTIONS: dict[str, Callable[[Faulty], object]] = {
    "resize buffer": _resize,
    "rebind buffer": lambda m: m._buffers.__setitem__("stat", torch.ones(4)),
    "lazy statistic": _lazy_stat,
    "buffer dtype": _dtype,
    "register buffer": _register,
    "delete buffer": _delete,
    "rebind parameter": lambda m: setattr(m.lin, "bias", nn.Parameter(torch.zeros(8))),
    "freeze parameter": lambda m: m.lin.weight.requires_grad_(False),
    "add submodule": lambda m: setattr(m, "added", nn.Linear(2, 2)),
    "add hook": lambda m: m.lin.register_forward_hook(lambda *a: None),
    "switch mode": lambda m: m.norm.train(not m.norm.training),
    "swap class": _class,
    "set grad": lambda m: setattr(m.lin.weight, "grad", torch.ones_like(m.lin.weight)),
    "torch random": lambda m: torch.rand(3),
    "python random": lambda m: random.random(),
    "numpy random": lambda m: np.random.rand(),
}


class Faulty(nn.Module):
    """Runs ``actions`` in its forward, then raises on call number ``fail_at`` (or in backward
    with ``"backward"``; never with ``None``). Calls are counted in a list kept outside."""

    def __init__(self, actions: Any, fail_at: int | str | None, calls: list[int]) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.2)
        self.register_buffer("stat", torch.zeros(8))
        self.register_buffer("spare", torch.arange(4.0), persistent=False)
        self.actions = tuple(actions)
        self.fail_at = fail_at
        self.calls = calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(1)
        y = self.drop(self.norm(self.lin(x)))
        for name in self.actions:
            ACTIONS[name](self)
        if self.fail_at == len(self.calls):
            raise Boom(f"failed on call {self.fail_at}")
        if self.fail_at == "backward" and torch.is_grad_enabled():
            y = FailInBackward.apply(y)
        return y


def model_with(actions: Any, fail_at: int | str | None) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8), nn.Tanh(), Faulty(actions, fail_at, []), nn.ReLU(), nn.Linear(8, 1)
    )
    model[0].weight.grad = torch.full_like(model[0].weight, 0.5)  # a .grad to keep
    model[4].eval()  # a mode to keep
    return model


def _state_of(model: nn.Module) -> dict[str, Any]:
    """Everything a call must leave as it found: tensors (object, class, dtype, device, shape,
    strides, requires_grad, value), gradients (object, value), each module's class, mode,
    instance attribute names, hook dictionary keys, slot names; the random generators."""
    tensors = {}
    for kind, named in (
        ("parameter", model.named_parameters(remove_duplicate=False)),
        ("buffer", model.named_buffers(remove_duplicate=False)),
    ):
        for n, t in named:
            layout = (id(t), type(t), t.dtype, t.device, tuple(t.shape), t.stride())
            tensors[f"{kind} {n}"] = (*layout, t.requires_grad, t.detach().clone())
    grads = {
        n: None if p.grad is None else (id(p.grad), p.grad.detach().clone())
        for n, p in model.named_parameters(remove_duplicate=False)
    }
    modules = [
        (
            path,
            type(m),
            m.training,
            sorted(vars(m)),
            {k: list(v) for k, v in vars(m).items() if "hooks" in k and isinstance(v, dict)},
            [list(m._parameters), list(m._buffers), list(m._modules)],
            sorted(m._non_persistent_buffers_set),
        )
        for path, m in model.named_modules(remove_duplicate=False)
    ]
    generators = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    return {"tensors": tensors, "grads": grads, "modules": modules, "generators": generators}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    for part in before:
        if isinstance(before[part], dict):
            assert before[part].keys() == after[part].keys(), part
            for key in before[part]:
                assert _same(before[part][key], after[part][key]), (part, key)
        elif part == "modules":
            for was, now in zip(before[part], after[part], strict=True):
                assert _same(was, now), (was, now)
        else:
            for i, (was, now) in enumerate(zip(before[part], after[part], strict=True)):
                assert _same(was, now), (part, i)


def _raised_boom(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a :class:`Boom` or was caused by one."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, Boom):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


X = torch.randn(16, 8)
ENTRIES: dict[str, Callable[[nn.Module], object]] = {
    "build_tree": lambda m: autoremat.build_tree(m, (X,)),
    "profile": lambda m: autoremat.profile(m, (X,)),
    "plan segments": lambda m: autoremat.plan(m, (X,), segments=2),
    "plan budget": lambda m: autoremat.plan(m, (X,), budget=1.0),  # profiles all the same
    "measure": lambda m: autoremat.measure(m, (X,), repeats=2),
}


def _run(entry: str, model: nn.Module) -> BaseException | None:
    try:
        ENTRIES[entry](model)
    except Exception as exc:
        return exc
    return None


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("action", ACTIONS)
def test_a_forward_that_changes_state_then_fails_changes_nothing(entry: str, action: str) -> None:
    model = model_with([action], fail_at=1)
    before = _state_of(model)
    error = _run(entry, model)
    assert _raised_boom(error), error
    assert_unchanged(before, _state_of(model))


@pytest.mark.parametrize("entry", ["profile", "plan budget", "measure"])
def test_a_failure_in_backward_changes_nothing(entry: str) -> None:
    model = model_with(ACTIONS, fail_at="backward")
    before = _state_of(model)
    assert _raised_boom(_run(entry, model))
    assert_unchanged(before, _state_of(model))


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_successful_call_changes_nothing_either(entry: str) -> None:
    model = model_with(ACTIONS, fail_at=None)
    before = _state_of(model)
    ENTRIES[entry](model)
    assert_unchanged(before, _state_of(model))


@settings(max_examples=25)
@given(
    actions=st.sets(st.sampled_from(list(ACTIONS))),
    fail_at=st.sampled_from([1, 2, 3, 4, 6, "backward", None]),
    entry=st.sampled_from(list(ENTRIES)),
)
def test_any_failure_point_changes_nothing(actions: set[str], fail_at: Any, entry: str) -> None:
    """Any mix of state changes, failing at any call (the tree, the recorded step, a timed
    forward, a measured step) or in backward, or not at all: the model is as it was."""
    model = model_with(sorted(actions), fail_at)
    before = _state_of(model)
    error = _run(entry, model)
    if fail_at == 1 or (fail_at == "backward" and entry in ("profile", "plan budget", "measure")):
        assert _raised_boom(error), error
    assert_unchanged(before, _state_of(model))


def test_a_part_that_cannot_be_put_back_is_named_and_the_rest_is_put_back() -> None:
    """A module whose class refuses ``__class__`` assignment cannot get its class back: a
    RestoreError names it (chained to the call's own error); everything else is back."""

    class Stuck(OtherNorm):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "__class__":
                raise TypeError("this class is final")
            super().__setattr__(name, value)

    def stick(m: Faulty) -> None:
        m.norm.__class__ = Stuck

    model = model_with(["resize buffer", "torch random", "add hook"], fail_at=1)
    model[2].actions += ("stuck",)
    ACTIONS["stuck"] = stick
    try:
        before = _state_of(model)
        with pytest.raises(RestoreError, match=r"module '2\.norm'.*this class is final") as info:
            autoremat.build_tree(model, (X,))
    finally:
        del ACTIONS["stuck"]
    assert _raised_boom(info.value.__cause__)
    after = _state_of(model)
    assert [m[1] for m in after["modules"]] == [
        Stuck if p == "2.norm" else cls for p, cls, *_ in before["modules"]
    ]
    object.__setattr__(model[2].norm, "__class__", nn.BatchNorm1d)  # past Stuck's refusal
    assert_unchanged(before, _state_of(model))


def test_a_parameter_written_in_place_is_reported() -> None:
    """Parameters are not copied (that would double their memory): a forward that writes into
    one keeps its write, and a RuntimeWarning names it."""

    class Writes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.lin.weight.clamp_(-0.1, 0.1)
            return self.lin(x)

    model = nn.Sequential(Writes(), nn.ReLU())
    with pytest.warns(RuntimeWarning, match=r"'0\.lin\.weight'"):
        autoremat.build_tree(model, (torch.randn(2, 4),))


def test_a_lazy_module_stays_initialised() -> None:
    """A lazy module that the call initialised keeps its parameters (and its new class)."""
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 1))
    autoremat.build_tree(model, (torch.randn(2, 5),))
    assert type(model[0]) is nn.Linear and model[0].weight.shape == (4, 5)


def test_a_model_on_the_meta_device_is_put_back_without_warnings() -> None:
    """Buffers on ``meta`` have no values (nothing copied, nothing reported); their slots,
    shapes and dtypes are still put back."""
    with torch.device("meta"):
        model = model_with(["resize buffer", "buffer dtype", "register buffer"], fail_at=None)
        x = torch.randn(16, 8)
    shapes = {n: (b.shape, b.dtype) for n, b in model.named_buffers()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autoremat.build_tree(model, (x,))
        autoremat.measure(model, (x,))
    assert {n: (b.shape, b.dtype) for n, b in model.named_buffers()} == shapes


def test_preserved_keeps_cuda_generators_untouched_on_cpu() -> None:
    """On a CPU-only run, preserving does not initialise CUDA."""
    if torch.cuda.is_initialized():
        pytest.skip("CUDA already initialised")
    with preserved(nn.Linear(2, 2)):
        pass
    assert not torch.cuda.is_initialized()


# ---- apply: all or nothing ----


class Net(nn.Module):
    def __init__(self, b: nn.Module) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.b = b
        self.c = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


class Sealed(type):
    """A metaclass that refuses subclasses of its classes."""

    def __new__(mcls, name: str, bases: tuple[type, ...], ns: dict[str, Any]) -> Sealed:
        if any(isinstance(b, Sealed) for b in bases):
            raise TypeError(f"{name}: {bases[-1].__name__} is sealed")
        return super().__new__(mcls, name, bases, ns)


class SealedBlock(nn.Linear, metaclass=Sealed):
    pass


def test_apply_with_a_class_that_cannot_be_subclassed_changes_nothing() -> None:
    """The second entry's class cannot be made: a ValueError names the module, the reason and
    the fix, and no module changed (the first one's class was made, never swapped in)."""
    model = Net(SealedBlock(8, 8))
    before = _state_of(model)
    with pytest.raises(ValueError, match=r"module 'b' cannot be wrapped.*sealed.*out of the plan"):
        wrap.apply(model, ["a", "b"])
    assert_unchanged(before, _state_of(model))
    assert autoremat.wrap.wrapped_paths(model) == ()


def test_apply_with_a_bad_path_changes_nothing() -> None:
    model = Net(nn.Linear(8, 8))
    before = _state_of(model)
    with pytest.raises(ValueError, match=r"'nope'"):
        wrap.apply(model, ["a", "nope"])
    with pytest.raises(ValueError, match=r"leave it out of the plan"):
        model.b.forward = model.b.forward  # replaced on the instance: cannot be wrapped
        try:
            wrap.apply(model, ["a", "b"])
        finally:
            del model.b.forward
    assert_unchanged(before, _state_of(model))


class Stubborn(nn.Linear):
    """Refuses ``__class__`` assignment: the swap fails after the earlier ones were made."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "__class__":
            raise TypeError("Stubborn keeps its class")
        super().__setattr__(name, value)


def test_apply_failing_half_way_undoes_the_swaps_made() -> None:
    model = Net(Stubborn(8, 8))
    before = _state_of(model)
    with pytest.raises(TypeError, match="keeps its class"):
        wrap.apply(model, ["a", "b", "c"])
    assert_unchanged(before, _state_of(model))
    assert autoremat.wrap.wrapped_paths(model) == ()


class UsesCache(nn.Module):
    """A Hugging Face-style module (``config.use_cache`` and a ``use_cache`` argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"use_cache": True})()
        self.inner = Net(nn.Linear(8, 8))

    def forward(self, x: torch.Tensor, use_cache: bool = True) -> torch.Tensor:
        return self.inner(x)


def test_apply_failing_after_the_cache_hook_undoes_the_hook(monkeypatch) -> None:
    model = UsesCache()
    before = _state_of(model)

    def hook_then_fail(m: nn.Module, warn: bool = True) -> None:
        real(m, warn)
        assert model._forward_pre_hooks, "the hook was registered"
        raise Boom("after the hook")

    real = huggingface.turn_cache_off_in_training
    monkeypatch.setattr(huggingface, "turn_cache_off_in_training", hook_then_fail)
    with pytest.raises(Boom):
        wrap.apply(model, ["inner.a", "inner.b"])
    assert_unchanged(before, _state_of(model))
    assert "__reduce_ex__" not in vars(model)


def test_remove_failing_half_way_leaves_the_model_wrapped(monkeypatch) -> None:
    model = wrap.apply(UsesCache(), ["inner.a", "inner.b"])
    before = _state_of(model)

    def fail(m: nn.Module) -> None:
        raise Boom("while removing")

    monkeypatch.setattr(huggingface, "remove_cache_hooks", fail)
    with pytest.raises(Boom):
        autoremat.remove(model)
    assert_unchanged(before, _state_of(model))
    assert autoremat.wrap.wrapped_paths(model) == ("inner.a", "inner.b")


REGISTRY: list[str] = []


class Registered(nn.Module):
    """Registers every subclass, as plugin registries do."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        REGISTRY.append(cls.__name__)


class Plugin(Registered):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x)).tanh()


class Final(nn.Linear):
    """Refuses every subclass in ``__init_subclass__``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise TypeError("Final cannot be subclassed")


def test_classes_with_their_own_init_subclass_are_wrapped_without_running_it() -> None:
    """autoremat's classes skip the base's ``__init_subclass__``: a registry never sees them,
    a class that refuses subclasses is still wrapped, and the step is the unwrapped one. A
    subclass made on top of ours (as ``fully_shard`` makes one) runs it as usual."""
    torch.manual_seed(0)
    model = Net(Plugin())
    model.a = Final(8, 8)
    reference = copy.deepcopy(model)
    registered = list(REGISTRY)
    wrap.apply(model, ["a", "b"])
    assert registered == REGISTRY
    assert type(model.b).__name__ == "CheckpointedPlugin"
    assert type(model.a).__name__ == "CheckpointedFinal"
    assert_same_step(reference, model, (torch.randn(4, 8),), {})
    type("FSDPCheckpointedPlugin", (type(model.b),), {})
    assert [*registered, "FSDPCheckpointedPlugin"] == REGISTRY


def test_hugging_face_classes_with_init_subclass_still_wrap() -> None:
    """``GradientCheckpointingLayer`` and ``PreTrainedModel`` define ``__init_subclass__``
    (the first wraps each subclass's ``forward`` in its own checkpointing): a wrapped block
    keeps autoremat's ``forward``, a wrapped root its ``config_class``, and a step is the
    unwrapped one."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 16))
    args, kwargs = (), {"input_ids": ids, "labels": ids}
    reference = copy.deepcopy(model)
    config_class = type(model).config_class
    wrap.apply(model, ["transformer.h.0", "transformer.h.1"])
    assert type(model.transformer.h[0]).forward is Checkpointed.forward
    assert_same_step(reference, model, args, kwargs)
    autoremat.remove(model)
    wrap.apply(model, [""])
    assert type(model).config_class is config_class
    assert_same_step(reference, model, args, kwargs)


def test_all_or_nothing_undoes_what_its_log_recorded() -> None:
    """Changes made through the log, and modules kept whole before other code changed them,
    are undone, latest first; a change that cannot be undone is named, the rest still are."""
    model = Net(nn.Linear(8, 8))
    before = _state_of(model)
    with pytest.raises(Boom), all_or_nothing() as log:
        log.set_class("a", model.a, type("OtherSequential", (nn.Sequential,), {}))
        log.set_attribute("b", model.b, "_autoremat_path", "b")
        log.set_attribute("b", model.b, "training")  # removed, then put back
        log.keep([("c", model.c), ("a.0", model.a[0])])
        model.c.register_forward_pre_hook(lambda *a: None)
        model.c.extra = 1
        model.a[0].training = False
        raise Boom("half-way")
    assert_unchanged(before, _state_of(model))

    model.b = Stubborn(8, 8)
    object.__setattr__(model.b, "__class__", nn.Linear)
    refused = pytest.raises(RestoreError, match=r"'__class__' of module 'b'.*keeps its class")
    with refused, all_or_nothing() as log:
        log.set_class("b", model.b, Stubborn)  # cannot be undone: Stubborn refuses
        log.set_attribute("c", model.c, "_autoremat_path", "c")
        raise Boom("half-way")
    assert type(model.b) is Stubborn and "_autoremat_path" not in vars(model.c)


def test_modules_kept_chains_what_it_cannot_put_back_to_the_bodys_error() -> None:
    """As ``preserved`` and ``all_or_nothing`` do: a module that cannot be put back after the
    body failed is named in a RestoreError caused by the body's error (its traceback shown),
    not by the restore's own; after a body that returns, by the restore's."""
    model = Net(nn.Linear(8, 8))
    for body_fails in (True, False):
        with pytest.raises(RestoreError, match="keeps its class") as info, modules_kept(model):
            object.__setattr__(model.b, "__class__", Stubborn)  # cannot be undone
            if body_fails:
                raise Boom("half-way")
        assert isinstance(info.value.__cause__, Boom if body_fails else TypeError)
        assert ("after the call failed (Boom)" in str(info.value)) is body_fails
        object.__setattr__(model.b, "__class__", nn.Linear)


# --- the model left exactly as found: its own attributes and lazily installed hooks ----------


class WarmUp(nn.Module):
    """Scales its output by a warm-up factor that grows with every training forward (a plain
    Python counter: the planner leaves the module out, and must not move the counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
        return self.fc(x) * min(1.0, self.steps / 10)


def test_planning_and_measuring_leave_python_attributes_as_found() -> None:
    """``plan`` (several forwards), ``measure``, ``profile`` and ``fit`` leave a warm-up
    counter where it was, so training afterwards equals training a copy never planned (before:
    the counter moved by the planning forwards, max grad difference 7e-3)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), WarmUp(), nn.Sequential(nn.GELU(), nn.Linear(64, 1)))
    untouched = copy.deepcopy(model)
    x = torch.randn(256, 64)
    autoremat.plan(model, (x,), budget=autoremat.lowest_budget(model, (x,)))
    autoremat.plan(model, (x,), segments=2)
    autoremat.measure(model, (x,))
    autoremat.profile(model, (x,))
    autoremat.fit(model, lambda b: scale_batch((x,), {}, b), device_memory="64MiB")
    assert model[1].steps == 0 and "steps" in vars(model[1])
    for _ in range(2):
        for m in (model, untouched):
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()
    for p, q in zip(model.parameters(), untouched.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


class Draws(nn.Module):
    """Blocks whose forward draws from Python's and NumPy's global generators (a mask, a
    layer to skip) and torch's (dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1)) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) * float(np.random.rand() + random.random())
        return x.sum()


def _generators() -> tuple[Any, ...]:
    numpy_state = np.random.get_state()
    return (torch.get_rng_state(), random.getstate(), numpy_state[1].tolist(), numpy_state[2])


@pytest.mark.parametrize(
    "call",
    [
        lambda m, x: autoremat.measure_memory(m, (x,), optimizer="sgd"),
        lambda m, x: autoremat.plan(
            m, (x,), device_memory="64MiB", sharding=autoremat.Sharding("fsdp2", 2)
        ),
        lambda m, x: autoremat.plan(m, (x,), budget="75%"),
    ],
    ids=["measure_memory", "plan-fsdp2", "plan"],
)
def test_torchs_pythons_and_numpys_generators_are_left_as_found(call: Any) -> None:
    """``measure_memory`` and the emulated FSDP2 rank put back Python's and NumPy's global
    generators, not torch's alone (before, both moved by the draws of the steps they ran)."""
    model, x = Draws(), torch.randn(256, 64)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    before = _generators()
    call(model, x)
    after = _generators()
    assert torch.equal(after[0], before[0]) and after[1:] == before[1:]


def test_hooks_a_model_installs_on_its_first_forward_come_back_with_their_flag() -> None:
    """transformers 5.x installs output-capturing hooks on a model's first forward and sets a
    plain attribute saying so. Planning puts both back (before: the hooks were removed and the
    flag kept, so ``output_hidden_states=True`` returned nothing from then on)."""
    model, ids = tiny_llama()
    autoremat.plan(model, (), {"input_ids": ids, "labels": ids}, budget="50%")
    autoremat.measure(model, (), {"input_ids": ids, "labels": ids})
    assert "_output_capturing_hooks_installed" not in vars(model)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    hooked = {n for n, m in model.named_modules() if m._forward_hooks}
    autoremat.measure(model, (), {"input_ids": ids, "labels": ids})  # hooks in place now
    assert {n for n, m in model.named_modules() if m._forward_hooks} == hooked
    with torch.no_grad():
        again = model(input_ids=ids, output_hidden_states=True)
    assert len(again.hidden_states) == len(out.hidden_states)


def test_planning_runs_the_users_hooks_and_they_can_tell() -> None:
    """Planning runs the model's step (profile, each plan's run), so its forward and full
    backward hooks run there, with ``is_measuring()`` True; in the user's own step after it,
    recomputes included, False (issue 40)."""
    from autoremat.examples import EXAMPLES

    model, args, kwargs = EXAMPLES["gpt2"]()
    seen: list[tuple[str, bool, bool]] = []

    def forward_hook(module: nn.Module, inputs: Any, output: Any) -> None:
        seen.append(("forward", autoremat.is_measuring(), autoremat.is_recomputing()))

    def backward_hook(module: nn.Module, grad_in: Any, grad_out: Any) -> None:
        seen.append(("backward", autoremat.is_measuring(), autoremat.is_recomputing()))

    for block in model.h:
        block.register_full_backward_hook(backward_hook)
        for module in block.modules():  # (inside an entry: run again by its recompute)
            module.register_forward_hook(forward_hook)
    plan = autoremat.plan(model, args, kwargs, budget="50%", objective="flops")
    assert {kind for kind, _, _ in seen} == {"forward", "backward"}
    assert all(measuring for _, measuring, _ in seen)
    seen.clear()
    plan.apply(model)
    with autoremat.comparison.recomputed.RecomputeCounter() as counter:
        conftest_train_step(model, args, kwargs)
    counter.check(plan.modules)
    assert {kind for kind, _, _ in seen} == {"forward", "backward"}
    assert not any(measuring for _, measuring, _ in seen)
    assert any(recomputing for _, _, recomputing in seen)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_collector_skips_only_what_existed_before_and_is_left_as_found() -> None:
    """Planning freezes the objects that exist when it begins (``gc.freeze``: full collections
    scan only what planning makes) and unfreezes them after; garbage made inside is
    collected as ever; a program that froze objects itself finds them frozen still."""
    from autoremat.core.collector import frozen
    from autoremat.examples import EXAMPLES

    before = _Cycle()
    old = weakref.ref(before)
    with frozen():
        assert gc.get_freeze_count() > 0
        del before  # (garbage from now on, but it existed on entry)
        made = _Cycle()
        new = weakref.ref(made)
        del made
        gc.collect()
        assert new() is None, "garbage made inside is collected"
        assert old() is not None, "what existed on entry is not looked at"
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old() is None, "and is collected once unfrozen"

    model, args, kwargs = EXAMPLES["gpt2"]()
    counts: list[int] = []
    model.h[0].register_forward_hook(lambda *_: counts.append(gc.get_freeze_count()))
    autoremat.plan(model, args, kwargs, budget="50%", objective="flops")
    assert counts and all(c > 0 for c in counts), "the planned steps ran frozen"
    assert gc.get_freeze_count() == 0, "and nothing is left frozen"
    gc.freeze()  # the program's own: kept, and not unfrozen by planning
    try:
        autoremat.plan(model, args, kwargs, budget="50%", objective="flops")
        assert gc.get_freeze_count() > 0  # (less any that died meanwhile)
    finally:
        gc.unfreeze()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=3e-4, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=1e-3),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ],
    ids=["adamw", "adam", "sgd"],
)
def test_an_optimizer_instance_is_sized_and_measured_like_its_name(make: Any) -> None:
    """``optimizer=`` an instance: the same class and defaults are built on shadows (AdamW
    records a default its own constructor does not take, ``decoupled_weight_decay``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
    x = torch.randn(16, 8)
    opt = make(model.parameters())
    predicted = autoremat.predict_memory(model, (x,), optimizer=opt)
    measured = autoremat.measure_memory(model, (x,), optimizer=opt)
    assert predicted.tensors == measured.tensors

"""Whatever a recomputed forward reads, its recompute reads as it was (issue 13): buffers the
forward updates and then reads (EMA normalisers, QAT observers, spectral normalisation's power
iteration), buffers resized or registered in the forward, Python's and NumPy's generators; a
forward that changes its own input in place is named at once; a second backward through a
selectively recomputed module works; hooks can tell a recompute from a forward.

Every case compares one training step (loss, every gradient, every buffer) of the wrapped
model with the unwrapped one from the same seeds, dropout on (``conftest.assert_same_step``),
and most run two steps, so that what the first step left behind is compared too; each also
proves that every entry was recomputed (``conftest.recomputed_step``: a wrap that recomputed
nothing would pass the comparisons).
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointError

import autoremat
from autoremat.examples import TinyGPT
from autoremat.wrap.replay import recomputing
from autoremat.wrap.wrapping import apply
from conftest import loss_of, recomputed_step, train_step


class EMANorm(nn.Module):
    """Updates a running mean, then reads it (the updated value) to scale its input."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(dim=0))
        return x * (1 + self.mean)


class LazyStat(nn.Module):
    """Sizes its statistic on first use (rebinding the buffer), then updates and reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stat", torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stat.numel() != x.shape[-1]:
            self.stat = torch.ones(x.shape[-1])
        with torch.no_grad():
            self.stat.add_(x.detach().abs().mean(dim=0))
        return x * self.stat


class Registers(nn.Module):
    """Registers a buffer on its first forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "seen" not in self._buffers:
            self.register_buffer("seen", x.detach().mean(dim=0).clone())
        return x * self.seen


class RandomDepth(nn.Module):
    """Chooses its depth with Python's ``random`` and a scale with NumPy's generator."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if random.random() < 0.5:
            x = self.b(torch.tanh(x))
        return x * float(np.random.rand() + 0.5)


def block(middle: nn.Module, width: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), middle, nn.Dropout(0.1), nn.Linear(width, width))


def model_with(middle: nn.Module, width: int = 8) -> nn.Sequential:
    return nn.Sequential(block(middle, width), nn.Tanh(), nn.Linear(width, 1))


def _step(model: nn.Module, x: torch.Tensor, seed: int) -> tuple[Any, ...]:
    """One step from seeded torch, Python and NumPy generators: loss, gradients, buffers,
    and the next draw of Python's and NumPy's generators after it (a recompute must not
    leave them elsewhere than the unwrapped step does)."""
    random.seed(seed)
    np.random.seed(seed)
    loss = train_step(model, (x,), {}, seed=seed)
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return loss, grads, buffers, (random.random(), float(np.random.rand()))


def _two_steps_equal(reference: nn.Module, wrapped: nn.Module, x: torch.Tensor) -> None:
    """Two steps with an SGD update between them: loss, gradients, buffers (names, shapes,
    values) and the host generators equal after each, and every entry of ``wrapped``
    recomputed in each."""
    for seed in (1, 2):
        expected = _step(reference, x, seed)
        got = recomputed_step(wrapped, lambda seed=seed: _step(wrapped, x, seed))
        torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-7)
        assert any(g is not None for g in expected[1])
        for g, h in zip(got[1], expected[1], strict=True):
            assert (g is None) == (h is None)
            if g is not None:
                torch.testing.assert_close(g, h, rtol=1e-6, atol=1e-7)
        assert got[2].keys() == expected[2].keys()
        for name, value in expected[2].items():
            torch.testing.assert_close(got[2][name], value, rtol=0, atol=0, msg=name)
        assert got[3] == expected[3]
        with torch.no_grad():
            for p, q in zip(reference.parameters(), wrapped.parameters(), strict=True):
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
                    q.sub_(0.1 * q.grad)


@pytest.mark.parametrize(
    "middle",
    [
        pytest.param(lambda: EMANorm(8), id="ema-normaliser"),
        pytest.param(LazyStat, id="lazily-sized-buffer"),
        pytest.param(Registers, id="buffer-registered-in-forward"),
        pytest.param(lambda: nn.BatchNorm1d(8), id="batchnorm"),
        pytest.param(lambda: nn.utils.spectral_norm(nn.Linear(8, 8)), id="spectral-norm-hook"),
        pytest.param(
            lambda: nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8)),
            id="spectral-norm-parametrization",
        ),
        pytest.param(lambda: RandomDepth(8), id="python-and-numpy-random"),
    ],
)
def test_a_recompute_reads_what_its_forward_read(middle: Any) -> None:
    torch.manual_seed(0)
    reference = model_with(middle())
    wrapped = copy.deepcopy(reference)
    apply(wrapped, ["0"])
    _two_steps_equal(reference, wrapped, torch.randn(16, 8))


def test_qat_observers_see_their_pre_forward_statistics() -> None:
    """``prepare_qat`` (fake-quantize modules with moving-average observers: the forward
    updates min/max, then quantizes with the updated scale): exact under recompute."""
    from torch.ao.quantization import get_default_qat_qconfig, prepare_qat

    torch.manual_seed(0)
    float_model = nn.Sequential(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), nn.ReLU(), nn.Linear(8, 1)
    ).train()
    float_model.qconfig = get_default_qat_qconfig("x86")
    reference = prepare_qat(float_model)
    wrapped = copy.deepcopy(reference)
    apply(wrapped, ["0"])
    _two_steps_equal(reference, wrapped, torch.randn(32, 8))


def test_a_forward_that_changes_its_own_input_in_place_is_named() -> None:
    """The unwrapped model trains; wrapped, checkpoint keeps the input for the recompute, so
    the forward raises at once, naming the module and the fix (instead of torch's nameless
    "modified by an inplace operation" in backward)."""

    class InPlace(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.relu(x, inplace=True) * 2

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), InPlace(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    train_step(reference, (x,), {})  # trains unwrapped
    wrapped = copy.deepcopy(reference)
    apply(wrapped, ["1"])
    with pytest.raises(CheckpointError, match=r"module '1' changed its own input \(args\[0\]\)"):
        train_step(wrapped, (x,), {})


def _tiny_gpt() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (2, 32))
    return TinyGPT(vocab=64, width=32, layers=2, heads=2, context=32), (idx, idx)


@pytest.mark.parametrize("selective", [False, True])
def test_a_second_backward_through_a_recomputed_module(selective: bool) -> None:
    """``retain_graph=True`` then a second backward, and a gradient penalty
    (``create_graph=True``), through whole and selective entries, dropout on: the same
    gradients as unwrapped (a second recompute of a selective entry recomputes every op)."""
    reference, args = _tiny_gpt()
    wrapped = copy.deepcopy(reference)
    entries = ["h.0", "h.1.attn", "h.1.mlp"]
    apply(wrapped, entries, selective=entries if selective else ())

    def twice(model: nn.Module) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = loss_of(model(*args))
        loss.backward(retain_graph=True)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    def penalty(model: nn.Module) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = loss_of(model(*args))
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, create_graph=True)
        (loss + sum(g.pow(2).sum() for g in grads)).backward()
        return [p.grad.clone() for p in model.parameters()]

    for run in (twice, penalty):
        expected = run(reference)
        got = recomputed_step(wrapped, lambda run=run: run(wrapped))
        for g, h in zip(got, expected, strict=True):
            torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-7)


def test_hooks_can_tell_a_recompute_from_the_forward() -> None:
    """A forward hook inside a recomputed module runs again in the recompute;
    :func:`autoremat.is_recomputing` says which run it is in, and
    :func:`autoremat.wrap.replay.recomputing` which entry is recomputed."""
    torch.manual_seed(0)
    model = model_with(nn.Tanh())
    seen: list[tuple[bool, str | None]] = []

    def hook(*_: Any) -> None:
        seen.append((autoremat.is_recomputing(), recomputing()))

    model[0][1].register_forward_hook(hook)
    apply(model, ["0"])
    train_step(model, (torch.randn(4, 8),), {})
    assert seen == [(False, None), (True, "0")]  # the forward, then the recompute of entry "0"
    assert not autoremat.is_recomputing() and recomputing() is None


# --- more of the same families, planned as a user would ------------------------------------


class ConvBlock(nn.Module):
    """Conv, a stateful normalisation, an in-place activation at the module boundary."""

    def __init__(self, norm: nn.Module, channels: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = norm
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.act(self.norm(self.conv(x))))


@pytest.mark.parametrize(
    "norm",
    [
        pytest.param(lambda: nn.BatchNorm2d(4, momentum=None), id="batchnorm-cumulative"),
        pytest.param(lambda: nn.InstanceNorm2d(4, track_running_stats=True), id="instancenorm"),
        pytest.param(lambda: nn.GroupNorm(2, 4), id="groupnorm"),
    ],
)
def test_planned_conv_blocks_with_stateful_norms_and_inplace_relu(norm: Any) -> None:
    """A budget plan over conv blocks whose norms keep statistics and whose ReLUs work in
    place: applied as planned, two steps equal the unwrapped model's (buffers included)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        ConvBlock(norm()),
        ConvBlock(norm()),
        ConvBlock(norm()),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 1),
    )
    x = torch.randn(4, 4, 8, 8)
    reference = copy.deepcopy(model)
    chosen = autoremat.plan(model, (x,), segments=3)
    assert chosen.modules
    chosen.apply(model)
    _two_steps_equal(reference, model, x)


def test_a_lazy_module_planned_then_trained() -> None:
    """``nn.LazyLinear`` inside a recomputed block: planning's first forward initialises it
    (and it stays initialised); the wrapped model then trains as an unwrapped copy."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LazyLinear(8), nn.Dropout(0.1)),
        nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)),
        nn.Linear(8, 1),
    )
    x = torch.randn(16, 8)
    chosen = autoremat.plan(model, (x,), segments=2)
    assert "0" in chosen.modules or any(m.startswith("0") for m in chosen.modules)
    reference = copy.deepcopy(model)
    chosen.apply(model)
    _two_steps_equal(reference, model, x)


def test_a_weight_parametrization_in_a_recomputed_module() -> None:
    """``parametrizations.orthogonal`` and ``weight_norm``: the weight is computed from its
    parametrization inside the recompute again, with the same value."""
    torch.manual_seed(0)
    inner = nn.Sequential(
        nn.utils.parametrizations.orthogonal(nn.Linear(8, 8)),
        nn.Tanh(),
        nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)),
        nn.Dropout(0.1),
    )
    reference = nn.Sequential(inner, nn.Linear(8, 1))
    wrapped = copy.deepcopy(reference)
    apply(wrapped, ["0"])
    _two_steps_equal(reference, wrapped, torch.randn(16, 8))

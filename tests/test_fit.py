"""Fitting a device (issue 15): the whole step's memory predicted against real optimizer steps,
the largest batch found on ``meta`` and checked, the CLI."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import autoremat
from autoremat.cli.commands import main
from autoremat.examples import EXAMPLES
from autoremat.planning.plan import plan_from_profile
from autoremat.planning.rehearsal import CannotRun, PlanFields
from autoremat.record.step import train_step
from autoremat.training.device_model import CUDA_CONTEXT, device_model
from autoremat.training.optimizer_memory import optimizer_memory
from autoremat.training.scale_batch import batch_size_of, scale_batch
from conftest import under_autocast

CASES = [("gpt2", "adamw"), ("cnn", "sgd"), ("mlp", None), ("looped", "adam"), ("hf-bert", "adamw")]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "optimizer"), CASES)
def test_the_whole_step_is_predicted_within_5_percent_of_real_optimizer_steps(
    name: str, optimizer: str | None
) -> None:
    """Parameters, buffers, gradients, optimizer state and step, inputs and the step peak,
    against the most tensors held around a real optimizer step, without a plan and with one."""
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    model, args, kwargs = EXAMPLES[name]()
    predicted = autoremat.predict_memory(model, args, kwargs, optimizer=optimizer)
    measured = autoremat.measure_memory(model, args, kwargs, optimizer=optimizer)
    assert abs(predicted.tensors - measured.tensors) <= 0.05 * measured.tensors
    assert predicted.optimizer_state == (0 if optimizer is None else predicted.optimizer_state)
    plan = autoremat.plan(model, args, kwargs, budget=0.7)
    wrapped = plan.apply(copy.deepcopy(model))
    with_plan = autoremat.predict_memory(wrapped, args, kwargs, optimizer=optimizer, plan=plan)
    real = autoremat.measure_memory(wrapped, args, kwargs, optimizer=optimizer)
    assert abs(with_plan.tensors - real.tensors) <= 0.05 * real.tensors
    assert with_plan.tensors < predicted.tensors


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.AdamW(p),
        lambda p: torch.optim.Adagrad(p),
        lambda p: torch.optim.RMSprop(p, momentum=0.5),
    ],
)
def test_any_optimizers_state_is_measured_on_meta_as_it_is_on_real_tensors(make: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    model[2].bias.requires_grad_(False)  # frozen: no state
    found = optimizer_memory(model, make)
    opt = make([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    state = {id(v): v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)}
    assert found.state == sum(v.untyped_storage().nbytes() for v in state.values()) > 0


def test_an_optimizer_inside_accelerates_wrapper_is_priced_as_the_one_inside() -> None:
    """The Hugging Face Trainer hands its callbacks accelerate's ``AcceleratedOptimizer``
    around the real one; its state is the inner optimizer's (it once failed on meta, its
    wrapper's constructor taking an optimizer, not parameters)."""
    accelerated = pytest.importorskip("accelerate.optimizer")
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # (its constructor needs an initialised Accelerator, global state: the wrapper as built)
    wrapped = accelerated.AcceleratedOptimizer.__new__(accelerated.AcceleratedOptimizer)
    wrapped.optimizer = inner
    assert optimizer_memory(model, wrapped) == optimizer_memory(model, inner)
    assert optimizer_memory(model, wrapped).state > 0


def test_an_optimizer_that_cannot_step_on_meta_is_named_with_the_fix() -> None:
    model = nn.Linear(8, 8)
    with pytest.raises(ValueError, match="without fused=True"):
        optimizer_memory(model, lambda p: torch.optim.Adam(p, fused=True))
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        optimizer_memory(model, "lion")


def test_measure_training_puts_the_model_back() -> None:
    model, args, kwargs = EXAMPLES["cnn"]()
    model(*args, **kwargs).pow(2).mean().backward()
    before = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    grads = {n: p.grad for n, p in model.named_parameters()}
    autoremat.measure_memory(model, args, kwargs, optimizer="adamw", steps=3)
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.equal(t, before[n]), n
    assert all(p.grad is grads[n] for n, p in model.named_parameters())


@pytest.mark.slow
def test_a_prediction_on_meta_is_the_prediction_on_real_tensors() -> None:
    model, args, kwargs = EXAMPLES["gpt2"]()
    real = autoremat.predict_memory(model, args, kwargs, optimizer="adamw")
    shadow = autoremat.training.fit.meta_shadow(model)
    meta_args = tuple(a.to("meta") for a in args)
    meta_kwargs = {k: v.to("meta") for k, v in kwargs.items()}
    on_meta = autoremat.predict_memory(shadow, meta_args, meta_kwargs, optimizer="adamw")
    assert on_meta == real
    assert all(p.device.type == "cpu" for p in model.parameters())  # the model is untouched


def as_sized(found: autoremat.training.fit.Fit) -> int:
    """The measured step as ``fit`` sized it: by the CPU allocator when it sized from real steps
    by it (its predicted "tensors" then hold kernels' scratch), else by the tensors."""
    assert found.measured is not None
    return found.seen if found.by_allocator else found.measured.tensors


# --- the largest batch ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("name", "memory"), [("gpt2", "48MiB"), ("looped", "40MiB")])
def test_the_batch_found_on_meta_fits_when_run_and_the_next_size_up_does_not(
    name: str, memory: str
) -> None:
    model, args, kwargs = EXAMPLES[name]()
    state = copy.deepcopy(model.state_dict())
    found = autoremat.fit(model, lambda b: scale_batch(args, kwargs, b), device_memory=memory)
    assert found.fits and found.measured is not None
    assert abs(found.chosen.memory.tensors - as_sized(found)) <= 0.01 * as_sized(found)
    assert found.batch > found.largest_without_recompute >= 1
    up_args, up_kwargs = scale_batch(args, kwargs, found.batch + 1)
    lowest = autoremat.lowest_budget(model, up_args, up_kwargs)
    up = autoremat.plan(model, up_args, up_kwargs, budget=lowest).apply(copy.deepcopy(model))
    measured = autoremat.measure_memory(up, up_args, up_kwargs, optimizer="adamw")
    assert measured.tensors > found.device.total  # the next size up does not fit, even so
    assert not autoremat.wrap.wrapped_paths(model)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_the_throughput_objective_picks_the_most_samples_per_second() -> None:
    model, args, kwargs = EXAMPLES["mlp"]()
    found = autoremat.fit(
        model,
        lambda b: scale_batch(args, kwargs, b),
        device_memory="48MiB",
        objective="throughput",
        verify=False,
    )
    batches = [c.batch for c in found.candidates]
    assert len(batches) >= 2 and batches == sorted(batches)
    assert found.chosen is not None
    assert found.chosen.samples_per_second == max(c.samples_per_second for c in found.candidates)
    assert all(c.memory.device <= found.device.total for c in found.candidates)
    assert found.measured is None and found.fits is None


def test_a_model_that_cannot_train_at_batch_one_is_fitted_from_two() -> None:
    """BatchNorm over one value per channel cannot train at batch 1 (timm LeViT's last stage):
    fit starts from the smallest batch that runs instead of refusing the model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 4))
    found = autoremat.fit(
        model, lambda b: ((torch.randn(b, 64),), {}), device_memory="4MiB", verify=False
    )
    assert found.batch >= 2
    with pytest.raises(ValueError, match="even a batch of 2 does not fit"):
        autoremat.fit(
            model, lambda b: ((torch.randn(b, 64),), {}), device_memory="64KiB", verify=False
        )


@pytest.mark.parametrize("max_batch", [0, -3, 2.5])
def test_a_max_batch_below_one_is_refused_before_anything_runs(max_batch) -> None:
    """Before: BudgetTooLow, "even a batch of 1 does not fit", on a device the model fits."""
    model, args, kwargs = EXAMPLES["mlp"]()
    with pytest.raises(ValueError, match="max_batch must be a whole number of at least 1"):
        autoremat.fit(model, lambda b: scale_batch(args, kwargs, b), device_memory="10MiB",
                      max_batch=max_batch)  # fmt: skip


def test_a_device_too_small_for_a_batch_of_one_says_what_it_needs() -> None:
    model, args, kwargs = EXAMPLES["mlp"]()
    with pytest.raises(ValueError, match=r"even a batch of 1 does not fit 1.00 MiB.*needs"):
        autoremat.fit(model, lambda b: scale_batch(args, kwargs, b), device_memory="1MiB")


def test_scale_batch_repeats_the_example_rows_and_keeps_the_rest() -> None:
    x, mask = torch.arange(6.0).reshape(3, 2), torch.ones(3, 5)
    table = torch.zeros(7, 2)  # not batch-sized: kept
    args, kwargs = scale_batch((x, table), {"mask": mask, "n": 3}, 7)
    assert args[0].shape == (7, 2) and torch.equal(args[0][3], x[0]) and args[1] is table
    assert kwargs["mask"].shape == (7, 5) and kwargs["n"] == 3
    assert batch_size_of((x, table), {"mask": mask}) == 3
    with torch.device("meta"):
        meta_args, _ = scale_batch((x,), {}, 10**9)  # no memory
    assert meta_args[0].device.type == "meta" and meta_args[0].shape == (10**9, 2)


def test_device_memory_forms_and_cuda_estimates() -> None:
    assert device_model("24GiB").total == 24 * 2**30
    assert device_model(10**9).total == 10**9
    assert 0 < device_model("50%").total < device_model(1.0).total
    cuda = device_model("24GiB", "cuda")
    assert cuda.runtime == CUDA_CONTEXT and cuda.fragmentation > 0
    assert (
        cuda.device_bytes(cuda.for_tensors())
        <= cuda.total
        < cuda.device_bytes(cuda.for_tensors() + 2**20)
    )
    with pytest.raises(ValueError):
        device_model("lots")


def test_make_inputs_must_be_a_function_and_the_error_shows_one() -> None:
    """A new user passed the module ``autoremat.training.scale_batch`` (the README named it)
    and met "'module' object is not callable" deep in the search; now one line at once."""
    model, _, _ = EXAMPLES["mlp"]()
    with pytest.raises(TypeError, match=r"make_inputs must be a function of the batch size "
                       r"that returns \(args, kwargs\), such as lambda b: autoremat\.scale_batch"
                       r"\(args, kwargs, b\); got module autoremat\.training\.scale_batch$"):
        autoremat.fit(model, autoremat.training.scale_batch, device_memory="64MiB")  # type: ignore[arg-type]
    assert autoremat.scale_batch is scale_batch


@pytest.mark.slow
def test_the_fit_command_prints_the_batch_the_plan_and_the_memory(capsys: Any) -> None:
    assert main(["fit", "mlp", "--device-memory", "48MiB", "--optimizer", "sgd"]) == 0
    out = capsys.readouterr().out
    assert "batch" in out and "fits 48.00 MiB on cpu" in out
    assert "predicted memory (optimizer sgd)" in out and "measured: tensors at most" in out
    assert "(fits)" in out
    assert "Plan for Sequential" in out


@pytest.mark.slow
def test_a_plan_for_a_device_fits_the_whole_step_at_a_fixed_batch() -> None:
    model, args, kwargs = EXAMPLES["gpt2"]()
    whole = autoremat.measure_memory(model, args, kwargs, optimizer="sgd").tensors
    device = int(whole * 0.6)
    chosen = autoremat.plan(
        model, args, kwargs, device_memory=device, optimizer="sgd", objective="flops"
    )
    assert chosen.modules and chosen.budget is not None
    wrapped = chosen.apply(copy.deepcopy(model))
    assert autoremat.measure_memory(wrapped, args, kwargs, optimizer="sgd").tensors <= device
    roomy = autoremat.plan(model, args, kwargs, device_memory=2 * whole, optimizer="sgd")
    assert roomy.modules == ()
    with pytest.raises(autoremat.BudgetTooLow, match=r"does not fit .* it needs"):
        autoremat.plan(model, args, kwargs, device_memory=whole // 10, optimizer="sgd")


def test_scale_batch_along_another_dimension() -> None:
    x = torch.randn(50, 3, 8)  # time x batch x features
    (scaled,), _ = scale_batch((x,), {}, 7, dim=1)
    assert scaled.shape == (50, 7, 8) and torch.equal(scaled[:, 3], x[:, 0])
    assert batch_size_of((x,), {}, dim=1) == 3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "two-tower"])
def test_autocast_is_sized_on_meta_as_it_runs(name: str) -> None:
    """Autocast does not act on meta tensors; MetaAutocast makes its casts there: the profile
    on meta under autocast equals the real one, node by node (CPU lists, checked against real
    CPU autocast), and a fit under autocast is verified by real autocast steps."""
    model, args, kwargs = under_autocast(name)
    spec = ("cpu", torch.bfloat16)
    real = autoremat.profile(model, args, kwargs, autocast=spec)
    shadow = autoremat.training.fit.meta_shadow(model)
    on_meta = [tuple(a.to("meta") for a in args), {k: v.to("meta") for k, v in kwargs.items()}]
    meta = autoremat.profile(shadow, *on_meta, autocast=spec)
    float32 = autoremat.profile(shadow, *on_meta)
    assert meta.peak == real.peak < 0.8 * float32.peak
    assert [(p, c.saved, c.freed) for p, c in meta.costs.items()] == [
        (p, c.saved, c.freed) for p, c in real.costs.items()
    ]
    found = autoremat.fit(
        model,
        lambda b: scale_batch(args, kwargs, b),
        device_memory="16MiB",
        autocast=torch.bfloat16,
        optimizer="sgd",
    )
    assert found.fits and found.measured is not None and found.chosen is not None
    assert abs(found.chosen.memory.tensors - as_sized(found)) <= 0.01 * as_sized(found)


@pytest.mark.slow
def test_a_plan_made_for_autocast_holds_its_budget_under_autocast() -> None:
    """``plan(..., autocast=...)`` profiles forward and loss under autocast, as it will train;
    inside an autocast region it does the same (the region's cast cache would hide the step's
    casts), and ``measure(..., autocast=...)`` measures that step; so do ``measure`` and
    ``measure_memory`` inside a region (they ran backward in it before, where the cache kept
    the checkpointed blocks' weight copies through backward: 1.8% over the budget), and
    a step inside the region is counted as one outside it (a recompute inside it kept its
    casts in the region's cache: 2,304 bytes more at this plan's peak)."""
    model, args, kwargs = under_autocast("looped")
    spec = ("cpu", torch.bfloat16)
    # FLOPs-priced: the plan must not depend on how busy the machine is (a time-priced one can
    # differ from run to run, and some under-predict under autocast: see the guide)
    chosen = autoremat.plan(
        model, args, kwargs, budget=0.5, autocast=torch.bfloat16, objective="flops"
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = autoremat.plan(model, args, kwargs, budget=0.5, objective="flops")
    explicit = autoremat.plan(model, args, kwargs, budget=0.5, objective="flops", autocast=spec)
    assert inside.estimated_peak == explicit.estimated_peak
    assert inside.baseline_peak == explicit.baseline_peak == chosen.baseline_peak
    wrapped = chosen.apply(copy.deepcopy(model))
    measured = autoremat.measure(wrapped, args, kwargs, autocast=spec).peak
    assert chosen.estimated_peak is not None and chosen.budget is not None
    assert measured <= chosen.budget
    assert abs(chosen.estimated_peak - measured) <= 0.05 * measured
    whole = autoremat.measure_memory(wrapped, args, kwargs, optimizer="sgd", autocast=spec)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autoremat.measure(wrapped, args, kwargs).peak == measured
        found = autoremat.measure_memory(wrapped, args, kwargs, optimizer="sgd")
        assert torch.is_autocast_enabled("cpu")  # the caller's region, as it was
        below = torch.autocast_decrement_nesting()  # (its nesting too: 1, put back)
        torch.autocast_increment_nesting()
        assert below == 0
    assert found.tensors == whole.tensors


@pytest.mark.slow
def test_autocast_and_device_memory_forms_are_checked_with_messages() -> None:
    model, args, kwargs = EXAMPLES["mlp"]()
    with pytest.raises(TypeError, match=r"autocast must be None, a dtype"):
        autoremat.measure_memory(model, args, kwargs, autocast="bf16")
    with pytest.raises(ValueError, match=r"device_memory '150%' is not understood"):
        autoremat.plan(model, args, kwargs, device_memory="150%")
    shadow = autoremat.training.fit.meta_shadow(model)
    found = autoremat.fit(
        shadow, lambda b: scale_batch(args, kwargs, b), device_memory="64MiB"
    )
    assert found.batch >= 1 and found.measured is None  # nothing runs on meta
    assert "not verified (the model is on meta, where nothing runs)" in str(found)
    assert "(sized on meta)" in str(found)
    with pytest.raises(ValueError, match=r"the model is on meta, which has none: give"):
        autoremat.fit(shadow, lambda b: scale_batch(args, kwargs, b), device_memory="90%")
    with pytest.raises(autoremat.BudgetTooLow) as refused:
        autoremat.plan(model, args, kwargs, budget=0.01, autocast=torch.bfloat16)
    assert "mixed precision" not in str(refused.value)  # it is mixed precision already


@pytest.mark.slow
def test_a_hugging_face_models_own_step_is_predicted_with_its_cache() -> None:
    """Without a plan, the step predicted is the model's own: a Hugging Face model fills its
    key/value cache in training (1.4% more on GPT-2, which the prediction missed before)."""
    pytest.importorskip("transformers")
    model, args, kwargs = EXAMPLES["hf-gpt2"]()
    predicted = autoremat.predict_memory(model, args, kwargs, optimizer="sgd")
    measured = autoremat.measure_memory(model, args, kwargs, optimizer="sgd")
    assert predicted.tensors == measured.tensors
    cache_off = autoremat.profile(model, args, kwargs).peak
    assert autoremat.profile(model, args, kwargs, hf_cache=True).peak > cache_off


def test_the_fit_command_names_a_malformed_device_memory(capsys: Any) -> None:
    assert main(["fit", "mlp", "--device-memory", "150%"]) == 2
    assert "--device-memory 150% is not understood" in capsys.readouterr().err


@pytest.mark.slow
def test_the_largest_batch_without_recompute_counts_the_cache_a_plain_model_fills() -> None:
    """A Hugging Face decoder trained untouched fills its key/value cache (every applied plan
    turns it off): the batch ``fit`` says trains without recompute is sized with the cache, as
    ``predict_memory`` of the model's own step (before: without it, one batch too many)."""
    model, args, kwargs = EXAMPLES["hf-gpt2"]()
    found = autoremat.fit(
        model,
        lambda b: scale_batch(args, kwargs, b),
        device_memory="120MiB",
        optimizer="sgd",
        verify=False,
    )
    batch = found.largest_without_recompute
    (without,) = [c.without for c in found.candidates if c.batch == batch]
    at = scale_batch(args, kwargs, batch)
    own = autoremat.predict_memory(model, *at, optimizer="sgd")
    cache_off = plan_from_profile(model, autoremat.profile(model, *at), 1.0)
    assert without.tensors == own.tensors
    without_cache = autoremat.predict_memory(model, *at, optimizer="sgd", plan=cache_off)
    assert own.tensors > without_cache.tensors


def test_on_the_cpu_a_fraction_is_of_the_ram_available_and_the_check_never_exceeds_it(
    monkeypatch: Any, caplog: Any
) -> None:
    """On a shared machine ``"90%"`` is 90% of the RAM available now, and fit does not run its
    check at a size the machine cannot hold now: it says so instead (a GPU would raise its
    out-of-memory error; a host would swap or kill a process)."""
    from autoremat.training import device_model as dm
    from autoremat.training import fit as fit_module

    monkeypatch.setattr(dm, "available_memory", lambda device: 64 * 2**20)
    assert device_model("50%").total == 32 * 2**20
    model, args, kwargs = EXAMPLES["mlp"]()
    make = lambda b: scale_batch(args, kwargs, b)  # noqa: E731
    monkeypatch.setattr(fit_module, "available_memory", lambda device: 8 * 2**20)
    with caplog.at_level("WARNING", logger="autoremat.training.fit"):
        found = autoremat.fit(model, make, device_memory="48MiB", optimizer="sgd", max_batch=4096)
    assert found.measured is None and found.fits is None
    assert "8.00 MiB available now" in found.not_verified
    assert "not verified (batch" in str(found)
    assert "check on the device is skipped" in caplog.text


def test_on_the_cpu_each_checkpoint_keeps_an_rng_state_which_every_figure_counts() -> None:
    """``torch.utils.checkpoint`` keeps the CPU generator's state (5,056 bytes) per recomputed
    call until its backward, and its recompute one more while it runs: no op makes them, the
    CPU allocator sees them, and so does the tracker on the CPU (``measure``, a plan's step
    run): the allocator sees nothing more per checkpoint. Counted in what ``fit`` sizes by,
    not on CUDA (host memory there)."""
    from autoremat.record.memory import LiveMemory

    state = int(torch.get_rng_state().numel())
    assert state == 5056
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)))
    x = torch.randn(512, 64)  # (activations above the parameters: the peak is the step's)
    unseen, counted = [], []
    for k in (2, 5):
        wrapped = autoremat.wrap.apply(copy.deepcopy(model), [str(i) for i in range(k)])
        allocator = autoremat.measure(wrapped, (x,), memory="allocator").peak
        unseen.append(allocator - autoremat.measure(wrapped, (x,)).peak)
        with LiveMemory() as plain:
            train_step(wrapped, (x,), {})
        counted.append(autoremat.measure(wrapped, (x,)).peak - plain.peak)
    assert unseen[1] == unseen[0]  # (what the allocator sees beyond: the same scratch)
    assert counted == [2 * state, 5 * state]  # (one per call: the peak is as backward begins)
    assert not LiveMemory.counting_as("cuda").rng_states
    found = autoremat.fit(
        model, lambda b: ((torch.randn(b, 64),), {}), device_memory="2MiB", optimizer="sgd",
        verify=False,
    )  # fmt: skip
    assert found.plan.modules and found.chosen is not None
    assert found.chosen.memory.device <= found.device.total
    entries = found.plan.modules  # (named in the answer, the first three)
    assert f"plan: {len(entries)} entries ({', '.join(entries[:3])}" in str(found)


def test_a_reserve_is_left_free_and_the_output_a_loop_may_keep_is_named() -> None:
    """``reserve`` keeps memory free (a smaller batch fits), and the answer says what the loop
    it assumes frees, and what keeping the output through the next forward would take."""
    model, args, kwargs = EXAMPLES["mlp"]()
    make = lambda b: scale_batch(args, kwargs, b)  # noqa: E731
    how = {"device_memory": "32MiB", "optimizer": "sgd", "verify": False, "max_batch": 8192}
    plain = autoremat.fit(model, make, **how)
    kept = autoremat.fit(model, make, reserve="8MiB", **how)
    assert kept.batch < plain.batch
    assert kept.device.for_tensors() == plain.device.for_tensors() - 8 * 2**20
    assert kept.chosen is not None and kept.chosen.memory.device <= kept.device.limit == 24 * 2**20
    assert kept.chosen.output_bytes == kept.batch * 256 * 4  # the last Linear's output
    assert "8.00 MiB reserved" in str(kept) and "keeps the output alive" in str(kept)
    with pytest.raises(ValueError, match="reserve"):
        device_model("1GiB", "cpu", "50%")


class ReadsAValue(nn.Module):
    """A chain of Linear + GELU blocks whose forward reads a tensor's value (``.item()``, as
    Hugging Face mask code does): it cannot run on ``meta``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().amax().item() > 1e6:  # data-dependent control flow
            x = x / 2
        return self.net(x)


@pytest.mark.slow
def test_a_model_that_cannot_run_on_meta_is_sized_from_real_steps_scaled(caplog: Any) -> None:
    """``fit`` falls back to profiling real steps at batches 2, 4 and 6 and scaling them
    (checked at 6): the scaled profile is the real one to the byte on this model, the batch
    found trains within the device, and 1% more does not fit."""
    from autoremat.training.scaled_profile import ScaledProfiles

    torch.manual_seed(0)
    model = ReadsAValue()
    make = lambda b: ((torch.randn(b, 64),), {})  # noqa: E731
    with pytest.raises(RuntimeError, match="meta"):
        autoremat.profile(meta_copy(model), (torch.randn(4, 64, device="meta"),))
    real = lambda b: autoremat.profile(model, (torch.randn(b, 64),))  # noqa: E731
    scaled = ScaledProfiles(real, 1, real(1))
    expected, got = real(40), scaled.at(40)
    assert got.peak == expected.peak and got.backward_points == expected.backward_points
    assert {k: c.freed for k, c in got.costs.items()} == {
        k: c.freed for k, c in expected.costs.items()
    }
    with caplog.at_level("WARNING", logger="autoremat.training.prober"):
        found = autoremat.fit(model, make, device_memory="4MiB", optimizer="sgd")
    assert "fit: sizing ReadsAValue from real steps" in caplog.text
    assert "cannot run on meta" in caplog.text and "Tensor.item()" in caplog.text
    assert found.plan.modules and found.fits and found.measured is not None
    assert abs(found.chosen.memory.tensors - as_sized(found)) <= 0.01 * as_sized(found)
    # 1% more does not fit even at its lowest budget (found within 0.1% of the peak)
    up_args = make(found.batch * 101 // 100)[0]
    lowest = autoremat.lowest_budget(model, up_args, objective="flops")
    plan = autoremat.plan(model, up_args, budget=lowest, objective="flops")
    wrapped = plan.apply(copy.deepcopy(model))
    up = autoremat.measure_memory(wrapped, up_args, optimizer="sgd")
    assert up.allocated is not None and up.allocated > found.device.total  # (as fit sizes it)


class DrawsMasks(ReadsAValue):
    """:class:`ReadsAValue` whose step keeps rows picked by a mask drawn from NumPy's generator
    (as Wav2Vec2's SpecAugment masks are): its memory changes with the draw."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.from_numpy(np.random.rand(x.shape[0], 16) < 0.3)
        y = super().forward(x)
        return y.sum() + self.head(y.view(-1, 16, 4)[keep]).pow(2).sum()


@pytest.mark.slow
def test_a_step_whose_memory_depends_on_random_draws_is_scaled_with_headroom() -> None:
    """No window of such a step is exactly affine (``fit`` refused it: ``NotScalable``). A
    second draw shows its memory varies, so a window that misses by little is taken, its
    figures raised by the miss in proportion to the batch: at batches 40 and 80 the scaled peak
    is at or above three other draws' real peaks, and within 5% of them. ``fit`` finds a batch
    and its plan says it carries headroom."""
    from autoremat.training.scaled_profile import ScaledProfiles

    np.random.seed(0)
    torch.manual_seed(0)
    model = DrawsMasks()
    real = lambda b: autoremat.profile(model, (torch.randn(b, 64),), timed=False)  # noqa: E731
    scaled = ScaledProfiles(real, 1, real(1))
    for batch in (40, 80):
        got = scaled.at(batch).peak
        draws = []
        for seed in (1, 2, 3):
            np.random.seed(seed)
            draws.append(real(batch).peak)
        assert max(draws) <= got <= 1.05 * max(draws)
    assert scaled.jitter is not None and scaled.jitter[0] > 0
    found = autoremat.fit(model, lambda b: ((torch.randn(b, 64),), {}), device_memory="4MiB",
                          optimizer="sgd", verify=False)  # fmt: skip
    assert found.batch > 80 and "bytes or more of headroom" in found.plan.estimated_by


def _tiny_bert(padded: bool) -> tuple[nn.Module, Any, Any]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
        vocab_size=500, max_position_embeddings=128,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config).train()
    ids = torch.randint(0, 500, (2, 64))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 40:] = 0
    return model, (ids,), {"attention_mask": mask, "labels": torch.tensor([0, 1])}


@pytest.mark.slow
@pytest.mark.parametrize("padded", [False, True], ids=["mask", "padded-mask"])
def test_bert_under_bf16_autocast_is_sized_from_real_steps_scaled(padded: bool) -> None:
    """BERT's mask code reads values (``.item()``), so ``fit`` sizes it from real steps.
    Under bf16 autocast a recompute's highest moment changes between batches 2 and 6 (the
    weights' copies, whatever the batch, against the activations): the check moves on to
    the next window of batches, and the scaled profile is the real one to the byte. A plan's
    step there does not scale (its peak moves between moments), so it is priced by the
    walk, an upper bound of its run, and says so. ``fit``'s batch fits when checked."""
    from autoremat.training.scaled_profile import ScaledProfiles, off_by

    model, args, kwargs = _tiny_bert(padded)
    spec = ("cpu", torch.bfloat16)

    def real(b: int) -> autoremat.costs.profile.Profile:
        return autoremat.profile(
            model, *scale_batch(args, kwargs, b), autocast=spec, timed=False
        )

    scaled = ScaledProfiles(real, 1, real(1))
    assert off_by(scaled.at(24), real(24)) == 0
    assert scaled.base is not None
    entries = PlanFields(("bert.encoder.layer.0", "bert.encoder.layer.1"))
    with pytest.raises(CannotRun, match="not linear in the batch"):
        scaled.rehearsal_at(24).peak(entries)
    found = autoremat.fit(
        model, lambda b: scale_batch(args, kwargs, b), device_memory="48MiB",
        autocast=spec, optimizer="sgd", max_batch=256,
    )  # fmt: skip
    assert found.fits and found.measured is not None and found.batch > 64
    # its output is a loss and 2 logits a row: a loop keeping it needs no reserve worth a word
    assert "each step's tensors are freed" in str(found)
    assert "keeps the output alive" not in str(found)


def test_a_step_that_does_not_scale_with_the_batch_is_refused_by_name() -> None:
    """A step whose memory grows with the square of the batch cannot be extrapolated: the
    check at 3b says so, and names the way out."""
    from autoremat.training.scaled_profile import NotScalable

    class Pairs(ReadsAValue):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = super().forward(x)
            return (y @ y.T).relu()  # batch x batch

    model = Pairs()
    with pytest.raises(NotScalable, match=r"not linear in the batch.*plan\(model, args, kw"):
        autoremat.fit(model, lambda b: ((torch.randn(b, 64),), {}), device_memory="64MiB",
                      optimizer="sgd", verify=False)  # fmt: skip


def meta_copy(model: nn.Module) -> nn.Module:
    from autoremat.training.fit import meta_shadow

    return meta_shadow(model)


def test_the_fit_command_takes_a_reserve(capsys: Any) -> None:
    code = main(["fit", "mlp", "--device-memory", "64MiB", "--optimizer", "sgd", "--reserve",
                 "16MiB", "--no-verify", "--max-batch", "4096"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "16.00 MiB reserved" in out and "--reserve" in out


@given(
    fixed=st.integers(0, 10**6),
    per_row=st.integers(1, 10**5),
    squared=st.integers(0, 50),
    steps=st.lists(st.integers(0, 10**5), min_size=1, max_size=8),
    limit=st.integers(1, 10**9),
    top=st.integers(1, 2**16),
)
def test_the_batch_search_finds_the_largest_that_fits_in_few_tries(
    fixed: int, per_row: int, squared: int, steps: list[int], limit: int, top: int
) -> None:
    """Whatever the memory's growth (a line, a square, steps), as long as it grows: the search
    ``fit`` and its check use (``prober.narrow``) returns the largest batch that fits, found
    in about as few tries as bisection would need from a known bound."""
    from types import SimpleNamespace

    from autoremat.training.prober import narrow

    def need(b: int) -> int:  # (a step up every 1,000 rows)
        return fixed + per_row * b + squared * b * b + sum(steps[: b // 1000])

    def memory_of(b: int) -> Any:
        tried.append(b)
        return SimpleNamespace(device=need(b), parameters=fixed, buffers=0, optimizer_state=0)

    truth = max((b for b in range(1, top + 1) if need(b) <= limit), default=0)
    tried: list[int] = []  # (as fit's search: from batch 1, nothing above known)
    assert narrow(0, top + 1, memory_of, limit, 1, bounded=False) == truth
    assert all(1 <= b <= top for b in tried)
    assert len(tried) <= 3 * top.bit_length() + 3
    tried.clear()
    assert narrow(0, top + 1, memory_of, limit, top, bounded=True) == truth
    assert len(tried) <= 2 * top.bit_length() + 3

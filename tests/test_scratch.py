"""What the CPU allocator sees beyond the tensors: kernels' scratch, and what checkpoints keep
(RNG states, buffer copies). On a CPU ``plan(device_memory=...)`` and ``fit`` run each plan's step
counted by the allocator (:mod:`autoremat.planning.rehearsal`), checked against its peak."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from torch import nn

import autoremat
from autoremat.comparison.recomputed import RecomputeCounter
from autoremat.examples import EXAMPLES
from autoremat.planning.plan import plan_from_profile, profile_lowest
from autoremat.planning.rehearsal import rehearsal_for
from autoremat.record.memory import CpuAllocatorMemory
from autoremat.record.step import train_step
from autoremat.training.scale_batch import scale_batch
from autoremat.training.step_memory import buffer_copies


def _cnn(batch: int = 4) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The built-in VGG-style CNN (BatchNorm, dropout) at a small batch: its convolutions'
    backward takes scratch buffers no op returns."""
    model, args, kwargs = EXAMPLES["cnn"]()
    args, kwargs = scale_batch(args, kwargs, batch)
    return model, args, kwargs


def _recomputed(wrapped: nn.Module, args: Any, kwargs: Any, entries: Any) -> None:
    """Raise unless each entry ran ops in a recompute of one training step (a copy: the
    model's statistics stay as measured)."""
    with RecomputeCounter() as seen:
        train_step(copy.deepcopy(wrapped), args, kwargs, None)
    seen.check(entries)


def test_the_allocator_marks_the_most_it_held_between_two_marks() -> None:
    with CpuAllocatorMemory() as memory:
        kept = torch.ones(1000)  # 4,000 B
        memory.snapshot("a")
        scratch = torch.ones(2000)  # 8,000 B, gone before the next mark
        del scratch
        memory.snapshot("b")
    assert memory.marks == {"a": 4000, "b": 4000}
    assert memory.highs == {"a": 4000, "b": 12000}
    assert memory.peak == 12000 and kept.numel() == 1000


def test_garbage_an_earlier_session_saw_made_is_collected_before_not_counted_inside() -> None:
    """The allocator reports the free of a block an earlier session saw made: a reference
    cycle of such blocks, collected inside a later session, would count negative (in the
    suite, a lowest plan measured 3.2 MB for 5.5). It is collected on entry."""
    with CpuAllocatorMemory():
        cycle: list[Any] = [torch.ones(10_000)]
        cycle.append(cycle)
    del cycle
    with CpuAllocatorMemory() as memory:
        gc.collect()  # (the collector may run anywhere in a step)
        kept = torch.ones(1000)  # 4,000 B
    assert memory.peak == memory.current == 4000 and kept.numel() == 1000


def test_plans_run_by_the_allocator_state_its_peak_beyond_the_tensors() -> None:
    """The tracker misses the convolutions' scratch (about a fifth of the lowest plan's
    peak); plans whose steps run counted by the allocator state its peak, above the
    tracker's, and hold such a budget when applied (each entry recomputed)."""
    model, args, kwargs = _cnn()
    prof = autoremat.profile(model, args, kwargs)
    by_allocator = rehearsal_for(prof, memory="allocator")
    assert by_allocator.way == "allocator" and "allocator" in by_allocator.how
    lowest = profile_lowest(prof, objective="flops", rehearsal=by_allocator)
    assert lowest > profile_lowest(prof, objective="flops")
    for budget in (0.9, lowest):
        plan = plan_from_profile(model, prof, budget, objective="flops", rehearsal=by_allocator)
        wrapped = plan.apply(copy.deepcopy(model))
        seen = autoremat.measure(wrapped, args, kwargs, memory="allocator").peak
        _recomputed(wrapped, args, kwargs, plan.modules)
        assert seen == plan.estimated_peak and plan.budget is not None and seen <= plan.budget


def test_a_checkpointed_batchnorm_keeps_its_statistics_copy_which_the_bound_covers() -> None:
    """The replay keeps each checkpointed call's pre-forward BatchNorm statistics (2 x channels
    floats and the 8-byte counter) until its recompute: device memory no op makes, seen by the
    allocator and not by the tracker (which counts the checkpoint's RNG state), within
    :func:`buffer_copies`' bound."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256))
                            for _ in range(4)))  # fmt: skip
    x = torch.randn(64, 256)
    prof = autoremat.profile(model, (x,))
    unseen = []
    for entries in ((), ("0",), ("0", "1", "2")):
        wrapped = autoremat.wrap.apply(copy.deepcopy(model), list(entries))
        allocator = autoremat.measure(wrapped, (x,), memory="allocator").peak
        unseen.append(allocator - autoremat.measure(wrapped, (x,)).peak)
    statistics = 2 * 256 * 4 + 8
    assert unseen[0] == 0 and unseen[1] == statistics
    bound = buffer_copies(("0", "1", "2"), model, prof.module_tree)
    assert bound >= 3 * statistics and statistics <= unseen[2] <= bound


def test_a_plan_for_a_cpu_fits_by_the_allocators_peak_where_the_tracker_would_not() -> None:
    model, args, kwargs = _cnn()
    plain = autoremat.measure_memory(model, args, kwargs, optimizer="sgd")
    assert plain.allocated is not None and plain.allocated > plain.tensors
    device = int(0.8 * plain.allocated)
    plan = autoremat.plan(model, args, kwargs, device_memory=device, optimizer="sgd")
    wrapped = plan.apply(copy.deepcopy(model))
    measured = autoremat.measure_memory(wrapped, args, kwargs, optimizer="sgd")
    _recomputed(wrapped, args, kwargs, plan.modules)
    assert measured.allocated is not None and measured.allocated <= device


@pytest.mark.slow
def test_fit_on_a_cpu_finds_the_batch_the_allocator_fits_and_the_next_size_up_it_does_not() -> None:
    """On ``meta`` the convolutions' scratch does not show; ``fit`` sizes again from real steps
    by the CPU allocator: the batch it finds fits by the allocator's own peak, and the next
    size up does not, even with the most recompute."""
    model, args, kwargs = _cnn()
    state = copy.deepcopy(model.state_dict())
    make = lambda b: scale_batch(args, kwargs, b)  # noqa: E731
    found = autoremat.fit(model, make, device_memory="40MiB", optimizer="sgd")
    assert found.measured is not None and found.measured.allocated is not None
    assert found.fits and found.seen == found.measured.allocated <= found.device.limit
    assert found.plan.modules  # (it needs recompute)
    assert found.batch in found.by_allocator and "by the CPU allocator" in str(found)
    up_args, up_kwargs = make(found.batch + 1)
    prof = autoremat.profile(model, up_args, up_kwargs)
    by_allocator = rehearsal_for(prof, memory="allocator")
    least = profile_lowest(prof, rehearsal=by_allocator)
    lowest = plan_from_profile(model, prof, least, rehearsal=by_allocator)
    up = lowest.apply(copy.deepcopy(model))
    measured = autoremat.measure_memory(up, up_args, up_kwargs, optimizer="sgd")
    assert measured.allocated is not None and measured.allocated > found.device.limit
    assert not autoremat.wrap.wrapped_paths(model)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_inside_a_profiler_of_the_callers_training_is_measured_and_planned_by_tensors() -> None:
    """The allocator's count needs a profiler session of its own: inside the caller's, the
    tensors are measured (``allocated`` is ``None``) and planned by, nothing raised."""
    model, args, kwargs = _cnn(2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        inside = autoremat.measure_memory(model, args, kwargs, optimizer="sgd")
        device = int(0.8 * inside.tensors)
        plan = autoremat.plan(model, args, kwargs, device_memory=device)
    alone = autoremat.measure_memory(model, args, kwargs, optimizer="sgd")
    assert inside.allocated is None and alone.allocated is not None
    assert inside.tensors == alone.tensors
    assert plan.modules  # (planned by tensors there)

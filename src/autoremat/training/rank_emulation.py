"""One rank of an FSDP2 training step, run in this process on fake tensors: no ranks, no memory.

FSDP2's per-rank memory depends on what it gathers when (the unit running, the one it
prefetches, the all-gather and reduce-scatter buffers, the padding of each shard), and that is
FSDP2's own code to know. So the step is not modelled: it is *run*, as rank 0 of a
``world_size``-rank job, with

* a fake process group (``torch.distributed``'s ``"fake"`` backend: collectives return at once
  and move no data; rank 0 is the rank with the largest shards);
* fake tensors (``FakeTensorMode``): shapes, dtypes and storages without memory or values;
* a copy of the model whose parameters and buffers are fake (:func:`fake_shadow`), the plan
  applied to it, ``fully_shard`` on each unit and on the root;

and its memory counted by :class:`ResizeCountingMemory`
(:class:`~autoremat.record.memory.LiveMemory` plus ``UntypedStorage.resize_``, with which
FSDP2 frees and re-allocates unsharded parameters).
Counted: the parameters each rank keeps (padded shards), the step's peak above what was live
before it (activations, unsharded parameters gathered, reduce-scatter buffers, gradients), the
gradients left after it (shards), and the shards' shapes (for the optimizer's state).
Measured against real gloo ranks (2 and 4, ``tests/test_per_rank.py``): equal to the byte.

Not possible inside a job whose process group is initialised (a process has one default
group): size before ``init_process_group``, which gives every rank the same answer.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from autoremat.core.devices import model_device
from autoremat.core.host_rng import generators_kept
from autoremat.core.huggingface import ordinary_positions_on_meta
from autoremat.core.nested import tensor_bytes
from autoremat.planning.rehearsal import PlanFields, quiet
from autoremat.record.memory import LiveMemory
from autoremat.record.shadow import meta_shadow
from autoremat.record.step import Autocast, LossFn, train_step
from autoremat.training.sharding import Sharding, default_units
from autoremat.wrap.wrapping import apply

__all__ = ["EmulatedRank", "ResizeCountingMemory", "emulate_fsdp2", "fake_shadow", "fake_world"]


class ResizeCountingMemory(LiveMemory):
    """:class:`LiveMemory` that also counts ``UntypedStorage.resize_``: FSDP2 frees the
    unsharded parameters of a unit with ``resize_(0)`` and allocates them again with
    ``resize_(n)``, which no op shows. For storages made before it was entered too (run a
    step first, so that FSDP2's unsharded storages exist)."""

    def __enter__(self) -> ResizeCountingMemory:
        self._resize = torch.UntypedStorage.resize_
        original = self._resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            before = storage.nbytes()
            out = original(storage, size)
            with self._lock:
                self.current += storage.nbytes() - before
                self.peak = max(self.peak, self.current)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)


@dataclass(frozen=True)
class EmulatedRank:
    """What rank 0 of the emulated job holds (bytes): ``parameters`` (its shards, padded),
    ``gradients`` after the step (shards), ``step_peak`` (the most the step adds above what
    was live before it); ``shards``: the local parameter shards (fake), for the optimizer."""

    parameters: int
    gradients: int
    step_peak: int
    shards: tuple[torch.Tensor, ...]


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[Any]:
    """A fake default process group of ``world_size`` ranks (this process rank 0) and a
    CPU device mesh over it, destroyed on exit (``sys.excepthook`` put back).

    Raises:
        RuntimeError: a process group is already initialised (the message says to size
            before ``init_process_group``).
    """
    if not dist.is_available():
        raise RuntimeError("per-rank sizing needs torch.distributed, which this build lacks")
    if dist.is_initialized():
        raise RuntimeError(
            "per-rank sizing emulates the ranks on a fake process group, and this process "
            "already has one initialised: size before dist.init_process_group (every rank "
            "gets the same answer, sized on fake tensors), or in another process"
        )
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    from torch.distributed.device_mesh import init_device_mesh

    hook = sys.excepthook  # (init_process_group prefixes it with the rank, for good)
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def fake_shadow(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake CPU tensors of the same
    shapes and dtypes (call inside the ``FakeTensorMode``): no memory, no values copied."""
    return meta_shadow(model, device="cpu")


def emulate_fsdp2(
    model: nn.Module,
    inputs: tuple[Any, dict[str, Any]],
    sharding: Sharding,
    plan: PlanFields | None = None,
    loss_fn: LossFn | None = None,
    autocast: Autocast | None = None,
    device: str | None = None,
) -> EmulatedRank:
    """Rank 0's memory in a training step of ``model`` under ``sharding`` (FSDP2) with
    ``plan``'s entries applied, on ``inputs`` (one rank's ``(args, kwargs)``; real or on
    ``meta``): see the module docstring. Counted as ``device`` holds it (by default the
    model's; on the CPU with checkpoint's RNG states). ``model`` is not touched.

    Raises:
        RuntimeError: a process group is initialised (:func:`fake_world`).
        ValueError: FSDP2 refuses a unit (the message names it, gives FSDP2's reason and
            what to choose instead), or the step cannot run on fake tensors.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    cast = None if autocast is None else ("cpu", autocast[1])
    with (
        fake_world(sharding.world_size) as mesh,
        generators_kept(),  # (a forward may draw from Python's or NumPy's too)
        FakeTensorMode(allow_non_fake_inputs=True),
        ordinary_positions_on_meta(),
    ):
        shadow = fake_shadow(model)
        args, kwargs = tree_map(_fake, inputs)
        if plan is not None:
            apply(shadow, plan.modules, selective=plan.selective or {}, calls=plan.calls)
        keep = sharding.reshard_after_forward
        how: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": keep}
        if sharding.mp_policy is not None:
            how["mp_policy"] = sharding.mp_policy
        _shard(model, shadow, sharding.units or (), how)
        counted = device or str(model_device(model))
        step = _stepped(model, shadow, (args, kwargs), loss_fn, cast, counted == "cpu",
                        sharding.units or ())  # fmt: skip
        shards = tuple(_local(p) for p in shadow.parameters() if p.requires_grad)
        grads = [_local(p.grad) for p in shadow.parameters() if p.grad is not None]
        return EmulatedRank(
            parameters=tensor_bytes([_local(p) for p in shadow.parameters()]),
            gradients=tensor_bytes(grads),
            step_peak=step.peak,
            shards=shards,
        )


def _shard(model: nn.Module, shadow: nn.Module, units: Sequence[str],
           how: dict[str, Any]) -> None:  # fmt: skip
    """``fully_shard`` each of ``units`` of ``shadow``, then its root.

    Raises:
        ValueError: FSDP2 refuses a unit (:func:`_refused`: a container without a forward).
    """
    from torch.distributed.fsdp import fully_shard

    for path in units:
        try:
            fully_shard(shadow.get_submodule(path), **how)
        except (ValueError, TypeError, RuntimeError, AssertionError) as exc:
            raise _refused(model, [path], exc) from None
    fully_shard(shadow, **how)


def _refused(model: nn.Module, units: Sequence[str], exc: BaseException) -> ValueError:
    """The error for ``units`` that FSDP2 refused with ``exc``: they are named, with
    FSDP2's reason (its first line) and the units to choose instead."""
    why = str(exc).splitlines()[0].rstrip(" (")[:300] if str(exc) else type(exc).__name__
    used = "DTensor" in why  # (a unit's forward does not run, or another reads its weights)
    note = ": a unit's parameter was used outside its forward, where FSDP2 does not gather it"
    blocks = default_units(model)
    instead = (
        f"the model's blocks, the default (units=None: {', '.join(blocks[:3])}"
        f"{', ...' * (len(blocks) > 3)})"
        if blocks and tuple(blocks) != tuple(units)
        else "modules whose forward runs in the step and that share no weight with another unit"
    )
    named = f"unit{'s' * (len(units) != 1)} {', '.join(units)}" if units else "root unit"
    return ValueError(
        f"FSDP2 refused the {named} of {type(model).__name__}{note * used} "
        f"({type(exc).__name__}: {why}). Choose other units in Sharding(..., units=[...]) "
        f"(--fsdp-units): {instead}"
    )


def _by_fsdp2(exc: BaseException) -> bool:
    """Whether FSDP2 itself refused the step's units: ``exc`` raised in FSDP2's code (its
    lazy init finds weights tied across units), or a sharded parameter (a DTensor) used
    outside its unit's forward (a unit whose forward does not run, or whose weights another
    module reads), where FSDP2 does not gather it."""
    tb, last = exc.__traceback__, ""
    while tb is not None:
        last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    inside = os.sep.join(("", "distributed", "fsdp", ""))
    return inside in last or "mixed torch.Tensor and DTensor" in str(exc)


def _stepped(model: nn.Module, shadow: nn.Module, inputs: tuple[Any, Any],
             loss_fn: LossFn | None, cast: Autocast | None, rng_states: bool,
             units: Sequence[str]) -> ResizeCountingMemory:  # fmt: skip
    """Two steps of the sharded fake ``shadow`` (the first: FSDP2's lazy init), the second
    counted; FSDP2's and the model's warnings about the emulation's classes kept quiet.

    Raises:
        ValueError: FSDP2 refused ``units`` (:func:`_by_fsdp2`, :func:`_refused`), or the
            step cannot run on fake tensors (it reads values: ``nonzero`` routing,
            ``.item()``), naming the model and what to do.
    """
    args, kwargs = inputs
    try:
        with quiet():  # (Hugging Face's use_cache note would name FSDP's class)
            train_step(shadow, args, kwargs, loss_fn, autocast=cast)
            with ResizeCountingMemory(rng_states=rng_states) as step:
                train_step(shadow, args, kwargs, loss_fn, autocast=cast)
        return step
    except Exception as exc:
        if _by_fsdp2(exc):
            raise _refused(model, units, exc) from None
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ValueError(
            f"{type(model).__name__}'s FSDP2 rank cannot be emulated on fake tensors "
            f"({type(exc).__name__}: {why}): its step reads values (data-dependent ops such "
            f"as nonzero routing). Plan one rank's batch on the real device instead "
            f"(autoremat.plan(..., device_memory=...)) and add FSDP2's gathers by hand "
            f"(docs/scale.md)"
        ) from exc


def _fake(value: Any) -> Any:
    return torch.empty_like(value, device="cpu") if isinstance(value, torch.Tensor) else value


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters and gradients); other tensors as they are."""
    return getattr(t, "_local_tensor", t)

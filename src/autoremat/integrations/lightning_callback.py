"""Lightning: ``Trainer(callbacks=[AutoRematLightning(budget="20GiB")])``.

:class:`AutoRematLightning` plans on the first training batch and applies the plan before that
step's forward (:class:`~autoremat.integrations.first_batch.FirstBatchPlanner`, attached in
``on_train_batch_start``): a forward pre-hook on the module that ``training_step`` calls (the
``LightningModule`` itself, ``self(x)``; or the submodule named by ``module``, such as
``"model"`` for ``self.model(x)``) profiles that call's step on a ``meta`` shadow, with the
trainer referred to, not copied. The loss priced is :func:`~autoremat.record.step.default_loss` of
the call's output: what ``training_step`` computes after it is not seen (its activations are the
call's). When the hooked module's forward did not run in the first ``training_step``, the
callback says which ``module=`` to name. At ``on_train_end`` the plan is taken off (``remove``).

Under ``strategy="ddp"`` the plan is made on rank 0 and sent to every rank. Under
``ModelParallelStrategy`` and ``FSDPStrategy`` the module is sharded in ``configure_model``,
before the first batch: in ``setup`` (before it) the callback keeps a ``meta`` shadow of the
module unsharded; at the first batch it runs that shadow's ``training_step`` on the batch (on
``meta``) up to the hooked module's forward, plans there (rank 0, sent to every rank) and
applies the plan to the sharded module. If a wrapped module is itself a ``fully_shard``
unit, the plan stays applied after training (a warning). Needs ``pytorch-lightning``: the
``lightning`` extra.
"""

from __future__ import annotations

import logging
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils._pytree import tree_map

from autoremat.integrations.first_batch import FirstBatchPlanner, sharded_paths
from autoremat.planning.plans import Plan
from autoremat.planning.strategies.budget import BudgetTooLow
from autoremat.record.shadow import meta_shadow
from autoremat.wrap.wrapping import remove

__all__ = ["AutoRematLightning"]

logger = logging.getLogger(__name__)


class AutoRematLightning(pl.Callback):
    """Plan the recompute of the module ``training_step`` calls on the first training batch,
    and apply it before that forward (module docstring). ``budget`` (the step's peak, as
    :func:`autoremat.plan` takes it) or ``device_memory`` (the whole step, a size:
    ``autoremat.plan(..., device_memory=...)``); ``module``: the attribute path of the submodule
    ``training_step`` calls (``""``: the ``LightningModule``).

    Raises:
        ValueError: neither or both of ``budget`` and ``device_memory``; ``module`` names
            no submodule.
    """

    def __init__(
        self,
        budget: int | float | str | None = None,
        *,
        device_memory: int | str | None = None,
        module: str = "",
        selective: bool = True,
        objective: str = "time",
        remove: bool = True,
    ) -> None:
        self.planner = FirstBatchPlanner(budget, device_memory, "adamw", None, selective,
                                         objective)  # fmt: skip
        self.module, self.remove = module, remove
        self._first = True  # the first training batch is yet to end
        self._target: Any = None  # the module planned
        self._unsharded: Any = None  # a meta shadow taken before the strategy shards
        self._refused: BaseException | None = None  # the callback's own error about module=

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Before ``configure_model``: under a strategy that shards the module there
        (``ModelParallelStrategy``, ``FSDPStrategy``), keep a ``meta`` shadow of it unsharded,
        to plan on at the first batch."""
        if stage == "fit" and type(trainer.strategy).__name__ in _SHARDING_STRATEGIES:
            self._unsharded = meta_shadow(pl_module, shared=(trainer,))

    @property
    def plan(self) -> Plan | None:
        """The plan applied (``None`` until the first training batch)."""
        return self.planner.plan

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._first or self.planner.plan is not None:
            return
        try:
            target = pl_module.get_submodule(self.module) if self.module else pl_module
        except AttributeError:
            self._refused = ValueError(
                f"AutoRematLightning(module={self.module!r}): {type(pl_module).__name__} has no "
                f"such submodule; name the one training_step calls (module='model' for "
                f"self.model(x))"
            )
            raise self._refused from None
        self.planner.shared = (trainer,)
        optimizers = getattr(trainer, "optimizers", None) or []
        if optimizers:
            self.planner.optimizer = optimizers[0]
        self._target = target
        if self._unsharded is not None and sharded_paths(target):
            self._plan_unsharded(target, batch, batch_idx)
            return
        self.planner.attach(target)

    def _plan_unsharded(self, target: Any, batch: Any, batch_idx: int) -> None:
        """Plan on the shadow kept before sharding, at the inputs its ``training_step`` gives
        the hooked module for this batch (on ``meta``), and apply to the sharded module (the
        structure check looks through FSDP's classes)."""
        shadow = self._unsharded.get_submodule(self.module) if self.module else self._unsharded
        inputs = _forward_inputs(self._unsharded, shadow, batch, batch_idx)
        if inputs is None:
            return  # (on_train_batch_end says which module= to name)
        plan = self.planner.agreed(shadow, *inputs)
        plan.apply(target)
        self.planner.plan = plan

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.planner.plan is not None and self._target is not None:  # a later fit()
            self.planner.plan.apply(self._target)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        if not self._first:
            return
        self._first = False
        self.planner.detach()
        if self.planner.plan is None:
            logger.warning(
                "AutoRematLightning: the forward of %s did not run in the first training_step, "
                "so nothing was planned: name the submodule training_step calls "
                "(AutoRematLightning(module='model') for self.model(x))",
                self.module or type(pl_module).__name__,
            )
        elif trainer.is_global_zero:
            print(f"autoremat: {self.planner.plan.summary()}")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Before Lightning raises ``exception`` again: when it is this callback's answer to its
        settings (a budget or device memory the step cannot reach with any plan, a ``module``
        that names nothing), its traceback is dropped, so the user sees the message that says
        what to change and not the training loop's frames it was raised under."""
        ours = isinstance(exception, BudgetTooLow) and self._first and self.planner.plan is None
        if ours or exception is self._refused:
            exception.with_traceback(None)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.planner.detach()
        if self.remove and self.planner.plan is not None:
            try:
                remove(pl_module)
            except ValueError as exc:  # (a wrapped module is a fully_shard unit: kept)
                logger.warning("AutoRematLightning: the plan stays applied: %s", exc)


_SHARDING_STRATEGIES = ("ModelParallelStrategy", "FSDPStrategy")


class _Captured(Exception):
    """Raised by the pre-hook that captured the inputs, to stop the shadow's step there."""


def _forward_inputs(shadow: Any, target: Any, batch: Any, batch_idx: int) -> Any:
    """``(args, kwargs)`` of ``target``'s first call when ``shadow.training_step`` runs on
    ``batch`` moved to ``meta``, stopped there; ``None`` when it is not called."""
    seen: list[Any] = []

    def hook(module: Any, args: Any, kwargs: Any) -> None:
        seen.append((args, kwargs))
        raise _Captured

    on_meta = tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, batch)
    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    shadow.train()
    try:
        with torch.enable_grad():
            shadow.training_step(on_meta, batch_idx)
    except _Captured:
        pass
    finally:
        handle.remove()
    return seen[0] if seen else None

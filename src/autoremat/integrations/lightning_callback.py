"""Lightning: ``Trainer(callbacks=[AutoRematLightning(budget="20GiB")])``.

:class:`AutoRematLightning` plans on the first training batch and applies the plan before that
step's forward (:class:`~autoremat.integrations.first_batch.FirstBatchPlanner`, attached in
``on_train_batch_start``): a forward pre-hook on the module that ``training_step`` calls (the
``LightningModule`` itself, ``self(x)``; or the submodule named by ``module``, such as
``"model"`` for ``self.model(x)``) profiles that call's step on a ``meta`` shadow, with the
trainer referred to, not copied. The loss priced is :func:`autoremat.default_loss` of the
call's output: what ``training_step`` computes after it is not seen (its activations are the
call's). When the hooked module's forward did not run in the first ``training_step``, the
callback says which ``module=`` to name. At ``on_train_end`` the plan is taken off (``remove``).

Under ``strategy="ddp"`` the plan is made on rank 0 and sent to every rank. Under
``FSDPStrategy`` and ``ModelParallelStrategy`` the module is sharded before the first batch:
refused on every rank (a ``RuntimeError`` naming the recipe: plan before sharding, apply in
``configure_model`` before ``fully_shard``; ``docs/scale.md``). Needs ``pytorch-lightning``:
the ``lightning`` extra.
"""

from __future__ import annotations

import logging
from typing import Any

import pytorch_lightning as pl

from autoremat.integrations.first_batch import FirstBatchPlanner
from autoremat.planning.plans import Plan
from autoremat.wrap.wrapping import remove

__all__ = ["AutoRematLightning"]

logger = logging.getLogger(__name__)


class AutoRematLightning(pl.Callback):
    """Plan the recompute of the module ``training_step`` calls on the first training batch,
    and apply it before that forward (module docstring). ``budget`` (the step's peak, as
    :func:`autoremat.plan` takes it) or ``device_memory`` (the whole step, a size:
    :func:`autoremat.plan_for_device`); ``module``: the attribute path of the submodule
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
            raise ValueError(
                f"AutoRematLightning(module={self.module!r}): {type(pl_module).__name__} has no "
                f"such submodule; name the one training_step calls (module='model' for "
                f"self.model(x))"
            ) from None
        self.planner.shared = (trainer,)
        optimizers = getattr(trainer, "optimizers", None) or []
        if optimizers:
            self.planner.optimizer = optimizers[0]
        self._target = target
        self.planner.attach(target)

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

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.planner.detach()
        if self.remove and self.planner.plan is not None:
            remove(pl_module)

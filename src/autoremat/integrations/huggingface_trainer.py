"""The Hugging Face ``Trainer``: ``Trainer(..., callbacks=[AutoRematCallback(budget="20GiB")])``.

:class:`AutoRematCallback` plans on the first training batch and applies the plan before the
first step (:class:`~autoremat.integrations.first_batch.FirstBatchPlanner`: the batch is
profiled on a ``meta`` shadow of the model, so planning takes no device memory and touches
nothing), then prints what it chose on the main process. It composes with the Trainer:

* the Trainer's own activation checkpointing (``TrainingArguments(gradient_checkpointing=True)``
  or ``activation_checkpointing=True``) recomputes too: the callback refuses it at
  ``on_train_begin`` and says which to turn off (autoremat's plan replaces it);
* ``torch_compile=True`` is refused: the Trainer compiles before the first batch, and a plan
  applied after would not be in the compiled graph (plan first with
  ``autoremat.plan(..., compile=...)``, then hand the Trainer the compiled model);
* saving (``save_model``, ``save_pretrained``, checkpoints) writes the original architecture:
  a wrapped module keeps its class's name and its state dict's keys, and at ``on_train_end``
  the plan is removed (``remove=True``, the default) so the model handed back is the user's.

Needs ``transformers`` (and the ``accelerate`` its ``Trainer`` needs): the ``huggingface`` extra.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from autoremat.integrations.first_batch import FirstBatchPlanner
from autoremat.planning.plans import Plan
from autoremat.record.step import LossFn
from autoremat.wrap.wrapping import remove

__all__ = ["AutoRematCallback"]


class AutoRematCallback(TrainerCallback):
    """Plan the model's recompute on the first training batch and apply it before the first
    step (module docstring). ``budget``: the step's peak, as :func:`autoremat.plan` takes it
    (``"20GiB"``, ``"50%"``, ``0.5``); or ``device_memory``: the whole training step on the
    device, optimizer state included (a size: ``autoremat.plan(..., device_memory=...)``, the
    Trainer's optimizer priced). ``remove``: take the plan off when training ends.

    Raises:
        ValueError: neither or both of ``budget`` and ``device_memory``; at
            ``on_train_begin``, the Trainer's own activation checkpointing or
            ``torch_compile`` also set (the message says which to turn off).
    """

    def __init__(
        self,
        budget: int | float | str | None = None,
        *,
        device_memory: int | str | None = None,
        loss_fn: LossFn | None = None,
        selective: bool = True,
        objective: str = "time",
        remove: bool = True,
    ) -> None:
        self.planner = FirstBatchPlanner(budget, device_memory, "adamw", loss_fn, selective,
                                         objective, on_plan=self._said)  # fmt: skip
        self.remove = remove
        self._main = True

    @property
    def plan(self) -> Plan | None:
        """The plan applied (``None`` until the first training batch)."""
        return self.planner.plan

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(args, "activation_checkpointing", False) or getattr(
            args, "gradient_checkpointing", False
        ):
            raise ValueError(
                "AutoRematCallback and the Trainer's own activation checkpointing "
                "(TrainingArguments(gradient_checkpointing=True) / activation_checkpointing=True) "
                "would both recompute: set it to False; autoremat's plan replaces it"
            )
        if getattr(args, "torch_compile", False):
            raise ValueError(
                "AutoRematCallback cannot change a model the Trainer compiles "
                "(TrainingArguments(torch_compile=True)) before its first batch: plan first "
                "(autoremat.plan(..., compile=...)), apply the plan, and compile the model yourself"
            )
        optimizer = kwargs.get("optimizer")
        if optimizer is not None:
            self.planner.optimizer = optimizer
        self._main = bool(getattr(state, "is_world_process_zero", True))
        if self.planner.plan is not None:  # a later train(): the plan made the first time
            self.planner.plan.apply(kwargs["model"])
        self.planner.attach(kwargs["model"])

    def _said(self, plan: Plan) -> None:
        if self._main:
            print(f"autoremat: {plan.summary()}")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.planner.detach()
        if self.remove and self.planner.plan is not None:
            remove(kwargs["model"])

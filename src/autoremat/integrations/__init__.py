"""autoremat where users train: a plan made on the first training batch and applied before the
first step, in the Hugging Face ``Trainer`` (:class:`AutoRematCallback`,
:mod:`autoremat.integrations.huggingface_trainer`) and Lightning
(:class:`autoremat.integrations.lightning_callback.AutoRematLightning`); each library is an
optional extra, imported only by its module. :mod:`autoremat.integrations.first_batch` holds
what they share; with accelerate, plan before ``accelerator.prepare`` (``docs/scale.md``)."""

from __future__ import annotations

from autoremat.integrations.first_batch import FirstBatchPlanner

__all__ = ["FirstBatchPlanner"]

"""A plan made on the first training batch a model sees, and applied before that step runs.

Trainers build the batch only once training starts, so :class:`FirstBatchPlanner` waits for
it: a forward pre-hook on the model, at its first call in training (``model.training`` and
grad enabled), profiles the step on those very inputs on a ``meta`` shadow of the model
(:func:`autoremat.training.fit.meta_shadow`: no memory, no weights copied, nothing of the
model's state touched, no random draw), plans it, and applies the plan in place before the
forward goes on. A model whose step cannot run on ``meta`` is profiled for real on those
inputs (left as found, :func:`autoremat.profile`). A plan that names the module itself (the
module whole, a run of its children when it is an ``nn.Sequential``) recomputes it from the
second step on: its first forward had begun when the hook ran. It says so (a warning, and
``plan.warnings["first_step"]``).

Under ``torch.distributed`` (a process group initialised, more than one rank) the plan is made
on rank 0 alone and sent to every rank (:func:`autoremat.broadcast_plan`) at that first call,
which every rank makes: each rank recomputes the same modules, as DDP and FSDP2 need. If rank
0 cannot plan, every rank raises (rank 0 its own error).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from autoremat.core.devices import model_device
from autoremat.core.entries import module_of
from autoremat.costs.profile import profile
from autoremat.planning.broadcast_plan import broadcast_plan
from autoremat.planning.plan import plan_from_profile
from autoremat.planning.plans import Plan
from autoremat.planning.rehearsal import rehearsal_for
from autoremat.planning.strategies.budget import BudgetTooLow
from autoremat.record.shadow import meta_shadow
from autoremat.record.snapshot import fsdp_classes
from autoremat.record.step import LossFn
from autoremat.training.device_plan import device_plan
from autoremat.training.optimizer_memory import OptimizerLike

__all__ = ["FirstBatchPlanner", "sharded_paths"]

logger = logging.getLogger(__name__)


@dataclass
class FirstBatchPlanner:
    """What to plan (``budget``: a step-peak budget as :func:`autoremat.plan` takes it; or
    ``device_memory``: the whole step, optimizer included, as
    ``autoremat.plan(..., device_memory=...)`` takes it, a size such as ``"20GiB"``), and the
    plan once made (``plan``)."""

    budget: int | float | str | None = None
    device_memory: int | str | None = None
    optimizer: OptimizerLike = "adamw"
    loss_fn: LossFn | None = None
    selective: bool = True
    objective: str = "time"
    plan: Plan | None = None
    on_plan: Callable[[Plan], None] | None = None  # told the plan once applied
    shared: tuple[object, ...] = ()  # objects the shadow refers to, not copies (a trainer)

    def __post_init__(self) -> None:
        if (self.budget is None) == (self.device_memory is None):
            raise ValueError(
                'give one of budget= (the step\'s peak: "20GiB", "50%", 0.5) or '
                'device_memory= (the whole training step on the device: "20GiB")'
            )
        self._hook: Any = None

    def attach(self, model: nn.Module) -> None:
        """Plan and apply at ``model``'s first call in training (module docstring)."""
        if self._hook is None and self.plan is None:
            self._hook = model.register_forward_pre_hook(self._first_call, with_kwargs=True)

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _first_call(self, model: nn.Module, args: Any, kwargs: Any) -> None:
        if not (model.training and torch.is_grad_enabled()) or _redirected(model):
            return
        self.detach()
        _refuse_sharded(model)
        self.plan, name = self.agreed(model, args, kwargs), type(model).__name__
        self.plan.apply(model)
        logger.info("autoremat: %s", self.plan.summary())
        own = [e or "(root)" for e in self.plan.modules if module_of(e) == ""]
        if own:  # (the module's own class was swapped: this call had looked up its forward)
            self.plan.warnings["first_step"] = _FIRST_STEP.format(name, ", ".join(own))
            logger.warning("autoremat: %s", self.plan.warnings["first_step"])
        if self.on_plan is not None:
            self.on_plan(self.plan)

    def agreed(self, model: nn.Module, args: Any, kwargs: Any) -> Plan:
        """The plan made here, or with many ranks made on rank 0 and sent to every rank."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.make(model, args, kwargs)
        made, failed = None, None
        if dist.get_rank() == 0:
            try:
                made = self.make(model, args, kwargs)
            except Exception as exc:  # (sent as no plan: every rank then raises)
                failed = exc
        try:
            return broadcast_plan(made)
        except ValueError:
            if failed is not None:
                raise failed from None
            raise

    def make(self, model: nn.Module, args: Any, kwargs: Any) -> Plan:
        """The plan for ``model`` on these inputs: on its ``meta`` shadow, else for real."""
        shadow = meta_shadow(model, self.shared)
        on_meta = tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v,
                           (args, kwargs))  # fmt: skip
        try:
            return self._planned(model, shadow, *on_meta)
        except BudgetTooLow:  # (the step's own answer: the same for real)
            raise
        except Exception as exc:  # (data-dependent ops, a meta kernel missing)
            why = str(exc).splitlines()[0][:200]
        logger.warning("autoremat: %s cannot be planned on meta (%s): profiling the step "
                       "for real", type(model).__name__, why)  # fmt: skip
        # (outside the except: an error planning for real is not shown inside the meta one's)
        return self._planned(model, model, args, kwargs)

    def _planned(self, model: nn.Module, profiled: nn.Module, args: Any, kwargs: Any) -> Plan:
        how = {"selective": self.selective, "objective": self.objective}
        if self.device_memory is not None:
            return device_plan(profiled, args, kwargs, device_memory=self.device_memory,
                               optimizer=self.optimizer, loss_fn=self.loss_fn, **how)  # type: ignore[arg-type]  # fmt: skip
        prof = profile(profiled, args, kwargs, loss_fn=self.loss_fn)
        rehearsal = rehearsal_for(prof, model_device(model))  # (counted as on the device)
        return plan_from_profile(model, prof, self.budget, rehearsal=rehearsal, **how)  # type: ignore[arg-type]


_FIRST_STEP = (
    "the plan recomputes {0} itself ({1}), whose first forward had begun when the plan was "
    "applied: this first step runs without those entries, at the peak without them, and the "
    "next steps with them. To recompute from the first step, hook a module that calls {0} "
    "(with Lightning: no module=, and training_step calling self(...), whose forward calls it)"
)


def _redirected(model: nn.Module) -> bool:
    """Whether this call runs another method in place of ``model``'s forward: Lightning under
    DDP calls the module with ``training_step`` set as its ``forward`` for the call (its
    forward redirection); the call of the model's own forward comes inside it."""
    own = vars(model).get("forward")
    return own is not None and getattr(own, "__func__", None) is not type(model).forward


def sharded_paths(model: nn.Module) -> list[str]:
    """The paths of ``model``'s modules FSDP shards or manages (``fully_shard`` units; FSDP1
    marks every module it manages, a wrapper outside included)."""
    fsdp = fsdp_classes()
    return [path or "(root)" for path, m in model.named_modules()
            if isinstance(m, fsdp) or getattr(m, "_is_fsdp_managed_module", False)]  # fmt: skip


def _refuse_sharded(model: nn.Module) -> None:
    """Raise when ``model`` was already sharded by FSDP (Lightning's ``FSDPStrategy`` and
    ``ModelParallelStrategy`` shard it before the first batch): ``fully_shard`` units inside
    it, or modules FSDP manages (FSDP1 wrapping it from outside). A sharded module cannot be
    profiled on ``meta``, and a real profile would issue collectives on its own."""
    sharded = sharded_paths(model)
    if sharded:
        raise RuntimeError(
            f"autoremat cannot plan {type(model).__name__} on its first batch: it is already "
            f"sharded by FSDP ({', '.join(sharded[:3])}{', ...' * (len(sharded) > 3)}). Plan "
            f"before sharding: size a rank with autoremat.fit(..., world_size=N, "
            f"sharding='fsdp2') (or make a plan), and apply it in configure_model before "
            f"fully_shard (docs/scale.md)"
        )

""":func:`autoremat.fit` per rank: batch sizes probed as one rank of a DDP or FSDP2 job sees them.

Each candidate batch is one rank's: its step is profiled on ``meta`` as for one device, and
its memory is the rank's (:mod:`autoremat.training.per_rank`: DDP's buckets; FSDP2's shards and
gathers from a step run on fake tensors over a fake process group), at the lowest plan to
size and at the cheapest fitting plan to choose
(:func:`~autoremat.training.per_rank.plan_for_rank`).
Nothing is checked on a device: the ranks are not here (``Fit.not_verified`` says so).
"""

from __future__ import annotations

from typing import Any

from autoremat.training.optimizer_memory import OptimizerLike, optimizer_memory
from autoremat.training.per_rank import RankPlanner, RankStep
from autoremat.training.prober import Candidate, Inputs, Probe, Prober, step_seconds
from autoremat.training.sharding import Sharding
from autoremat.training.step_memory import StepMemory

__all__ = ["RankProber"]


class RankProber(Prober):
    """A :class:`~autoremat.training.fit.Prober` whose memory is one rank's (module
    docstring)."""

    def __init__(self, model: Any, make_inputs: Inputs, optimizer: OptimizerLike, dm: Any,
                 loss_fn: Any, selective: bool, autocast: Any,
                 sharding: Sharding) -> None:  # fmt: skip
        super().__init__(model, make_inputs, optimizer_memory(model, optimizer), dm, loss_fn,
                         selective, autocast)  # fmt: skip
        self.optimizer, self.sharding = optimizer, sharding

    def probe(self, batch: int) -> Probe:
        if batch not in self.seen:
            args, kwargs = self.meta_inputs(batch)
            prof = self.profile(batch, args, kwargs)
            step = RankStep(self.shadow, (args, kwargs), prof, self.sharding, self.optimizer,
                            self.loss_fn, self.autocast, self.dm.device)  # fmt: skip
            planner = RankPlanner(step, self.dm, self.selective,
                                  rehearsal=self.rehearsal(batch, prof))  # fmt: skip
            self.seen[batch] = Probe(batch, (args, kwargs), prof, planner)
            self.progress.step(f"batch {batch}")
        return self.seen[batch]

    def without(self, batch: int) -> StepMemory:
        if batch not in self.plain:
            self.plain[batch] = self.probe(batch).planner.memory(None)
        return self.plain[batch]

    def candidate(self, batch: int) -> Candidate:
        probe = self.probe(batch)
        plan, memory = probe.planner.plan()
        chosen = plan if plan.modules else None
        prof = probe.profile
        out = prof[prof.tree.path].output_bytes
        return Candidate(batch, memory, self.without(batch), chosen,
                         step_seconds(prof, chosen), out)  # fmt: skip

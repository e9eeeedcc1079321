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

from autoremat.planning.plan import plan_from_profile, profile_lowest
from autoremat.training.optimizer_memory import OptimizerLike, optimizer_memory
from autoremat.training.per_rank import RankStep, plan_for_rank, rank_step_memory
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

    def step(self, batch: int) -> RankStep:
        probe = self.probe(batch)
        return RankStep(self.shadow, probe.inputs, probe.profile, self.sharding, self.optimizer,
                        self.loss_fn, self.autocast)  # fmt: skip

    def probe(self, batch: int) -> Probe:
        if batch not in self.seen:
            args, kwargs = self.meta_inputs(batch)
            prof = self.profile(batch, args, kwargs)
            low = profile_lowest(prof, selective=self.selective)
            plan = plan_from_profile(self.model, prof, low, selective=self.selective)
            step = RankStep(self.shadow, (args, kwargs), prof, self.sharding, self.optimizer,
                            self.loss_fn, self.autocast)  # fmt: skip
            memory = rank_step_memory(step, plan, self.dm)
            self.seen[batch] = Probe(batch, (args, kwargs), prof, memory, plan)
            self.progress.step(f"batch {batch}")
        return self.seen[batch]

    def without(self, batch: int) -> StepMemory:
        if batch not in self.plain:
            self.plain[batch] = rank_step_memory(self.step(batch), None, self.dm)
        return self.plain[batch]

    def candidate(self, batch: int) -> Candidate:
        step, probe = self.step(batch), self.probe(batch)
        assert probe.lowest_plan is not None  # (a rank's probe always plans its lowest)
        known = (self.without(batch), probe.lowest_plan, probe.lowest)  # (emulated once each)
        plan, memory = plan_for_rank(step, self.dm, self.selective, known=known)
        chosen = plan if plan.modules else None
        out = step.prof[step.prof.tree.path].output_bytes
        return Candidate(batch, memory, self.without(batch), chosen,
                         step_seconds(step.prof, chosen), out)  # fmt: skip

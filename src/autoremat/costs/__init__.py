"""What recompute would cost: recording a step, the cost model, the profile.

``recording`` runs one training step and records it; ``timeline`` places every module on the
step's memory timeline; ``model`` derives what recomputing each module frees, holds and peaks
at; ``timing`` times the ops and a recompute's per-op overheads; ``profiles`` assembles them into
a :class:`Profile`. Nothing here imports the solver or the wrap.
"""

from autoremat.costs.profiles import NodeCost, Profile, WayCost, profile
from autoremat.costs.timing import DEFAULT_OVERHEADS, overheads

__all__ = ["DEFAULT_OVERHEADS", "NodeCost", "Profile", "WayCost", "overheads", "profile"]

"""autoremat: choose which submodules of a PyTorch model to recompute in backward, apply it,
and show what it saved.

The pipeline is ``model -> tree -> plan -> wrapped model``::

    tree = autoremat.build_tree(model, args, kwargs)   # the modules that ran, with their I/O
    plan = autoremat.plan(model, args, kwargs, segments=3)
    plan.apply(model)                                  # wraps plan.modules in place
    autoremat.remove(model)                            # gives the original model back
    autoremat.measure(model, args, kwargs)             # peak, saved, FLOPs, seconds of a step
    autoremat.profile(model, args, kwargs)             # per-module costs on the tree
"""

from autoremat.distributed import broadcast_plan
from autoremat.measure import Measurement, default_loss, measure
from autoremat.memory import LiveMemory
from autoremat.plan import Plan, plan
from autoremat.profile import NodeCost, Profile, profile
from autoremat.tree import ExampleInputsError, Node, TensorInfo, build_tree
from autoremat.wrap import remove, wrapped_paths

__all__ = [
    "ExampleInputsError",
    "LiveMemory",
    "Measurement",
    "Node",
    "NodeCost",
    "Plan",
    "Profile",
    "TensorInfo",
    "broadcast_plan",
    "build_tree",
    "default_loss",
    "measure",
    "plan",
    "profile",
    "remove",
    "wrapped_paths",
]
__version__ = "0.1.0"

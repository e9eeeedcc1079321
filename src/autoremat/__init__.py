"""autoremat: choose which submodules of a PyTorch model to recompute in backward, apply it,
and show what it saved.

The pipeline is ``model -> tree -> profile -> plan -> wrapped model``::

    tree = autoremat.build_tree(model, args, kwargs)   # the modules that ran, with their I/O
    plan = autoremat.plan(model, args, kwargs, budget="50%")   # or segments=3
    plan.apply(model)                                  # wraps plan.modules in place
    autoremat.remove(model)                            # gives the original model back
    autoremat.measure(model, args, kwargs)             # peak, saved, FLOPs, seconds of a step
    autoremat.profile(model, args, kwargs)             # per-module costs on the tree
    autoremat.fit(model, make_inputs, device_memory="24GiB")   # the largest batch that fits

Where things live: ``tree`` (claim 1), ``costs/`` (recording a step and the cost model),
``solver`` and ``planning_tree`` (the budget solver and its input), ``strategies/`` (one file
per strategy), ``plans`` (the Plan and its JSON), ``planner`` (``plan()``), ``wrap`` (claim 4)
and ``replay`` (what a recompute sees), ``measurement`` (``measure()``), ``compiled``
(``torch.compile``d models).
"""

from autoremat.batch_inputs import scale_batch
from autoremat.compile_plan import plan_for_compile
from autoremat.costs import NodeCost, Profile, WayCost, profile
from autoremat.device_fit import Fit, fit, plan_for_device
from autoremat.distributed import broadcast_plan
from autoremat.measurement import Measurement, measure
from autoremat.memory import LiveMemory
from autoremat.planner import lowest_budget, plan
from autoremat.plans import Choice, Plan
from autoremat.replay import is_recomputing
from autoremat.step import default_loss
from autoremat.strategies.budget import BudgetTooLow
from autoremat.training_memory import TrainingMeasurement, measure_training
from autoremat.tree import ExampleInputsError, Node, TensorInfo, build_tree
from autoremat.whole_step import StepMemory, predict_training
from autoremat.wrap import remove, wrapped_paths

__all__ = [
    "BudgetTooLow",
    "Choice",
    "ExampleInputsError",
    "Fit",
    "LiveMemory",
    "Measurement",
    "Node",
    "NodeCost",
    "Plan",
    "Profile",
    "StepMemory",
    "TensorInfo",
    "TrainingMeasurement",
    "WayCost",
    "broadcast_plan",
    "build_tree",
    "default_loss",
    "fit",
    "is_recomputing",
    "lowest_budget",
    "measure",
    "measure_training",
    "plan",
    "plan_for_compile",
    "plan_for_device",
    "predict_training",
    "profile",
    "remove",
    "scale_batch",
    "wrapped_paths",
]
__version__ = "0.1.0"

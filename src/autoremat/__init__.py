"""autoremat: choose which submodules of a PyTorch model to recompute in backward, apply it,
and show what it saved.

The pipeline is ``model -> tree -> profile -> plan -> wrapped model``::

    tree = autoremat.build_tree(model, args, kwargs)   # the modules that ran, with their I/O
    plan = autoremat.plan(model, args, kwargs, budget="50%")   # or segments=3
    plan.apply(model)                                  # wraps plan.modules in place
    autoremat.remove(model)                            # gives the original model back
    autoremat.measure(model, args, kwargs)             # peak, held, FLOPs, seconds of a step
    autoremat.profile(model, args, kwargs)             # per-module costs on the tree
    autoremat.fit(model, make_inputs, device_memory="24GiB")   # the largest batch that fits

Where things live: the package's folders are the pipeline's stages, in the order data flows
(each imports only from those before it): ``core`` (shared helpers), ``record`` (running the
model and watching it: the tree of claim 1, the recorded step, ``measure()``), ``costs`` (the
cost model, ``profile()``), ``wrap`` (claim 4), ``planning`` (the solver, the strategies, the
Plan, ``plan()``), ``training`` (the whole step's memory, ``fit()``), ``comparison``,
``examples``, ``cli``. ``docs/architecture.md`` maps every file.
"""

from autoremat.core.measuring import is_measuring
from autoremat.costs.profile import NodeCost, Profile, WayCost, profile
from autoremat.planning.broadcast_plan import broadcast_plan
from autoremat.planning.choice import Choice
from autoremat.planning.plan import lowest_budget, plan
from autoremat.planning.plan_for_compile import plan_for_compile
from autoremat.planning.plans import Plan
from autoremat.planning.strategies.budget import BudgetTooLow
from autoremat.record.measure import Measurement, measure
from autoremat.record.memory import LiveMemory
from autoremat.record.step import default_loss
from autoremat.record.tree import ExampleInputsError, Node, TensorInfo, build_tree
from autoremat.training.fit import Fit, fit
from autoremat.training.measure_training import TrainingMeasurement, measure_training
from autoremat.training.plan_for_device import plan_for_device
from autoremat.training.predict_training import predict_training
from autoremat.training.scale_batch import scale_batch
from autoremat.training.sharding import Sharding
from autoremat.training.step_memory import StepMemory
from autoremat.wrap.checkpointed import wrapped_paths
from autoremat.wrap.replay import is_recomputing
from autoremat.wrap.wrapping import remove

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
    "Sharding",
    "StepMemory",
    "TensorInfo",
    "TrainingMeasurement",
    "WayCost",
    "broadcast_plan",
    "build_tree",
    "default_loss",
    "fit",
    "is_measuring",
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

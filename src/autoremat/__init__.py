"""autoremat: choose which submodules of a PyTorch model to recompute in backward, apply it,
and show what it saved.

The pipeline is ``model -> tree -> profile -> plan -> wrapped model``::

    plan = autoremat.plan(model, args, kwargs, budget="50%")   # or device_memory="24GiB"
    plan.apply(model)                                  # wraps plan.modules in place
    autoremat.remove(model)                            # gives the original model back
    autoremat.fit(model, make_inputs, device_memory="24GiB")   # the largest batch that fits
    autoremat.predict_memory(model, args, kwargs, plan=plan)   # the whole step's memory
    autoremat.measure_memory(model, args, kwargs)      # ... measured around optimizer steps
    autoremat.measure(model, args, kwargs)             # peak, held, FLOPs, seconds of a step
    autoremat.build_tree(model, args, kwargs)          # the modules that ran, with their I/O
    autoremat.plot(plan, "step.html", model, args, kwargs)     # the step's memory, drawn

``__all__`` holds what users call, construct or catch; the records those return (``Fit``,
``Measurement``, ``StepMemory``, ``MemoryMeasurement``, ``Node``, ``Profile``, ...) are
importable from their modules. Where things live: the package's folders are the pipeline's
stages, in the order data flows (each imports only from those before it): ``core`` (shared
helpers), ``record`` (running the model and watching it: the tree of claim 1, the recorded
step, ``measure()``), ``costs`` (the cost model, ``profile()``), ``wrap`` (claim 4),
``planning`` (the solver, the strategies, the Plan), ``training`` (the whole step's memory,
``plan()``, ``fit()``), ``picture`` (the step's memory drawn), ``comparison``, ``examples``,
``cli``. ``docs/architecture.md`` maps
every file.
"""

from autoremat.core.measuring import is_measuring
from autoremat.costs.profile import profile
from autoremat.picture.draw import plot
from autoremat.planning.broadcast_plan import broadcast_plan
from autoremat.planning.plan import lowest_budget
from autoremat.planning.plans import Plan
from autoremat.planning.strategies.budget import BudgetTooLow
from autoremat.record.measure import measure
from autoremat.record.memory import LiveMemory
from autoremat.record.tree import ExampleInputsError, build_tree
from autoremat.training.fit import fit
from autoremat.training.measure_memory import measure_memory
from autoremat.training.plan import plan
from autoremat.training.predict_memory import predict_memory
from autoremat.training.scale_batch import scale_batch
from autoremat.training.sharding import Sharding
from autoremat.wrap.replay import is_recomputing
from autoremat.wrap.wrapping import remove

__all__ = [
    "BudgetTooLow",
    "ExampleInputsError",
    "LiveMemory",
    "Plan",
    "Sharding",
    "broadcast_plan",
    "build_tree",
    "fit",
    "is_measuring",
    "is_recomputing",
    "lowest_budget",
    "measure",
    "measure_memory",
    "plan",
    "plot",
    "predict_memory",
    "profile",
    "remove",
    "scale_batch",
]
__version__ = "0.1.0"

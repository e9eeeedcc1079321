"""The cost model: from a recorded step (:mod:`autoremat.record.recording`), what recomputing
each node would free, hold and peak at, and what it would cost.

:mod:`autoremat.costs.profile` says how its modules make a
:class:`~autoremat.costs.profile.Profile`. Nothing here imports the solver, the plan or the
wrap.
"""

"""The cost model: from a recorded step (:mod:`autoremat.record.recording`), what recomputing
each node would free, hold and peak at, and what it would cost.

``timeline`` places every node on the step's memory timeline; ``model`` derives what
recomputing each node frees, holds and peaks at (pure functions); ``profile`` records the
step, times its ops and assembles the figures into a :class:`~autoremat.costs.profile.Profile`
of :class:`~autoremat.costs.profile.NodeCost` objects. Nothing here imports the solver, the
plan or the wrap.
"""

"""The strategies, one file each: ``levels`` (the patented method, claims 2-3) and ``budget``
(the cheapest recompute whose predicted peak fits). Each file defines a ``STRATEGY``
(:class:`autoremat.planning.strategy.Strategy`); :data:`autoremat.planning.plan.STRATEGIES`
lists them."""

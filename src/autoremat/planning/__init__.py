"""Choosing what to recompute: the budget solver (pure) and its adapter from a profile, the
strategies, the :class:`~autoremat.planning.plans.Plan` and its JSON, ``plan()`` and the
plans checked under ``torch.compile``, and sending a plan to every rank."""

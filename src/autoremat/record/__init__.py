"""Running the model and watching it: the training step, leaving the model as found, the
memory trackers, the module tree (claim 1), what a recompute could not replay, the recorded
step and its op times, and ``measure()``."""

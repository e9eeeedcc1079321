"""The whole training step's memory and fitting a device: optimizer state, the device's own
memory, the step's parts predicted and measured around real optimizer steps, example inputs at
another batch size, and ``fit()``: the largest batch and its plan."""

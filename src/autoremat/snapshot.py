"""Leave a model exactly as it was found.

`build_tree`, `plan`, `measure` and `profile` run the user's model on example inputs. Running a
model has side effects a user does not expect from a planning call: BatchNorm moves its running
statistics, dropout consumes the global random state, and a backward pass fills ``.grad``.
:func:`preserved` undoes all of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

__all__ = ["preserved"]


@contextlib.contextmanager
def preserved(model: nn.Module, inputs: Sequence[torch.Tensor] = ()) -> Iterator[None]:
    """Run the body, then restore ``model`` to the state it had on entry.

    Restored: the values of every buffer (in place, so tensor identities are kept), every
    parameter's ``.grad`` and each of ``inputs``' ``.grad`` (the same tensor object, or
    ``None``), each submodule's ``training`` flag, and the global CPU (and, when initialised,
    CUDA) random number generator state. Parameters are not copied (a forward and backward pass
    does not write to them); buffers on the ``meta`` device have no values and are left alone.
    Also restored when the body raises.
    """
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    modes = [(m, m.training) for m in model.modules()]
    grads = [(p, p.grad) for p in [*model.parameters(), *inputs]]
    values = [(t, t.detach().clone()) for t in model.buffers() if t.device.type != "meta"]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, saved in values:
                # batch_norm updates running statistics without bumping the version counter,
                # so compare values rather than versions.
                if not torch.equal(t, saved):
                    t.copy_(saved)
        for p, g in grads:
            p.grad = g
        for m, mode in modes:
            m.training = mode
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

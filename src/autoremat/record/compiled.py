"""Models compiled by ``torch.compile``: how to tell, and how to run one under a dispatch mode.

In torch 2.13 one call of a compiled model under a ``TorchDispatchMode`` leaves it running
eagerly for good (pytorch#190286; docs/guide.md, "Under torch.compile"), so whatever autoremat
runs under a dispatch mode (profiling a step, counting FLOPs) runs a compiled model under
:func:`running_eagerly`, leaving its compiled code intact.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["is_compiled", "running_eagerly"]


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` is, or holds, a module compiled by ``torch.compile`` (an
    ``OptimizedModule``, or a module compiled in place by ``Module.compile()``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return any(
        isinstance(m, OptimizedModule) or m.__dict__.get("_compiled_call_impl") is not None
        for m in model.modules()
    )


@contextlib.contextmanager
def running_eagerly(model: nn.Module) -> Iterator[None]:
    """Inside, a compiled ``model`` runs eagerly and dispatch modes cannot make dynamo skip
    its code for good; a model that is not compiled is untouched. torch's warning that a
    compiled module runs with global module hooks (``FlopCounterMode`` registers some) is
    silenced meanwhile: those hooks are autoremat's own, for that one run."""
    if not is_compiled(model):
        yield
        return
    with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there")
        yield

"""The class a module had before autoremat (or FSDP2) swapped it for a subclass.

:func:`autoremat.wrap.apply` changes a module's class to ``Checkpointed<Class>``, a subclass
that records its base in the class attribute :data:`BASE_ATTR`; ``fully_shard`` changes it to
``FSDP<Class>``. Everything that must see through those swaps (the plan's structure
fingerprint, the tree's type names, the profile's refusal of wrapped models) asks here, so that
none of it needs to import the wrap.
"""

from __future__ import annotations

from torch import nn

_FSDP_MODULE: type | None
try:
    from torch.distributed.fsdp import FSDPModule

    _FSDP_MODULE = FSDPModule
except ImportError:  # torch built without distributed support
    _FSDP_MODULE = None

__all__ = ["BASE_ATTR", "is_wrapped", "own_class"]

# The class attribute of a class autoremat made: the module's own class.
BASE_ATTR = "_autoremat_base"


def own_class(module: nn.Module) -> type:
    """The module's class before autoremat or FSDP2 (``fully_shard``) swapped it for a
    subclass of their own (``CheckpointedBlock``, ``FSDPBlock``, in any order)."""
    cls = type(module)
    while True:
        if BASE_ATTR in cls.__dict__:
            cls = cls.__dict__[BASE_ATTR]
        elif _FSDP_MODULE is not None and _FSDP_MODULE in cls.__bases__ and len(cls.__bases__) == 2:
            cls = next(b for b in cls.__bases__ if b is not _FSDP_MODULE)
        else:
            return cls


def is_wrapped(module: nn.Module) -> bool:
    """Whether autoremat wrapped ``module`` (its class, or a class above it, is one autoremat
    made)."""
    return any(BASE_ATTR in cls.__dict__ for cls in type(module).__mro__)

"""The class a module had before autoremat (or FSDP2) swapped it for a subclass, and the module
as it was before autoremat, for pickling.

:func:`autoremat.wrap.apply` changes a module's class to ``Checkpointed<Class>``, a subclass
that records its base in the class attribute :data:`BASE_ATTR`; ``fully_shard`` changes it to
``FSDP<Class>``. Everything that must see through those swaps (the plan's structure
fingerprint, the tree's type names, the profile's refusal of wrapped models) asks here, so that
none of it needs to import the wrap.

autoremat also leaves instance attributes named ``_autoremat_...`` (:data:`ATTR_PREFIX`) on the
modules it wraps, and hooks (:class:`Hook` objects) on Hugging Face models. A pickle of such a
module (``pickle``, ``torch.save``) is made by :func:`reduce_as_plain` from the module as it was
before: its own class, without those attributes and hooks, so that it loads where autoremat was
never imported. A copy (``copy.copy``, ``copy.deepcopy``) keeps them (:func:`copy_as_is`,
:func:`deepcopy_as_is`): the copy is wrapped as the original is. The wrapped classes take these
as their ``__reduce_ex__``, ``__copy__`` and ``__deepcopy__``; a module autoremat hooked but
did not wrap gets them on the instance (:func:`pickle_as_plain`).
"""

from __future__ import annotations

import copy
import copyreg
import sys
import types
from typing import Any

from torch import nn

__all__ = [
    "ATTR_PREFIX",
    "BASE_ATTR",
    "SWITCHED_OFF_ATTR",
    "Hook",
    "copy_as_is",
    "deepcopy_as_is",
    "is_wrapped",
    "own_class",
    "pickle_as_plain",
    "plain_class",
    "plain_state",
    "reduce_as_plain",
    "stop_pickling_as_plain",
]

# The class attribute of a class autoremat made: the module's own class.
BASE_ATTR = "_autoremat_base"
# The start of the name of every instance attribute autoremat sets on a module.
ATTR_PREFIX = "_autoremat_"
# The instance attribute of a module whose own checkpointing the wrap switched off: the
# switches' names (autoremat.core.own_checkpointing), on again in a pickle and after remove.
SWITCHED_OFF_ATTR = f"{ATTR_PREFIX}switched_off"
# What pickle_as_plain puts on a module instance.
_INSTANCE_METHODS = ("__reduce_ex__", "__deepcopy__")


class Hook:
    """Base of the hook objects autoremat registers on a module (the ``use_cache=False``
    pre-hook of :mod:`autoremat.core.huggingface`): :func:`plain_state` leaves them out."""

    __slots__ = ()


def own_class(module: nn.Module) -> type:
    """The module's class before autoremat or FSDP2 (``fully_shard``) swapped it for a
    subclass of their own (``CheckpointedBlock``, ``FSDPBlock``, in any order)."""
    cls = type(module)
    fsdp = _fsdp_module()
    while True:
        if BASE_ATTR in cls.__dict__:
            cls = cls.__dict__[BASE_ATTR]
        elif fsdp is not None and fsdp in cls.__bases__ and len(cls.__bases__) == 2:
            cls = next(b for b in cls.__bases__ if b is not fsdp)
        else:
            return cls


def _fsdp_module() -> type | None:
    """FSDP2's ``FSDPModule``, or ``None`` while ``torch.distributed.fsdp`` is not imported (no
    module can be FSDP2's before it is; importing it here would cost every user 0.7 s)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None)


def is_wrapped(module: nn.Module) -> bool:
    """Whether autoremat wrapped ``module`` (its class, or a class above it, is one autoremat
    made)."""
    return any(BASE_ATTR in cls.__dict__ for cls in type(module).__mro__)


def plain_class(module: nn.Module) -> type:
    """The module's class without autoremat's: the class autoremat swapped out when the
    module's class is one autoremat made, else the module's class (also when another class
    was swapped in on top of autoremat's, as ``fully_shard`` does: that one is kept)."""
    cls = type(module)
    base: type = cls.__dict__.get(BASE_ATTR, cls)
    return base


def plain_state(module: nn.Module) -> Any:
    """The module's ``__getstate__()`` (its class's) without what autoremat added: instance
    attributes named ``_autoremat_...`` (and its own checkpointing switched on again where the
    wrap switched it off), the methods :func:`pickle_as_plain` set, and
    :class:`Hook` objects in its hook dictionaries (with their entries in the dictionaries
    that share their ids, such as ``_forward_pre_hooks_with_kwargs``). The module is not
    changed; changed dictionaries are copies. A state that is not a dict is returned as is."""
    state = type(module).__getstate__(module)
    if not isinstance(state, dict):
        return state
    switches = state.get(SWITCHED_OFF_ATTR, ())
    state = {
        k: v
        for k, v in state.items()
        if not k.startswith(ATTR_PREFIX) and k not in _INSTANCE_METHODS
    }
    state.update(dict.fromkeys(switches, True))  # its own checkpointing, as it was
    hook_dicts = [k for k, v in state.items() if "hooks" in k and isinstance(v, dict)]
    ours = {i for k in hook_dicts for i, h in state[k].items() if isinstance(h, Hook)}
    for k in hook_dicts:
        if ours & state[k].keys():
            state[k] = type(state[k])((i, h) for i, h in state[k].items() if i not in ours)
    return state


def reduce_as_plain(module: nn.Module, protocol: Any = 2) -> tuple[Any, ...]:
    """``__reduce_ex__`` for a module autoremat changed: it pickles as :func:`plain_class`
    with :func:`plain_state`, as the module pickled before autoremat changed it, so the
    pickle names neither autoremat's classes nor its functions. Loading it gives the plain
    module (to wrap it again, apply the plan to it).

    A module of its own class pickles as Python pickles any object (``copyreg.__newobj__``);
    a wrapped one through ``copyreg._reconstructor`` (what pickle protocols 0 and 1 use for
    every object: ``object.__new__(cls)``), since pickle refuses ``__newobj__`` with another
    class than the object's."""
    cls = plain_class(module)
    state = plain_state(module)
    if cls is type(module) and int(protocol) >= 2:
        return (copyreg.__newobj__, (cls,), state, None, None)  # type: ignore[attr-defined]
    return (copyreg._reconstructor, (cls, object, None), state)  # type: ignore[attr-defined]


def copy_as_is(module: nn.Module) -> nn.Module:
    """``__copy__`` for a module autoremat changed: a shallow copy as Python makes one (same
    class, a copy of ``__dict__`` sharing its values), autoremat's attributes and hooks
    included; the methods :func:`pickle_as_plain` set are made the copy's own."""
    cls = type(module)
    new = cls.__new__(cls)
    state = cls.__getstate__(module)
    if isinstance(state, dict):
        state = dict(state)
        for name in _INSTANCE_METHODS:
            if isinstance(state.get(name), types.MethodType):
                state[name] = types.MethodType(state[name].__func__, new)
    new.__setstate__(state)
    return new


def deepcopy_as_is(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``__deepcopy__`` for a module autoremat changed: a deep copy as Python makes one (same
    class, ``__getstate__()`` deep-copied), autoremat's attributes and hooks included, so the
    copy is wrapped and hooked as the original (and :func:`autoremat.wrap.remove` undoes both
    on it)."""
    cls = type(module)
    new = cls.__new__(cls)
    memo[id(module)] = new
    new.__setstate__(copy.deepcopy(cls.__getstate__(module), memo))
    return new


def pickle_as_plain(module: nn.Module) -> None:
    """Make ``module`` pickle with :func:`reduce_as_plain` and deep-copy with
    :func:`deepcopy_as_is`, through methods set on the instance (``pickle``, ``copy`` and
    ``torch.save`` look them up there first): for a module whose class autoremat did not
    change but that holds one of its hooks. :func:`stop_pickling_as_plain` undoes it.

    ``copy.copy`` looks ``__copy__`` up on the class only, so a shallow copy of such a module
    is made by :func:`reduce_as_plain`: without autoremat's hooks."""
    module.__dict__["__reduce_ex__"] = types.MethodType(reduce_as_plain, module)
    module.__dict__["__deepcopy__"] = types.MethodType(_deepcopy_instance, module)


def _deepcopy_instance(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """The ``__deepcopy__`` :func:`pickle_as_plain` sets: :func:`deepcopy_as_is`, unless the
    module's class has a ``__deepcopy__`` of its own (a wrapped class's, or one a library put
    there to refuse copies), which then decides."""
    own = getattr(type(module), "__deepcopy__", None)
    if own is not None:
        return own(module, memo)
    return deepcopy_as_is(module, memo)


def stop_pickling_as_plain(module: nn.Module) -> None:
    """Undo :func:`pickle_as_plain` (a no-op on a module it was not called on)."""
    for name in _INSTANCE_METHODS:
        module.__dict__.pop(name, None)

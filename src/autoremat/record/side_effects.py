"""What a recompute cannot replay, found on the forward that builds the module tree.

What is found, why a recompute cannot replay it and which modules are left out for it:
docs/guide.md, "What planning leaves out" (what the wrap does replay: "What a recompute
sees"). :class:`ReplayCheck` holds module hooks that :func:`autoremat.record.tree.build_tree`
calls on every module call of the forward it runs. It compares:

* **Python state** (:attr:`ReplayCheck.replay`). The Python attributes of the called module
  *and of every module inside it* (their ``__dict__``, less torch's own entries: parameters,
  buffers, submodules, the hook dicts; ``training`` is kept) when the call began, against
  the same when the whole forward has ended, which is what a recompute in backward would
  see. Numbers, strings and other plain values compare by value; lists, tuples, dicts, sets
  and deques by type, length and items; tensors by identity and version counter (an
  in-place update of a plain tensor attribute, which is no buffer the wrap restores); random
  generators (``torch.Generator``, ``random.Random``, NumPy's) by state; other objects by
  identity and their own attributes, one object deep.
* **Inputs changed in place** (:attr:`ReplayCheck.inplace`). The version counter of every
  tensor among the call's arguments (:func:`autoremat.core.nested.iter_tensors`; inference
  tensors have none and are skipped) when the call began, against its value when the call
  returned, when its caller's call returned and when the forward ended. An output the caller
  changes in place is found through the input it is (or is a view of: views share their
  base's version counter); a tensor that is also an outer module's input, by that module's
  own check.

Cost, beyond docs/guide.md, "What planning leaves out": no tensor is read. Attributes are
flattened to at most :data:`MAX_TOKENS` items, :data:`MAX_CONTAINER_DEPTH` containers deep:
the quick look reads each module's ``__dict__`` about three times, the detailed one, per call,
that of every module inside the called one (about the number of modules times the depth of
the tree). Each tensor argument costs two weak references and a few reads of its version
counter, and is held (not copied) until its caller's call returns, or longer while it is that
call's own argument or output.

Not seen, besides that section's list: files, objects deeper than :data:`MAX_CONTAINER_DEPTH`
containers, items past :data:`MAX_TOKENS`; an argument changed in place, once its caller has
returned, through an alias that shares its version counter but is no view of it
(``detach()``) while the argument itself is gone; a forward that changes attributes of a
module outside its own subtree is found for the module around both, not for itself.
"""

from __future__ import annotations

import collections
import enum
import functools
import itertools
import numbers
import types
import weakref
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from autoremat.core.classes import ATTR_PREFIX
from autoremat.core.host_rng import generator_state
from autoremat.core.nested import iter_tensors, storage_key, version_of

__all__ = ["MAX_CONTAINER_DEPTH", "MAX_TOKENS", "ReplayCheck", "module_state"]

# Items of one attribute's value compared, at most (a longer list is compared by its length
# and first items); and how many containers or objects deep its value is entered.
MAX_TOKENS = 256
MAX_CONTAINER_DEPTH = 3

# torch's own entries ('training' stays: a forward that flips it changes what a recompute does)
_TORCH_ENTRIES = frozenset(nn.Module().__dict__) - {"training"}
_TORCH_PREFIXES = ("_forward", "_backward", "_state_dict", "_load_state_dict", ATTR_PREFIX)
_BY_VALUE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device,
             torch.layout, torch.memory_format, enum.Enum, type, slice, range)  # fmt: skip
_PLAIN = frozenset({int, bool, str, type(None)})  # the usual attribute values, fast
_ATTR = "attr"  # marks an object's attribute among the items: (_ATTR, name)
_PARAMETER = "parameter "  # names a parameter among a module's state (written in place)
_CONTAINERS = (list, tuple, dict, set, frozenset, collections.deque)
# objects compared by identity only: their attributes are code or torch's, not state
_OPAQUE = (nn.Module, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType, functools.partial, torch.Tensor)  # fmt: skip


class _Ref:
    """An object compared by identity (and, for a tensor, its version counter); weakly held
    where the object allows it (a dead one compares unequal to anything)."""

    __slots__ = ("ref", "strong", "version")

    def __init__(self, obj: Any, version: int | None = None) -> None:
        try:
            self.ref: Any = weakref.ref(obj)
            self.strong: Any = None
        except TypeError:
            self.ref, self.strong = None, obj
        self.version = version

    def target(self) -> Any:
        return self.strong if self.ref is None else self.ref()

    def __eq__(self, other: object) -> bool:  # (and so unhashable)
        mine = self.target()
        return (isinstance(other, _Ref) and mine is not None and mine is other.target()
                and self.version == other.version)  # fmt: skip


def _plain(value: Any) -> Any:
    """A random generator's state (dicts, tuples, ints, arrays) as a comparable value."""
    if isinstance(value, dict):
        return tuple((k, _plain(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "tobytes"):  # a NumPy array
        return value.tobytes()
    return value


def _generator_state(value: Any) -> Any:
    """The state of a random generator (:func:`autoremat.core.host_rng.generator_state`) as a
    comparable value, or ``None`` for anything else."""
    state = generator_state(value)
    return tuple(state.tolist()) if isinstance(state, torch.Tensor) else _plain(state)


_KINDS: dict[type, str] = {}  # a value's type -> how it is flattened


def _kind(value: Any) -> str:
    """How :class:`_Flattener` flattens ``value``, decided once per type, not per value (an
    ``isinstance`` against ``numbers.Number`` reads the object's ``__class__``, through a
    Hugging Face config's own ``__getattribute__``: 12% of the Python calls of an 80-layer
    Llama's tree); each time for a proxy, whose ``__class__`` is not its type."""
    kind = _KINDS.get(type(value))
    if kind is None:
        known = object.__getattribute__(value, "__class__") is type(value)  # (not a proxy)
        kind = (
            "float" if isinstance(value, float)
            else "value" if isinstance(value, (*_BY_VALUE, numbers.Number))
            else "tensor" if isinstance(value, torch.Tensor)
            else "container" if isinstance(value, _CONTAINERS)
            else "object"
        )  # fmt: skip
        if known:
            _KINDS[type(value)] = kind
    return kind


class _Flattener:
    """Flattens attribute values into comparable items, an object's attributes once per
    moment; with ``objects=False``, objects other than random generators by identity only."""

    def __init__(self, objects: bool = True) -> None:
        self.memo: dict[int, list[Any]] = {}
        self.objects = objects

    def items(self, value: Any) -> list[Any]:
        if type(value) in _PLAIN:
            return [(type(value), value)]
        out: list[Any] = []
        try:
            self._add(value, out, MAX_CONTAINER_DEPTH)
        except Exception:  # an object that cannot be looked into: compare by identity
            out = [_Ref(value)]
        return out[: MAX_TOKENS + 1]

    def _add(self, value: Any, out: list[Any], depth: int) -> None:
        if len(out) >= MAX_TOKENS:
            if len(out) == MAX_TOKENS:
                out.append(("...",))
            return
        kind = _kind(value)
        if kind == "float":
            out.append((float, value.hex()))
        elif kind == "value":
            out.append((type(value), value))
        elif kind == "tensor":
            out.append(_Ref(value, version_of(value)))
        elif kind == "container":
            out.append((type(value), len(value)))
            if depth:
                items = value.items() if isinstance(value, dict) else ((v,) for v in value)
                for part in itertools.chain.from_iterable(items):
                    if len(out) > MAX_TOKENS:
                        break
                    self._add(part, out, depth - 1)
        else:
            self._object(value, out, depth)

    def _object(self, value: Any, out: list[Any], depth: int) -> None:
        state = _generator_state(value)
        if state is not None:
            out.append((type(value), state))
            return
        out.append(_Ref(value))
        if not (depth and self.objects) or isinstance(value, _OPAQUE):
            return
        try:
            attrs = object.__getattribute__(value, "__dict__")
        except AttributeError:  # no instance attributes (slots, a C type)
            return
        if not isinstance(attrs, dict):
            return
        if id(value) not in self.memo:
            inner: list[Any] = []
            for name, v in attrs.items():
                inner.append((_ATTR, name))
                self._add(v, inner, min(depth, 1) - 1)
            self.memo[id(value)] = inner
        out.extend(self.memo[id(value)])


State = dict[str, list[Any]]


def module_state(module: nn.Module, flat: _Flattener | None = None) -> State:
    """The Python attributes of ``module`` (its ``__dict__`` less torch's own entries and
    autoremat's), by name, each flattened into comparable items (module docstring); and its
    own parameters, by identity and version counter (named :data:`_PARAMETER` + name)."""
    attrs = module.__dict__
    names = attrs.keys() - _TORCH_ENTRIES  # (never empty: "training" is there)
    flat = _Flattener() if flat is None else flat
    state = {n: flat.items(attrs[n]) for n in sorted(names) if not n.startswith(_TORCH_PREFIXES)}
    params = module._parameters.items()
    return state | {_PARAMETER + n: [_Ref(p, version_of(p))] for n, p in params if p is not None}


def _norm_hooks_set(module: nn.Module) -> set[str]:
    """The attributes torch's hook-based ``spectral_norm`` and ``weight_norm`` set as each call
    of ``module`` begins, from its parameters and buffers, never from their last value: a
    recompute around it sets them again as its forward did (the buffers replayed)."""
    hooks = module._forward_pre_hooks.values()
    return {h.name for h in hooks if isinstance(h, (SpectralNorm, WeightNorm))}


def _buffer_marks(module: nn.Module) -> dict[str, tuple[int, int | None]]:
    """The buffers of ``module`` and the modules inside it, by name: identity and version."""
    return {n: (id(b), version_of(b)) for n, b in module.named_buffers() if b is not None}


def _named(name: str) -> str:
    """An attribute of :func:`module_state` as a message names it."""
    plain = name.removeprefix(_PARAMETER)
    return f"parameter {plain!r}" if plain != name else f"Python attribute {name!r}"


def _changed(before: State, after: State, skip: Collection[str] = ()) -> str | None:
    """The first attribute whose value differs (``config.problem_type`` for an attribute of
    an object held in ``config``), or ``None``; attributes in ``skip`` are not looked at."""
    for name in {**before, **after}:  # (before's order, then the names new in after)
        items, other = before.get(name), after.get(name)
        if name in skip or items == other:  # (the usual case, compared in C)
            continue
        if items is None or other is None:
            return name
        pairs = enumerate(zip(items, other, strict=False))  # i: where they first differ
        i = next((i for i, (x, y) in pairs if x is not y and x != y), min(len(items), len(other)))
        marks = [t[1] for t in items[: i + 1] if type(t) is tuple and t[:1] == (_ATTR,)]
        return f"{name}.{marks[-1]}" if marks else name
    return None


@dataclass
class _Input:
    """One tensor argument of a call (``owner``): where it sat, the tensor itself while its
    caller's call runs, then weak references to it and to its base (a view shares its base's
    version counter), its version when the call began, its storage."""

    owner: _Call
    where: str
    tensor: torch.Tensor | None
    ref: Any
    base: Any
    version: int
    storage: int | None

    def changed(self) -> bool:
        """Whether its version moved since the call began (never once neither it nor its
        base is alive: then nothing can change it any more)."""
        t = self.tensor if self.tensor is not None else self.ref()
        if t is None and self.base is not None:
            t = self.base()
        return t is not None and version_of(t) != self.version


@dataclass
class _Call:
    """One module call: the states of the modules inside it when it began, the module's own
    state when it returned, its tensor arguments, and those of the calls it made (``held``,
    checked and let go when it returns)."""

    module: nn.Module
    states: list[tuple[nn.Module, State]]
    objects: bool = True  # whether the states look into objects
    inputs: list[_Input] = field(default_factory=list)
    held: list[_Input] = field(default_factory=list)
    own_after: State | None = None
    aliases: dict[str, str] = field(default_factory=dict)  # input where -> output where
    own_start: State = field(default_factory=dict)  # its own, objects by identity
    # the buffers of the modules inside it (_buffer_marks) as it began and as it returned
    buffers_begun: dict[str, Any] = field(default_factory=dict)
    buffers_returned: dict[str, Any] = field(default_factory=dict)


def _inputs(call: _Call, args: Any, kwargs: Any) -> list[_Input]:
    found = []
    tensors = itertools.chain(iter_tensors(args, "args"), iter_tensors(kwargs, "kwargs"))
    for where, t in tensors:
        version = version_of(t)
        if version is not None:
            base = None if t._base is None else weakref.ref(t._base)
            found.append(_Input(call, where, t, weakref.ref(t), base, version, storage_key(t)))
    return found


class ReplayCheck:
    """The hooks of the check (module docstring): :meth:`enter` at every forward pre-hook,
    :meth:`leave` at every forward hook, :meth:`finish` once the forward has ended. Then
    :attr:`replay` and :attr:`inplace` map ``id(module)`` to the reason, which names the
    module paths of ``paths`` (``id(module) -> path``). A module's first reason is kept.

    With ``detailed=False``, a quicker first look: the outermost call's states cover every
    module inside it (so any change to the Python state of the model is seen), each other
    call's only its own module, objects by identity. It finds whether anything changed (a
    non-empty :attr:`replay`), not every module a change concerns: run a detailed check on
    another forward then (:func:`autoremat.record.tree.build_tree` does).

    A call's tensor arguments are held as the module docstring's "Cost" says, so that a caller
    that changes them in place and lets them go before the forward ends is seen."""

    def __init__(
        self, paths: dict[int, str], detailed: bool = True, previous: ReplayCheck | None = None
    ) -> None:
        self.paths = paths
        self.detailed = detailed
        self.previous = previous
        self.replay: dict[int, str] = {}
        self.inplace: dict[int, str] = {}
        self.calls: list[_Call] = []
        self.running: list[_Call] = []
        self.inside: dict[int, list[nn.Module]] = {}

    def enter(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        key = id(module)
        full = self.detailed or not self.running
        if full and key not in self.inside:
            self.inside[key] = list(module.modules())
        flat = _Flattener(objects=full)
        mods = self.inside[key] if full else [module]
        states = [(m, module_state(m, flat)) for m in mods]
        # its own attributes, objects by identity: an inner call's quick look has them already
        own = module_state(module, _Flattener(objects=False)) if full else states[0][1]
        call = _Call(module, states, objects=full, own_start=own)
        call.buffers_begun = _buffer_marks(module)
        call.inputs = _inputs(call, args, kwargs)
        if self.running:
            self.running[-1].held.extend(call.inputs)
        self.calls.append(call)
        self.running.append(call)

    def leave(self, module: nn.Module, out: Any) -> None:
        if not self.running or self.running[-1].module is not module:
            return  # a call whose pre-hook did not run (hooks added during the forward)
        call = self.running.pop()
        call.own_after = module_state(module, _Flattener(objects=call.objects))  # (as before)
        call.buffers_returned = _buffer_marks(module)
        outputs = {storage_key(t): w for w, t in iter_tensors(out, "out")}
        for arg in call.inputs:
            if arg.storage is not None and arg.storage in outputs:
                call.aliases[arg.where] = outputs[arg.storage]
            if arg.changed():
                self._flag(call, f"its forward changes its input {arg.where!r} in place")
        own = {arg.storage for arg in call.inputs} | set(outputs)
        for arg in call.held:  # the arguments of the calls it made, changed since?
            if arg.changed():
                self._after(arg)
            if arg.storage in own and self.running:
                self.running[-1].held.append(arg)  # its caller has it too
            else:
                arg.tensor = None

    def finish(self) -> None:
        """Compare every call's states and inputs with the end of the forward."""
        end: dict[tuple[int, bool], State] = {}
        marks: dict[int, dict[str, Any]] = {}  # each module's buffers now, found once
        flats = {True: _Flattener(), False: _Flattener(objects=False)}
        for call in self.calls:
            key = id(call.module)
            for m, before in call.states if key not in self.replay else ():
                at = (id(m), call.objects)
                if at not in end:
                    end[at] = module_state(m, flats[call.objects])
                name = _changed(before, end[at])
                if name is not None and m is not call.module:  # (set around it? _reset)
                    name = _changed(before, end[at], self._reset(m) | _norm_hooks_set(m))
                if name is not None:
                    self.replay[key] = self._state_reason(call, m, name)
                    break
            for arg in call.inputs:
                if arg.changed():
                    self._after(arg)
                arg.tensor = None
            if key not in marks:
                marks[key] = _buffer_marks(call.module)
            self._buffers_after(call, marks[key])

    def _buffers_after(self, call: _Call, now: dict[str, Any]) -> None:
        """Leave out a module with a buffer its call did not change but another module did after
        it (``now``: as the forward ended): the wrap replays only what its forward changed."""
        begun, returned = call.buffers_begun, call.buffers_returned
        moved = [n for n, mark in returned.items() if begun.get(n) == mark != now.get(n)]
        if moved and id(call.module) not in self.replay:
            self.replay[id(call.module)] = (
                f"its buffer {moved[0]!r} is changed after its call by another module's forward "
                f"(a recompute would read the changed value)"
            )

    def _reset(self, module: nn.Module) -> set[str]:
        """The attributes of ``module`` that something sets before each of its calls, to the
        same value on every forward: each call of it began with the same value of them here
        as on the forward before (``previous``), call by call, though they changed. A module
        around it that sets them so (RecurrentGemma's recurrent block, which resets its
        ``rg_lru.recurrent_states`` to ``None`` before calling it) replays them in its
        recompute; ``module`` itself, recomputed alone, would not: it is left out for them."""
        now = self._starts.get(id(module), [])
        then = [] if self.previous is None else self.previous._starts.get(id(module), [])
        if not now or len(now) != len(then):
            return set()
        names = set.intersection(*(set(s) for s in (*now, *then)))
        return {n for n in names if all(a[n] == b[n] for a, b in zip(now, then, strict=True))}

    @functools.cached_property
    def _starts(self) -> dict[int, list[State]]:
        """By module, the own attributes it had as each of its calls began (identity-level),
        gathered once the forward has ended."""
        starts: dict[int, list[State]] = {}
        for c in self.calls:
            starts.setdefault(id(c.module), []).append(c.own_start)
        return starts

    def _flag(self, call: _Call, what: str) -> None:
        self.inplace.setdefault(
            id(call.module),
            f"{what} (checkpoint keeps its inputs for the recompute, so backward would fail)",
        )

    def _after(self, arg: _Input) -> None:
        out = arg.owner.aliases.get(arg.where)
        if out is not None:
            what = f"its output {out!r} is its input {arg.where!r} or a view of it, and is"
        else:
            what = f"its input {arg.where!r} is"
        self._flag(arg.owner, f"{what} changed in place after it returns")

    def _state_reason(self, call: _Call, m: nn.Module, name: str) -> str:
        if m is not call.module:
            what = (
                f"the {_named(name)} of its submodule {self.paths.get(id(m), '?')!r} "
                f"changes during the forward"
            )
        elif call.own_after is None or _changed(call.states[0][1], call.own_after) is not None:
            what = f"its forward changes the {_named(name)}"
        else:
            what = f"its {_named(name)} is changed by another module's forward after its call"
        return f"{what} (a recompute would see the changed value)"

"""What a recompute must see as its forward saw it: one checkpointed call, from its forward to
its recomputes (claim 4's wrapper function, guarded).

``torch.utils.checkpoint`` replays torch's random number generators (CPU, and CUDA on the
devices of the positional tensor inputs) and nothing else. A recomputed module's forward may
read more, and :class:`CheckpointedCall` puts it back for each recompute, then puts the present
back:

* **Buffers** of the recomputed modules, as they were *before* the forward ran: an EMA
  normaliser or a QAT observer that updates a buffer and then reads it, the ``u``/``v`` vectors
  of spectral normalisation (hook-based or a parametrization), BatchNorm's statistics. The
  forward clones every buffer of its modules before it runs (a transient copy, the buffers'
  size) and keeps the pre-forward value of those it changed (by value, rebinding, shape or
  dtype, or registered/removed) until its last recompute: bytes held are those of the changed
  buffers (BatchNorm: 2 x channels floats). Each recompute runs with copies of those values and
  ends with the post-forward buffers back in place (the objects, so views and optimizer
  references stay valid), and any buffer the recompute changed in place is reset by value:
  statistics move once per step, as without recompute.
* **Autocast on** ``meta`` (:class:`~autoremat.record.autocast_meta.MetaAutocast`, a function
  mode checkpoint does not know): a recompute runs in a region of its own with the same
  casts, as checkpoint gives a real autocast's recompute.
* **Python's** ``random`` **and NumPy's global generator** (when NumPy is imported): set to
  their state at the forward's start for the recompute, then to their present state again, so
  a random-depth knob draws the same and the training loop's own draws are untouched; so are
  the **generators passed to the call** (a ``torch.Generator``, ``random.Random`` or NumPy
  generator among its arguments, not inside a container: the noise a forward draws from the
  generator its caller gives it).
* **Containers among the inputs**: the lists and dicts a call received (DenseNet's dense
  layers receive the list of features their block appends to after the call), as they were
  when it began: the checkpoint keeps copies made of their items then
  (:func:`containers_copied`), and the recompute gets those.
* **Inputs**: a tensor reachable from the inputs (a key/value cache object, keyword arguments)
  changed in place between the forward and the recompute raises a
  :class:`~torch.utils.checkpoint.CheckpointError` naming the module; so does a forward that
  changes its own positional input in place (checkpoint's backward would otherwise die with
  torch's "modified by an inplace operation", naming nothing), when the forward returns.

Python attributes a forward changes (a step counter) cannot be put back: the planner finds
such modules and leaves them out (:mod:`autoremat.record.side_effects`). Hooks inside a recomputed
module run again in the recompute; :func:`is_recomputing` tells a hook (or any code) that it
runs inside one, :func:`recomputing` which entry.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes as _no_dispatch_modes
from torch.utils.checkpoint import CheckpointError

from autoremat.core.host_rng import (
    HostRng,
    get_host_rng,
    passed_generators,
    set_generators,
    set_host_rng,
)
from autoremat.core.nested import iter_tensors, version_of
from autoremat.record.autocast_meta import MetaAutocast, meta_autocast_now

__all__ = ["CheckpointedCall", "containers_copied", "decided", "is_recomputing", "recomputing"]

_state = threading.local()


def is_recomputing() -> bool:
    """Whether the calling thread is inside an autoremat recompute (the second run of a
    recomputed module's forward, in backward). For hooks and counters that must run once per
    step: ``if not autoremat.is_recomputing(): self.calls += 1``."""
    return recomputing() is not None


def recomputing() -> str | None:
    """The plan entry the calling thread is recomputing (the innermost, when a recompute runs
    inside another): a module path, a call ``path@k`` or a run ``path[i:j]``; ``None`` outside
    any recompute."""
    entries = getattr(_state, "recomputing", None)
    return entries[-1] if entries else None


def decided(fresh: Any) -> Any:
    """``fresh()``, remembered by every checkpointed call running its forward; inside a
    recompute, what ``fresh()`` gave at the same moment of the forward instead (``fresh`` is
    not called). For choices made while a module runs that a recompute must repeat, in the
    same order: which calls of a module :mod:`autoremat.wrap.calls` recomputes."""
    frames: list[CheckpointedCall] = getattr(_state, "frames", [])
    replaying = next((f for f in reversed(frames) if f.replaying), None)
    if replaying is None:
        choice = fresh()
    else:
        choice = replaying.decisions[replaying.cursor]
        replaying.cursor += 1
    for f in frames:
        if not f.replaying:
            f.decisions.append(choice)
    return choice


Signature = list[tuple[str, int, tuple[int, ...], int | None]]
# (module, buffer name) -> the tensor there (None: a None buffer; the marker ``...``: no slot)
Buffers = dict[tuple[nn.Module, str], Any]
Values = dict[tuple[nn.Module, str], tuple[torch.Tensor, torch.Tensor]]


class CheckpointedCall:
    """One checkpointed call of ``owners`` (the recomputed module, or a run of siblings),
    labelled ``label`` (its plan entry) in errors. :meth:`run` is the checkpoint's function:
    its first call is the forward, later ones recomputes."""

    __slots__ = (
        "__weakref__",
        "autocast",
        "before",
        "cursor",
        "decisions",
        "first",
        "generators",
        "host_rng",
        "label",
        "owners",
        "positional",
        "replaying",
        "signature",
    )

    def __init__(self, label: str, owners: list[nn.Module]) -> None:
        self.label = label
        self.owners = owners
        self.first = True
        self.signature: Signature = []
        # its positional tensor inputs (weakly: the checkpoint holds them) and their versions
        self.positional: list[tuple[int, weakref.ref[torch.Tensor], int | None]] = []
        self.before: Buffers = {}  # pre-forward values of the buffers the forward changed
        self.host_rng: HostRng = (None, None)
        self.generators: list[tuple[Any, Any]] = []  # generators passed in, as forwarded
        self.decisions: list[Any] = []  # what decided() gave inside the forward, in order
        self.cursor = 0
        self.replaying = False
        self.autocast: MetaAutocast | None = None  # autocast's casts on meta, as forwarded

    def run(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)``: the forward on the first call, a guarded recompute after."""
        frames = _state.__dict__.setdefault("frames", [])
        frames.append(self)
        try:
            if self.first:
                return self._forward(fn, args, kwargs)
            self.replaying, self.cursor = True, 0
            return self._recompute(fn, args, kwargs)
        finally:
            self.replaying = False
            frames.pop()

    def _forward(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.first = False
        self.signature = _state_signature(args, kwargs)
        versions = _positional_versions(args)
        self.host_rng = get_host_rng()
        self.generators = passed_generators(args, kwargs)
        self.autocast = meta_autocast_now()
        objects = _buffers(self.owners)
        values = _values(objects)
        out = fn(*args, **kwargs)
        self.before = _changed(objects, values, _buffers(self.owners))
        changed = [i for i, t, v in versions if version_of(t) != v]
        if changed:
            what = "changed its own input ({where}) in place in its forward"
            fix = "make its forward work out of place (inplace=False)"
            raise CheckpointError(self._input_message(changed, what, fix))
        self.positional = [(i, weakref.ref(t), v) for i, t, v in versions]
        return out

    def check_inputs(self) -> None:
        """Raise a :class:`CheckpointError` naming the module if a positional input was changed
        in place after its forward returned (by the caller, directly or through an output that
        is that input or a view of it): checkpoint's own check, when it gives the input back
        for the recompute, names no module. Called as the module's backward begins."""
        changed = [
            i for i, ref, v in self.positional if (t := ref()) is not None and version_of(t) != v
        ]
        if changed:
            what = (
                "is recomputed in backward, but its input ({where}) was changed in place after "
                "its forward returned (by its caller, directly or through an output that is "
                "that input or a view of it)"
            )
            fix = "change a copy (out = out.clone()) instead of the tensor in place"
            raise CheckpointError(self._input_message(changed, what, fix))

    def _recompute(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        now = _state_signature(args, kwargs)
        if now != self.signature:
            raise CheckpointError(self._changed_message(now))
        after = _buffers(self.owners)
        values = _values(after)
        present_rng, present_generators = get_host_rng(), passed_generators(args, kwargs)
        _install({key: _copy(value) for key, value in self.before.items()})
        set_host_rng(self.host_rng)
        set_generators(self.generators)
        entries = _state.__dict__.setdefault("recomputing", [])
        entries.append(self.label)
        region = self.autocast.again() if self.autocast else contextlib.nullcontext()
        try:
            with region:
                return fn(*args, **kwargs)
        finally:
            entries.pop()
            set_host_rng(present_rng)
            set_generators(present_generators)
            _restore(self.owners, after)
            _reset_values(values)

    def _input_message(self, changed: list[int], what: str, fix: str) -> str:
        """A positional input changed in place (``what`` happened to it, ``{where}`` naming
        it): checkpoint's own error in backward would name no module."""
        path = self.label or "(root)"
        where = ", ".join(f"args[{i}]" for i in changed)
        return (
            f"autoremat: module {path!r} {what.format(where=where)}; checkpoint keeps that "
            f'input for the recompute, so backward would fail ("modified by an inplace '
            f'operation"). Fix: leave {path!r} out of the plan (autoremat.plan finds such '
            f"modules), or {fix}."
        )

    def _changed_message(self, now: Signature) -> str:
        before = {entry[0]: entry for entry in self.signature}
        after = {entry[0]: entry for entry in now}
        changed = [w for w in sorted(before.keys() | after.keys()) if before.get(w) != after.get(w)]
        path = self.label or "(root)"
        return (
            f"autoremat: module {path!r} is recomputed in backward, but its inputs "
            f"were changed in place after its forward ran ({', '.join(changed[:3])}); the "
            f"recompute would compute something else. Fix: do not change a recomputed module's "
            f"inputs in place (for a Hugging Face model, call it with use_cache=False and no "
            f"cache object), or leave {path!r} out of the plan."
        )


def containers_copied(value: Any, copies: dict[int, Any] | None = None) -> Any:
    """``value`` with every list and dict in it (of those exact types, through tuples, lists
    and dicts) a shallow copy as it is now, the same tensors in it (one copy of a container
    found twice). What a checkpoint keeps for the recompute: the caller's own list would keep
    alive everything the caller appends to it later (DenseNet's features) until the module's
    backward, and the recompute would see those too."""
    copies = {} if copies is None else copies
    if type(value) in (list, dict):
        if id(value) in copies:
            return copies[id(value)]
        copy: Any = [] if type(value) is list else {}
        copies[id(value)] = copy  # (before its items: a list that holds itself)
        if type(value) is list:
            copy.extend(containers_copied(v, copies) for v in value)
        else:
            copy.update((k, containers_copied(v, copies)) for k, v in value.items())
        return copy
    if type(value) is tuple:
        return tuple(containers_copied(v, copies) for v in value)
    return value


def _buffers(owners: list[nn.Module]) -> Buffers:
    """Every buffer slot of ``owners`` and their submodules, by (module, name)."""
    found: Buffers = {}
    for owner in owners:
        for m in owner.modules():
            for name, b in m._buffers.items():
                found[m, name] = b
    return found


def _iter_real(buffers: Buffers) -> Iterator[tuple[tuple[nn.Module, str], torch.Tensor]]:
    """The buffers that hold values (not on ``meta``, not fake tensors: a rehearsed step's
    shadow, whose values nothing can compare)."""
    for key, b in buffers.items():
        if isinstance(b, torch.Tensor) and b.device.type != "meta" and not is_fake(b):
            yield key, b


def _values(buffers: Buffers) -> Values:
    """A copy of each buffer's value, with the buffer it came from (outside dispatch modes:
    selective checkpointing's would take these copies for ops of the recompute)."""
    with torch.no_grad(), _no_dispatch_modes():
        return {key: (b, b.detach().clone()) for key, b in _iter_real(buffers)}


def _copy(value: Any) -> Any:
    """A fresh copy of a saved buffer value (``None`` and the absent marker ``...`` as they
    are): each recompute gets its own, so one that changes it leaves the next one exact."""
    if not isinstance(value, torch.Tensor):
        return value
    with torch.no_grad(), _no_dispatch_modes():
        return value.detach().clone()


def _changed(objects: Buffers, values: Values, after: Buffers) -> Buffers:
    """The pre-forward value of each buffer slot the forward changed: rebound, resized,
    changed in value, added (pre-forward: absent, kept as the marker ``...``) or removed."""
    changed: Buffers = {}
    with torch.no_grad(), _no_dispatch_modes():
        for key in objects.keys() | after.keys():
            old, new = objects.get(key, ...), after.get(key, ...)
            copy = values[key][1] if key in values else None
            if old is ... or new is ... or old is not new:
                changed[key] = copy if copy is not None else old
            elif copy is not None and (old is None or not _same(old, copy)):
                changed[key] = copy
    return changed


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _install(wanted: Buffers) -> None:
    """Put ``wanted`` into its buffer slots (the marker ``...``: remove the slot)."""
    for (module, name), value in wanted.items():
        if value is ...:
            module._buffers.pop(name, None)
        else:
            module._buffers[name] = value


def _restore(owners: list[nn.Module], slots: Buffers) -> None:
    """Make the buffer slots of ``owners`` exactly ``slots`` (the same objects), removing any
    slot not in it."""
    for module, name in _buffers(owners).keys() - slots.keys():
        module._buffers.pop(name, None)
    _install(slots)


def _reset_values(values: Values) -> None:
    """Write the saved values back into buffers the recompute changed in place (kernels such
    as batch_norm update running statistics without bumping the version counter)."""
    with torch.no_grad(), _no_dispatch_modes():
        for buffer, value in values.values():
            if buffer.shape == value.shape and not torch.equal(buffer, value):
                buffer.copy_(value)


def _positional_versions(args: tuple[Any, ...]) -> list[tuple[int, torch.Tensor, int | None]]:
    return [(i, a, version_of(a)) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]


def _state_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Signature:
    """Identity, shape and version of every tensor reachable from the inputs, also inside
    plain objects (a key/value cache), up to a small depth.

    Positional tensors are left out: checkpoint saves those itself and checks their version
    when it gives them back, or saved-tensor hooks (``torch.autograd.graph.save_on_cpu``)
    give back another object holding the value they packed. Depth 6 reaches the tensors of a
    Hugging Face ``EncoderDecoderCache`` (cache -> DynamicCache -> layers -> layer -> keys).
    """
    own = {f"inputs[0][{i}]" for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    return [
        (where, id(t), tuple(t.shape), version_of(t))
        for where, t in iter_tensors((args, kwargs), "inputs", objects=True, depth=6)
        if where not in own
    ]

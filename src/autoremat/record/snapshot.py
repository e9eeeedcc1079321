"""Leave a model exactly as it was found.

``build_tree``, ``plan``, ``measure`` and ``profile`` run the user's model on example inputs,
with side effects a planning call must not have (BatchNorm's running statistics, the global
random state, ``.grad``, a buffer sized or registered lazily, a hook added, a mode switched).
:func:`preserved` undoes them, when the body returns and when it raises: docs/guide.md, "When
something fails", lists what it puts back for every module the model held on entry (its class,
structure, hooks and modes; buffers by value; parameters but not their values; ``.grad``; the
random generators; plain attributes, shallowly) and how a part that cannot be put back is
reported (:class:`RestoreError`). :func:`all_or_nothing` undoes a change to the modules
themselves (classes, attributes, hooks) that fails half-way (:func:`autoremat.wrap.apply`).

Beyond that list: the module dictionaries (the non-persistent buffer names too) are refilled in
place, so hook handles stay valid. Buffers and parameters keep their strides, device and class
too. Buffers are copied on entry (they cost their size once more while the body runs) and put
back also after writes through kernels that do not bump the version counter (batch_norm's
statistics). An in-place write to an existing ``.grad`` is reported by the same
``RuntimeWarning`` as one to a parameter; writes through ``p.data`` do not move the version
counter and go unseen. When the body initialised CUDA, its generators are reseeded with their
initial seed, as fresh ones.

Not put back: objects outside the modules, torch's global module hooks, other accelerators'
generators. Left as the body made them: the parameter slots, parameters and attributes of
modules managed by FSDP (``fully_shard``, ``FullyShardedDataParallel``), which swaps them
between sharded and unsharded forms itself.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from autoremat.core.host_rng import get_host_rng, set_host_rng
from autoremat.core.nested import version_of
from autoremat.core.words import first_few

__all__ = ["RestoreError", "UndoLog", "all_or_nothing", "fsdp_classes", "modules_kept", "preserved"]

# What nn.Module.__init__ sets on every module: parameters, buffers, submodules, hook
# dictionaries, the training flag.
_MACHINERY = tuple(vars(nn.Module()))
_MACHINERY_BUT_PARAMETERS = tuple(n for n in _MACHINERY if n != "_parameters")
_MISSING = object()


class RestoreError(RuntimeError):
    """Parts of the model could not be put back as they were; the message names each part with
    its error. Every other part was put back."""


@contextlib.contextmanager
def preserved(model: nn.Module, inputs: Sequence[torch.Tensor] = ()) -> Iterator[None]:
    """Run the body, then put ``model`` back as it was on entry (the module docstring says
    what that covers), also when the body raises; the ``.grad`` of each of ``inputs`` too.

    Raises:
        RestoreError: a part could not be put back (all the others were); chained to the
            body's exception when there was one.
        Exception: whatever the body raised, once everything is back.
    """
    snapshot = _Snapshot(model, inputs)
    try:
        yield
    except BaseException as exc:
        snapshot.restore(exc)
        raise
    snapshot.restore(None)


@contextlib.contextmanager
def modules_kept(model: nn.Module) -> Iterator[None]:
    """Run the body, then put back every module of ``model`` as a structure: its class,
    attributes, hooks, submodule, parameter and buffer slots (the objects, not their values:
    for a body that changes values itself and puts them back, as real optimizer steps in
    :func:`autoremat.measure_memory`), also when the body raises.

    Raises:
        RestoreError: a module could not be put back (all the others were).
    """
    with all_or_nothing() as log:  # (undone when the body raises, below when it returns)
        log.keep(model.named_modules())
        yield
    log.undo()


@contextlib.contextmanager
def all_or_nothing() -> Iterator[UndoLog]:
    """Run the body with an :class:`UndoLog`; when the body raises, undo every change made
    through the log, latest first, then let the exception go on. Nothing is undone when it
    returns. For a body that changes modules without running them (:func:`autoremat.wrap.apply`,
    :func:`~autoremat.wrap.remove`): tensor values and random generators are not looked at.

    Raises:
        RestoreError: a change could not be undone (all the others were), chained to the
            body's exception.
        Exception: whatever the body raised, once every change is undone.
    """
    log = UndoLog()
    try:
        yield log
    except BaseException as exc:
        log.undo(exc)
        raise


class UndoLog:
    """Changes to modules made through it, each recorded with what it replaced (a few dozen
    bytes: a log of thousands of changes stays small), and modules kept whole before code
    that changes them in ways not known in advance runs (:meth:`keep`)."""

    def __init__(self) -> None:
        self._entries: list[Any] = []

    def set_class(self, path: str, module: nn.Module, cls: type) -> None:
        """``module.__class__ = cls`` (the module at ``path``, named in errors), recorded once
        made."""
        old = type(module)
        module.__class__ = cls
        self._entries.append((path, module, "__class__", old))

    def set_attribute(self, path: str, module: nn.Module, name: str, value: Any = _MISSING) -> None:
        """Set the instance attribute ``name`` in ``module.__dict__`` (bypassing
        ``__setattr__``), or remove it when no ``value`` is given; recorded."""
        self._entries.append((path, module, name, module.__dict__.get(name, _MISSING)))
        _put(module, name, value)

    def keep(self, named: Iterable[tuple[str, nn.Module]]) -> None:
        """Record each module of ``named`` (``(path, module)`` pairs) whole: its class, every
        instance attribute (shallowly) and the entries of its parameter, buffer, submodule and
        hook dictionaries, to be put back as they are now. Costs a shallow copy of each
        module's dictionaries: for a few modules."""
        self._entries += [_ModuleState(p, m, attributes=True, parameters=True) for p, m in named]

    def undo(self, during: BaseException | None = None) -> None:
        """Undo every change recorded, latest first; the log is then empty.

        Raises:
            RestoreError: a change could not be undone (the others were).
        """
        failures = _Failures()
        entries, self._entries = self._entries, []
        for entry in reversed(entries):
            if isinstance(entry, _ModuleState):
                failures.attempt(f"module {entry.path or '(root)'!r}", entry.restore)
            else:
                path, module, name, old = entry
                what = f"{name!r} of module {path or '(root)'!r}"
                failures.attempt(what, functools.partial(_put, module, name, old))
        failures.check(during)


def _put(module: nn.Module, name: str, old: Any) -> None:
    if name == "__class__":
        if type(module) is not old:
            module.__class__ = old
    elif old is _MISSING:
        module.__dict__.pop(name, None)
    else:
        module.__dict__[name] = old


class _Failures:
    """The parts that could not be put back, each with its error."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, Exception]] = []

    def attempt(self, what: str, step: Callable[[], object]) -> None:
        try:
            step()
        except Exception as exc:  # collected: the other parts are still put back
            self.errors.append((what, exc))

    def check(self, during: BaseException | None) -> None:
        """Raise :class:`RestoreError` when any part failed: caused by ``during`` (the body's
        exception, so that its traceback is shown) or else by the first failure."""
        if not self.errors:
            return
        parts = first_few([f"{what} ({type(e).__name__}: {e})" for what, e in self.errors[:5]],
                          5, len(self.errors), "; ")  # fmt: skip
        after = "" if during is None else f" after the call failed ({type(during).__name__})"
        raise RestoreError(
            f"autoremat could not put the model back as it was{after}: {parts}. "
            f"Everything else was put back; the parts named are not as they were: reload the "
            f"model's state_dict or rebuild it"
        ) from (self.errors[0][1] if during is None else during)


def _contents(value: Any) -> Any:
    """What a machinery attribute holds: a dict's items, a set's members (``()`` when empty:
    most hook dictionaries are, and cost nothing then); ``None`` for a plain value (its
    identity is what is kept)."""
    if not isinstance(value, (dict, set)):
        return None
    if not value:
        return ()
    return list(value.items()) if isinstance(value, dict) else set(value)


def _refill(obj: Any, contents: Any) -> None:
    """Make the dict or set ``obj`` hold ``contents`` again (in place, only if it changed)."""
    if not contents:
        same = not obj
    elif isinstance(obj, dict):
        now = list(obj.items())
        same = len(now) == len(contents) and all(
            k == k0 and v is v0 for (k, v), (k0, v0) in zip(now, contents, strict=True)
        )
    else:  # a set
        same = obj == contents
    if not same:
        obj.clear()
        obj.update(contents)


class _ModuleState:
    """One module's class and ``nn.Module`` machinery (without ``_parameters`` unless
    ``parameters``) and, with ``attributes``, its whole ``__dict__`` (shallowly). Kept in a few
    tuples: a snapshot of a model with thousands of modules allocates few objects (and so
    triggers few garbage collections)."""

    __slots__ = ("attributes", "cls", "contents", "module", "names", "objects", "path")

    def __init__(self, path: str, module: nn.Module, *, attributes: bool, parameters: bool) -> None:
        self.path = path
        self.module = module
        self.cls = type(module)
        d = module.__dict__
        self.names = _MACHINERY if parameters else _MACHINERY_BUT_PARAMETERS
        self.objects = tuple([d.get(n, _MISSING) for n in self.names])
        self.contents = tuple([_contents(v) for v in self.objects])
        self.attributes = dict(d) if attributes else None

    def restore(self) -> None:
        m = self.module
        if type(m) is not self.cls:
            m.__class__ = self.cls
        d = m.__dict__
        if self.attributes is not None:
            for name in d.keys() - self.attributes.keys():
                del d[name]
            for name, value in self.attributes.items():
                if d.get(name, _MISSING) is not value:
                    d[name] = value
        for name, obj, contents in zip(self.names, self.objects, self.contents, strict=True):
            if obj is _MISSING:  # absent on entry (an old pickle): whatever is there now stays
                continue
            if d.get(name, _MISSING) is not obj:
                d[name] = obj
            if contents is not None:
                _refill(obj, contents)
        for slots in ("_parameters", "_buffers", "_modules"):
            for name in d.get(slots, ()):
                if name in d and name not in _MACHINERY:  # a plain attribute would shadow it
                    del d[name]


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    try:
        return (t.dtype, t.device, tuple(t.shape), t.stride(), t.storage_offset())
    except (RuntimeError, NotImplementedError):  # sparse and nested tensors have no strides
        return (t.dtype, t.device, tuple(t.shape))


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without one
        return None


class _TensorState:
    """A parameter or buffer: identity, class, layout, storage, ``requires_grad``, and with
    ``copy`` (buffers) a copy of its values, else (parameters) its version. A tensor on the
    ``meta`` device has no values to copy or to write."""

    __slots__ = ("cls", "layout", "name", "requires_grad", "storage", "tensor", "value", "version")

    def __init__(self, name: str, t: torch.Tensor, *, copy: bool) -> None:
        self.name = name
        self.tensor = t
        self.cls = type(t)
        self.layout = _layout(t)
        self.storage = _storage(t)
        self.requires_grad = t.requires_grad
        meta = t.device.type == "meta"
        self.version = None if copy or meta else version_of(t)
        self.value = None
        if copy and not meta:
            with torch.no_grad():
                self.value = t.detach().clone()

    def restore(self, written: list[str]) -> None:
        """Put the tensor back; add its name to ``written`` when its values were written in
        place and there is no copy to put back (a parameter's version counter moved)."""
        t = self.tensor
        if type(t) is not self.cls:
            t.__class__ = self.cls
        now = _storage(t)
        if _layout(t) != self.layout or (now is not None and now is not self.storage):
            t.data = self._rebuilt()
        if t.requires_grad != self.requires_grad:
            t.requires_grad_(self.requires_grad)
        if self.value is None:
            if self.version is not None and version_of(t) != self.version:
                written.append(self.name)
            return
        with torch.no_grad():
            if not torch.equal(t, self.value):
                t.copy_(self.value)

    def _rebuilt(self) -> torch.Tensor:
        """A tensor with the original storage and layout (or a copy of the saved values)."""
        dtype, device, shape, *strided = self.layout
        if self.storage is not None and strided:
            stride, offset = strided
            try:
                return torch.empty(0, dtype=dtype, device=device).set_(
                    self.storage, offset, shape, stride
                )
            except RuntimeError:  # the storage itself was shrunk
                if self.value is None:
                    raise
        if self.value is None:
            raise RuntimeError("its original storage is out of reach; its data cannot be put back")
        return self.value.clone()


def fsdp_classes() -> tuple[type, ...]:
    """FSDP's module classes, when FSDP is imported (else no module can be one)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    found = (getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None))
    return tuple(c for c in found if isinstance(c, type))


def _uninitialized(m: nn.Module) -> bool:
    """A lazy module not initialised yet: it holds an uninitialised parameter or buffer."""
    return any(
        t is not None and is_lazy(t) for t in [*m._parameters.values(), *m._buffers.values()]
    )


class _Snapshot:
    """What :func:`preserved` puts back (module docstring)."""

    def __init__(self, model: nn.Module, inputs: Sequence[torch.Tensor]) -> None:
        fsdp = fsdp_classes()
        managed = {id(s) for m in model.modules() if isinstance(m, fsdp) for s in m.modules()}
        self.modules: list[_ModuleState] = []
        tensors: dict[int, _TensorState] = {}
        for path, m in model.named_modules():
            if _uninitialized(m):
                continue
            own = id(m) not in managed
            self.modules.append(_ModuleState(path, m, attributes=own, parameters=own))
            slots = [(n, t, False) for n, t in m._parameters.items() if own]
            slots += [(n, t, True) for n, t in m._buffers.items()]
            for name, t, copy in slots:
                if t is not None and id(t) not in tensors:
                    full = f"{path}.{name}" if path else name
                    tensors[id(t)] = _TensorState(full, t, copy=copy)
        self.tensors = list(tensors.values())
        named = [*model.named_parameters(), *((f"inputs[{i}]", t) for i, t in enumerate(inputs))]
        self.grads = [
            (name, p, p.grad, None if p.grad is None else version_of(p.grad))
            for name, p in named
            if not is_lazy(p)
        ]
        # torch's CPU and CUDA, Python's and NumPy's global random states
        self.cpu_rng = torch.random.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.host_rng = get_host_rng()

    def restore(self, during: BaseException | None) -> None:
        """Put everything back; warn about values written that have no copy; raise
        :class:`RestoreError` when a part failed."""
        failures = _Failures()
        for m in self.modules:
            failures.attempt(f"module {m.path or '(root)'!r}", m.restore)
        written: list[str] = []
        for t in self.tensors:
            failures.attempt(f"tensor {t.name!r}", functools.partial(t.restore, written))
        for name, p, grad, version in self.grads:
            failures.attempt(f"the .grad of {name!r}", functools.partial(_set_grad, p, grad))
            if grad is not None and version_of(grad) != version:
                written.append(f"{name}.grad")
        failures.attempt("torch's random state", lambda: torch.random.set_rng_state(self.cpu_rng))
        cuda = self.cuda_rng
        if cuda is not None:
            failures.attempt("CUDA's random state", lambda: torch.cuda.set_rng_state_all(cuda))
        elif torch.cuda.is_initialized():  # initialised by the body: as fresh generators
            failures.attempt(
                "CUDA's random state",
                lambda: torch.cuda.manual_seed_all(torch.cuda.initial_seed()),
            )
        failures.attempt("Python's and NumPy's random states", lambda: set_host_rng(self.host_rng))
        if written:
            warnings.warn(
                f"autoremat: the model wrote in place to {', '.join(map(repr, written[:5]))} "
                f"while it ran; autoremat keeps no copy of parameters and gradients (it would "
                f"double their memory), so these keep the values written",
                RuntimeWarning,
                stacklevel=4,
            )
        failures.check(during)


def _set_grad(p: torch.Tensor, grad: torch.Tensor | None) -> None:
    if p.grad is not grad:
        p.grad = grad

"""Claim 4: wrap each chosen module so its activations are recomputed in backward.

The wrapping follows the claim: a class that inherits ``torch.nn.Module`` (:class:`Checkpointed`)
whose ``forward`` calls :func:`torch.utils.checkpoint.checkpoint` with a wrapper function that
calls the split point's own ``forward``.

To keep every name, ``state_dict`` key and hook of the user's model, the module is not moved into
a wrapper object: its class is swapped for a subclass made of :class:`Checkpointed` and the
module's own class (``CheckpointedLinear`` for a ``Linear``). The object, its parameters, buffers
and place in the model stay the same; :func:`remove` swaps the original class back. A plan entry
``path[i:j]`` (children ``i..j-1`` of a plain ``nn.Sequential``, recomputed as one) swaps the
Sequential's class for one made of :class:`CheckpointedRuns` in the same way.

What the wrapped ``forward`` guarantees beyond ``checkpoint`` itself:

* non-reentrant checkpointing (the reentrant default trains nothing when no input requires
  grad) with the RNG state replayed, so dropout draws the same mask in the recompute;
* buffers the module wrote to in its forward (BatchNorm's ``running_mean``, ``running_var`` and
  ``num_batches_tracked``) are put back after the recompute: they move once per step, as without
  recompute (torch does not do this, pytorch#96136);
* inputs the module's forward received are checked, when it is recomputed, for in-place changes
  since the forward (a Hugging Face key/value cache filled by the forward, an input tensor
  written to): the recompute would compute something else, so it raises a
  :class:`~torch.utils.checkpoint.CheckpointError` that names the module and the input;
* a module wrapped *selectively* (``apply(..., selective=[...])``) keeps the outputs of its
  ``save_ops`` from the forward and recomputes only the other ops
  (:mod:`autoremat.selective`, through ``checkpoint``'s ``context_fn``);
* Hugging Face models (modules with a ``config.use_cache`` and a ``use_cache`` argument) are
  called with ``use_cache=False`` while training with gradients enabled, as Hugging Face's own
  gradient checkpointing does; a warning is logged once.

Saving and copying a wrapped model:

* ``pickle.dumps(model)`` and ``torch.save(model)`` (of the model or any module in it) save
  the model as it was before :func:`apply`: the modules' own classes, without autoremat's
  attributes or its ``use_cache`` hook (:func:`autoremat.classes.reduce_as_plain`). Loading
  needs no autoremat and gives the plain model (apply the plan again to wrap it).
  ``state_dict()`` keys are those of the unwrapped model, so ``torch.save(model.state_dict())``
  and ``load_state_dict`` work either way.
* ``copy.deepcopy(model)`` (and ``copy.copy`` of a wrapped module) gives a *wrapped* copy: same
  entries, same selective ops, same hook, ready to train (an EMA or teacher copy behaves as the
  original). :func:`remove` on the copy undoes all of it on the copy only.
* ``save_pretrained`` of a wrapped module that has one (a wrapped Hugging Face root, plan entry
  ``""``) runs with the module's own class for the duration of the call, so ``config.json``
  names the original architecture (``GPT2LMHeadModel``, not ``CheckpointedGPT2LMHeadModel``).
  Class names stay ``Checkpointed<Class>`` otherwise (in ``repr``, in errors).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, SupportsIndex

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autoremat import huggingface, selective
from autoremat.calls import (
    ATTR as _CALLS_ATTR,
)
from autoremat.calls import (
    PLAIN,
    ChosenCalls,
    add_new_step_hook,
    chosen_calls,
    remove_new_step_hooks,
)
from autoremat.classes import (
    ATTR_PREFIX,
    BASE_ATTR,
    copy_as_is,
    deepcopy_as_is,
    is_wrapped,
    reduce_as_plain,
)
from autoremat.entries import call_entry, first_nested, module_of, parse_call, parse_run, run_entry
from autoremat.replay import CheckpointedCall
from autoremat.selective import context_fn as selective_context
from autoremat.snapshot import all_or_nothing

__all__ = [
    "Checkpointed",
    "CheckpointedRuns",
    "apply",
    "remove",
    "selective_paths",
    "wrapped_paths",
]

# instance attributes; their prefix marks them autoremat's (left out of pickles)
_PATH_ATTR = f"{ATTR_PREFIX}path"
_RUNS_ATTR = f"{ATTR_PREFIX}runs"
_CONTEXT_ATTR = f"{ATTR_PREFIX}context_fn"


class Wrapped(nn.Module):
    """Base of the two mixins :func:`apply` puts in front of a module's own class.

    A wrapped module pickles as its own class without autoremat's attributes and hooks, and
    copies (``copy.copy``, ``copy.deepcopy``) as a wrapped module (module docstring)."""

    _autoremat_base: type[nn.Module]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A class :func:`apply` makes (``Checkpointed<Base>``, with :data:`BASE_ATTR` in its
        body) skips the ``__init_subclass__`` of the classes after this one in its MRO, the
        base's: a base that registers its subclasses (a plugin registry, Hugging Face's
        ``Cache`` layers) never sees autoremat's class, one that refuses subclasses does not
        stop the wrap, and ``GradientCheckpointingLayer`` does not wrap our ``forward`` in its
        own. Every other subclass (``FSDP<Class>`` made by ``fully_shard`` on top of ours)
        runs them as usual. A metaclass's ``__new__``/``__init__`` still runs."""
        if BASE_ATTR in cls.__dict__:
            return
        super().__init_subclass__(**kwargs)

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        """The module as it was before :func:`apply`, for ``pickle`` and ``torch.save``
        (:func:`autoremat.classes.reduce_as_plain`)."""
        return reduce_as_plain(self, protocol)

    def __copy__(self) -> nn.Module:
        """A shallow copy, still wrapped (:func:`autoremat.classes.copy_as_is`)."""
        return copy_as_is(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        """A deep copy, still wrapped (:func:`autoremat.classes.deepcopy_as_is`)."""
        return deepcopy_as_is(self, memo)


class Checkpointed(Wrapped):
    """Mixin placed in front of a module's own class by :func:`apply` (claim 4).

    ``forward`` runs the module's own ``forward`` through ``torch.utils.checkpoint.checkpoint``
    when gradients are enabled, and directly otherwise (nothing would be stored for backward).
    A module named by call entries (``path@k``) does so for the chosen calls of each forward of
    the model only, and runs the others directly (:mod:`autoremat.calls`).
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        own_forward = functools.partial(type(self)._autoremat_base.forward, self)
        label = self.__dict__.get(_PATH_ATTR, "")
        context_fn = self.__dict__.get(_CONTEXT_ATTR)
        chosen = chosen_calls(self)
        if chosen is None:
            if not torch.is_grad_enabled():
                return own_forward(*args, **kwargs)
            return _checkpoint(label, [self], own_forward, args, kwargs, context_fn)
        k, context_fn = chosen.take()  # some calls only: is this one of them?
        if not torch.is_grad_enabled() or context_fn is PLAIN:
            out = own_forward(*args, **kwargs)
        else:
            out = _checkpoint(call_entry(label, k), [self], own_forward, args, kwargs, context_fn)
        chosen.started(k, out)
        return out


class CheckpointedRuns(Wrapped):
    """Mixin placed in front of a plain ``nn.Sequential`` by :func:`apply` for plan entries
    ``path[i:j]``: each run ``[i:j)`` of its children is recomputed as one, through
    ``torch.utils.checkpoint.checkpoint`` with a wrapper function that calls the run's own
    forwards in turn. The other children run as usual."""

    def forward(self, input: Any) -> Any:
        children = [m for m in self._modules.values() if m is not None]
        if not torch.is_grad_enabled():
            return type(self)._autoremat_base.forward(self, input)
        runs = dict(self.__dict__[_RUNS_ATTR])
        path = self.__dict__.get(_PATH_ATTR, "")
        k = 0
        while k < len(children):
            j = runs.get(k)
            if j is None:
                input = children[k](input)
                k += 1
                continue
            chunk = children[k:j]
            input = _checkpoint(run_entry(path, k, j), chunk, _chain(chunk), (input,), {})
            k = j
        return input


def _chain(modules: list[nn.Module]) -> Any:
    def run(x: Any) -> Any:
        for m in modules:
            x = m(x)
        return x

    return run


def _checkpoint(
    label: str,
    owners: list[nn.Module],
    fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context_fn: Any = None,
) -> Any:
    """``checkpoint(fn, *args, **kwargs)``, non-reentrant, with the recompute guarded; with
    ``context_fn`` (:func:`autoremat.selective.context_fn`, made once by :func:`apply`),
    selective: the outputs of its ops are kept, the rest recomputed."""
    extra: dict[str, Any] = {}
    if context_fn is not None:
        extra["context_fn"] = context_fn
    if torch.compiler.is_compiling():
        return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)
    call = CheckpointedCall(label, owners)

    def run_forward(*a: Any) -> Any:
        """The wrapper function: the split point's own forward, guarded on recompute
        (:mod:`autoremat.replay`). The keyword arguments arrive as the last positional one
        (see below)."""
        *pos, k = a
        return call.run(fn, tuple(pos), k)

    # The keyword arguments travel as one positional dict: checkpoint saves and replays the
    # CUDA RNG state only of the devices of the tensors among its positional arguments, so a
    # module given its tensors by keyword (Hugging Face Llama's self_attn) would draw other
    # dropout masks in the recompute than in the forward on a GPU.
    return checkpoint(
        run_forward, *args, kwargs, use_reentrant=False, preserve_rng_state=True, **extra
    )


_classes: dict[tuple[type, type], type] = {}
# one module to wrap: (path, module, its wrapped class, autoremat's instance attributes)
Change = tuple[str, nn.Module, type, dict[str, Any]]


def _wrapped_class(mixin: type, base: type) -> type:
    """``Checkpointed<Base>`` (or ``CheckpointedRuns<Base>``): a wrapped module's class, made
    once per pair. A base with a ``save_pretrained`` (Hugging Face, diffusers) gets
    :func:`_save_pretrained` in front of it."""
    if (mixin, base) not in _classes:
        body: dict[str, Any] = {BASE_ATTR: base, "__module__": __name__}
        if callable(getattr(base, "save_pretrained", None)):
            body["save_pretrained"] = _save_pretrained
        _classes[mixin, base] = type(f"{mixin.__name__}{base.__name__}", (mixin, base), body)
    return _classes[mixin, base]


def _save_pretrained(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The base's ``save_pretrained``, run with the module's own class for the duration of the
    call: Hugging Face writes ``type(self).__name__`` into ``config.json`` as the architecture
    (diffusers as ``_class_name``), which must name the original class for the saved model to
    load. Nothing else changes; the wrapped class is back when the call returns or raises.

    Not thread-safe: another thread calling the module during the save runs it unwrapped. When
    another class was swapped in on top of autoremat's (``fully_shard``), that class is kept
    and the base's ``save_pretrained`` called under it (the name it writes is then that
    class's, less Hugging Face's ``FSDP`` prefix)."""
    cls = type(self)
    ours = next(c for c in cls.__mro__ if BASE_ATTR in c.__dict__)
    base = ours.__dict__[BASE_ATTR]
    if cls is not ours:
        return base.save_pretrained(self, *args, **kwargs)
    self.__class__ = base
    try:
        return self.save_pretrained(*args, **kwargs)
    finally:
        self.__class__ = ours


def wrapped_paths(model: nn.Module) -> tuple[str, ...]:
    """The plan entries :func:`apply` wrapped in ``model``, in ``named_modules`` order: module
    paths, and ``path[i:j]`` for runs of a Sequential's children."""
    found: list[str] = []
    for p, m in model.named_modules():
        chosen = chosen_calls(m)
        if isinstance(m, Checkpointed) and chosen is not None:
            found += [call_entry(p, k) for k in sorted(chosen.chosen)]
        elif isinstance(m, Checkpointed):
            found.append(p)
        elif isinstance(m, CheckpointedRuns):
            found += [run_entry(p, i, j) for i, j in m.__dict__[_RUNS_ATTR]]
    return tuple(found)


def selective_paths(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The entries :func:`apply` wrapped selectively (modules, calls ``path@k``), with the
    ops whose outputs they keep."""
    found: dict[str, tuple[str, ...]] = {}
    for p, m in model.named_modules():
        if not isinstance(m, Checkpointed):
            continue
        chosen = chosen_calls(m)
        if chosen is not None:
            found |= {call_entry(p, k): fn.args[0] for k, fn in sorted(chosen.chosen.items()) if fn}
        elif m.__dict__.get(_CONTEXT_ATTR) is not None:
            found[p] = m.__dict__[_CONTEXT_ATTR].args[0]
    return found


def apply(
    model: nn.Module,
    paths: Sequence[str],
    *,
    selective: Sequence[str] | Mapping[str, Sequence[str]] = (),
    save_ops: Sequence[str] = selective.DEFAULT_SAVE_OPS,
    calls: Mapping[str, int] | None = None,
) -> nn.Module:
    """Wrap the plan entries ``paths`` of ``model`` in place; return ``model``.

    An entry is a module's qualified name (as in ``model.named_modules()``), or ``path[i:j]``:
    the run of children ``i..j-1`` of the plain ``nn.Sequential`` at ``path``, recomputed as
    one (:mod:`autoremat.entries`). The entries also in ``selective`` (module paths, not runs)
    are recomputed selectively: the outputs of the ops in ``save_ops`` are kept from the
    forward, the other ops run again (:mod:`autoremat.selective`); ``selective`` may also map
    each such entry to its own ops (``{"h.0": ("aten.mm", "aten.addmm")}``, as
    :attr:`autoremat.Plan.selective` does), and then ``save_ops`` is not used. Applying the
    same entries to a model that already has them wrapped is a no-op.

    A call entry ``path@k`` recomputes only the ``k``-th call of the module in each forward
    of ``model`` (:mod:`autoremat.calls`: a pre-hook on ``model`` counts the calls afresh
    each forward); ``calls`` maps such a module's path to the number of calls the plan was
    made for, so that a forward with another number warns (:attr:`autoremat.Plan.calls`).

    Hugging Face-style modules are called with ``use_cache=False`` while training with
    gradients, with entries or without (:mod:`autoremat.huggingface`): plans are priced on
    that step.

    All or nothing: every entry is checked and every wrapped class made before any module
    changes; when changing them fails half-way, every module gets back its class, attributes
    and hooks (:func:`autoremat.snapshot.all_or_nothing`) before the error goes on.

    Raises:
        ValueError: an entry names no module of ``model`` (the message lists them), or a run
            that is not inside a plain ``nn.Sequential``; one entry is inside another (the
            recomputes would nest); the model already has other entries wrapped (call
            :func:`remove` first); or a module cannot be wrapped (a ``torch.jit.ScriptModule``,
            or one whose ``forward`` was replaced on the instance, or whose class cannot be
            subclassed: the message names it); a ``selective`` entry not in ``paths`` or a
            run; a ``save_ops`` name not of the form ``"aten.mm"``.
        TypeError: ``save_ops`` not a sequence of strings.
    """
    wanted_selective = _selective_entries(paths, selective, save_ops)
    modules = dict(model.named_modules())
    _check_present(model, paths, modules)
    already = wrapped_paths(model)
    if already:
        if set(already) == set(paths) and selective_paths(model) == wanted_selective:
            return model
        raise ValueError(
            f"{type(model).__name__} already has {len(already)} wrapped entries from another "
            f"plan; call autoremat.remove(model) before applying a new one"
        )
    chosen = sorted(set(paths))
    _check_not_nested(chosen)
    _make(model, chosen, _changes(chosen, modules, wanted_selective, calls or {}))
    return model


def _make(model: nn.Module, chosen: list[str], changes: list[Change]) -> None:
    """Make the ``changes`` to ``model``, all or nothing; with call entries among ``chosen``,
    the pre-hook that counts calls afresh each forward; and Hugging Face caches off in
    training, even with no entry: the profile every plan was priced on trains without them
    (an untouched model would fill a key/value cache: 2% more on Hugging Face GPT-2)."""
    with all_or_nothing() as log:
        for path, m, cls, attributes in changes:
            log.set_class(path, m, cls)
            for name, value in attributes.items():
                log.set_attribute(path, m, name, value)
        if any(parse_call(e) is not None for e in chosen):
            log.keep([("", model)])
            add_new_step_hook(model)
        log.keep(huggingface.cache_modules(model))
        huggingface.turn_cache_off_in_training(model)


def _changes(
    chosen: list[str],
    modules: dict[str, nn.Module],
    wanted_selective: dict[str, tuple[str, ...]],
    calls: Mapping[str, int],
) -> list[Change]:
    """What :func:`apply` will change, worked out before it changes anything: each module to
    wrap (path, module), with its wrapped class and autoremat's instance attributes. Every
    entry is checked (:func:`_runs_by_parent`) and every class made here, so a failure leaves
    the model as it was."""
    runs = _runs_by_parent(chosen, modules)
    changes: list[Change] = []
    by_module: dict[str, dict[int, Any]] = {}
    for e in chosen:
        call = parse_call(e)
        if call is not None:
            ops = wanted_selective.get(e)
            by_module.setdefault(call[0], {})[call[1]] = ops and selective_context(ops)
    for path, picked in by_module.items():
        m = modules[path]
        own: dict[str, Any] = {_PATH_ATTR: path}
        own[_CALLS_ATTR] = ChosenCalls(path, picked, calls.get(path))
        changes.append((path, m, _class_for(path, Checkpointed, m), own))
    for e in chosen:
        if parse_run(e) is None and parse_call(e) is None:
            m = modules[e]
            attributes: dict[str, Any] = {_PATH_ATTR: e}
            if e in wanted_selective:
                attributes[_CONTEXT_ATTR] = selective_context(wanted_selective[e])
            changes.append((e, m, _class_for(e, Checkpointed, m), attributes))
    for parent, spans in runs.items():
        seq = modules[parent]
        attributes = {_PATH_ATTR: parent, _RUNS_ATTR: tuple(sorted(spans))}
        changes.append((parent, seq, _class_for(parent, CheckpointedRuns, seq), attributes))
    return changes


def _class_for(path: str, mixin: type, m: nn.Module) -> type:
    """:func:`_wrapped_class` for the module at ``path``. Making it fails when the module's
    class refuses subclasses through its metaclass, or cannot be combined with ``mixin``: a
    ``ValueError`` naming the module and the fix, raised before anything changed."""
    try:
        return _wrapped_class(mixin, type(m))
    except Exception as exc:
        raise ValueError(
            f"module {path or '(root)'!r} cannot be wrapped: autoremat could not make a "
            f"subclass of its class {type(m).__name__} ({type(exc).__name__}: {exc}); "
            f"leave it out of the plan"
        ) from exc


def _selective_entries(
    paths: Sequence[str],
    wanted: Sequence[str] | Mapping[str, Sequence[str]],
    save_ops: Sequence[str],
) -> dict[str, tuple[str, ...]]:
    """The selective entries of :func:`apply`, each with the ops it keeps, checked."""
    if isinstance(wanted, Mapping):
        found = {e: selective.check_names(ops) for e, ops in wanted.items()}
    else:
        if isinstance(wanted, str):
            raise TypeError(f"selective must be a sequence of module paths, got {wanted!r}")
        ops = selective.check_names(save_ops)
        found = {e: ops for e in wanted}
    odd = [e for e in found if e not in paths or parse_run(e) is not None]
    if odd:
        raise ValueError(
            f"selective entries must be module paths or calls among the plan's entries: "
            f"{', '.join(map(repr, odd[:5]))} {'is' if len(odd) == 1 else 'are'} not"
        )
    return found


def _check_present(model: nn.Module, paths: Sequence[str], modules: dict[str, nn.Module]) -> None:
    missing = [e for e in paths if module_of(e) not in modules]
    if missing:
        raise ValueError(
            f"the plan names modules that {type(model).__name__} does not have: "
            f"{', '.join(map(repr, missing[:5]))}{' ...' if len(missing) > 5 else ''}; "
            f"make the plan from this model (autoremat.plan(model, ...))"
        )


def _check_not_nested(chosen: list[str]) -> None:
    nested = first_nested(chosen)
    if nested is not None:
        inner, outer = nested
        raise ValueError(
            f"module {inner or '(root)'!r} is inside {outer or '(root)'!r}: "
            f"recomputes would nest; keep only one of them in the plan"
        )


def _runs_by_parent(
    chosen: list[str], modules: dict[str, nn.Module]
) -> dict[str, list[tuple[int, int]]]:
    """The runs among ``chosen``, by the Sequential they belong to; every entry checked to be
    wrappable."""
    runs: dict[str, list[tuple[int, int]]] = {}
    for e in chosen:
        run = parse_run(e)
        if run is None:
            _check_wrappable(module_of(e), modules[module_of(e)])
            continue
        parent, i, j = run
        seq = modules[parent]
        count = len(seq._modules)
        if type(seq).forward is not nn.Sequential.forward or not (0 <= i < j <= count):
            raise ValueError(
                f"plan entry {e!r} needs a plain nn.Sequential at {parent or '(root)'!r} with "
                f"children {i}..{j - 1}; {type(seq).__name__} is not one"
            )
        _check_wrappable(parent, seq)
        runs.setdefault(parent, []).append((i, j))
    return runs


def unwrappable_reason(m: nn.Module) -> str | None:
    """Why ``m`` cannot be wrapped, or ``None`` when it can."""
    if isinstance(m, torch.jit.ScriptModule):
        return "it is a TorchScript module"
    if "forward" in m.__dict__:
        return "its forward was replaced on the instance"
    return None


def _check_wrappable(path: str, m: nn.Module) -> None:
    reason = unwrappable_reason(m)
    if reason is not None:
        raise ValueError(f"module {path!r} cannot be wrapped: {reason}; leave it out of the plan")


def remove(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: every wrapped module gets its own class back; return ``model``.

    The module objects are the same ones throughout (wrapping never replaced them), so after
    ``remove`` the model is the original one. A model that was never wrapped is returned
    unchanged (a no-op, not an error). On a deep copy of a wrapped model it unwraps the copy
    and removes the copy's ``use_cache`` hook, and leaves the original wrapped.

    Raises:
        ValueError: a wrapped module had its class swapped again after :func:`apply` (as
            ``torch.distributed.fsdp.fully_shard`` does to each module it shards, making
            ``FSDPCheckpointed<Cls>``); the message names it. Nothing is changed then.
        Exception: undoing failed half-way (a class refusing ``__class__`` assignment); every
            module was put back as it was wrapped first.
    """
    for m in model.modules():
        if is_wrapped(m) and BASE_ATTR not in type(m).__dict__:
            raise ValueError(
                f"module {m.__dict__.get(_PATH_ATTR)!r} had its class changed again after "
                f"autoremat wrapped it ({type(m).__name__}, e.g. by fully_shard); autoremat "
                f"cannot undo its wrap under that class, and changed nothing: undo the other "
                f"change first, or rebuild the model"
            )
    with all_or_nothing() as log:
        for path, m in model.named_modules():
            if is_wrapped(m):
                log.set_class(path, m, type(m).__dict__[BASE_ATTR])
                for name in (_PATH_ATTR, _RUNS_ATTR, _CONTEXT_ATTR, _CALLS_ATTR):
                    if name in m.__dict__:
                        log.set_attribute(path, m, name)
        log.keep([("", model)])
        remove_new_step_hooks(model)
        log.keep(huggingface.cache_modules(model))
        huggingface.remove_cache_hooks(model)
    return model

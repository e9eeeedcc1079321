"""Claim 4: the wrapped classes, whose forward recomputes the module in backward.

The wrapping follows the claim: a class that inherits ``torch.nn.Module`` (:class:`Checkpointed`)
whose ``forward`` calls :func:`torch.utils.checkpoint.checkpoint` with a wrapper function that
calls the split point's own ``forward``.

To keep every name, ``state_dict`` key and hook of the user's model, the module is not moved into a
wrapper object: its class is swapped for a subclass made of :class:`Checkpointed` and the module's
own class (``CheckpointedLinear`` for a ``Linear``). The object, its parameters, buffers and place
in the model stay the same; :func:`~autoremat.wrap.remove` swaps the original class back. A plan
entry ``path[i:j]`` (children ``i..j-1`` of a plain ``nn.Sequential``, recomputed as one) swaps the
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
  (:mod:`autoremat.core.selective`, through ``checkpoint``'s ``context_fn``);
* Hugging Face models (modules with a ``config.use_cache`` and a ``use_cache`` argument) are
  called with ``use_cache=False`` while training with gradients enabled, as Hugging Face's own
  gradient checkpointing does; a warning is logged once.

Saving and copying a wrapped model:

* ``pickle.dumps(model)`` and ``torch.save(model)`` (of the model or any module in it) save
  the model as it was before :func:`~autoremat.wrap.apply`: the modules' own classes, without
  autoremat's attributes or its ``use_cache`` hook (:func:`autoremat.core.classes.reduce_as_plain`).
  Loading needs no autoremat and gives the plain model (apply the plan again to wrap it).
  ``state_dict()`` keys are those of the unwrapped model, so ``torch.save(model.state_dict())`` and
  ``load_state_dict`` work either way.
* ``copy.deepcopy(model)`` (and ``copy.copy`` of a wrapped module) gives a *wrapped* copy: same
  entries, same selective ops, same hook, ready to train (an EMA or teacher copy behaves as the
  original). :func:`~autoremat.wrap.remove` on the copy undoes all of it on the copy only.
* ``save_pretrained`` of a wrapped module that has one (a wrapped Hugging Face root, plan entry
  ``""``) runs with the module's own class for the duration of the call, so ``config.json``
  names the original architecture (``GPT2LMHeadModel``, not ``CheckpointedGPT2LMHeadModel``).
  Class names stay ``Checkpointed<Class>`` otherwise (in ``repr``, in errors).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, SupportsIndex

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autoremat.core.classes import (
    ATTR_PREFIX,
    BASE_ATTR,
    copy_as_is,
    deepcopy_as_is,
    reduce_as_plain,
)
from autoremat.core.entries import call_entry, run_entry
from autoremat.core.nested import iter_tensors
from autoremat.wrap.calls import PLAIN, chosen_calls
from autoremat.wrap.replay import CheckpointedCall, containers_copied

__all__ = [
    "CONTEXT_ATTR",
    "PATH_ATTR",
    "RUNS_ATTR",
    "Checkpointed",
    "CheckpointedRuns",
    "Wrapped",
    "selective_paths",
    "wrapped_class",
    "wrapped_paths",
]

# instance attributes; their prefix marks them autoremat's (left out of pickles)
PATH_ATTR = f"{ATTR_PREFIX}path"
RUNS_ATTR = f"{ATTR_PREFIX}runs"
CONTEXT_ATTR = f"{ATTR_PREFIX}context_fn"


class Wrapped(nn.Module):
    """Base of the two mixins :func:`~autoremat.wrap.apply` puts in front of a module's own class.

    A wrapped module pickles as its own class without autoremat's attributes and hooks, and
    copies (``copy.copy``, ``copy.deepcopy``) as a wrapped module (module docstring)."""

    _autoremat_base: type[nn.Module]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A class :func:`~autoremat.wrap.apply` makes (``Checkpointed<Base>``, with
        :data:`BASE_ATTR` in its body) skips the ``__init_subclass__`` of the classes after this one
        in its MRO, the base's: a base that registers its subclasses (a plugin registry, Hugging
        Face's ``Cache`` layers) never sees autoremat's class, one that refuses subclasses does not
        stop the wrap, and ``GradientCheckpointingLayer`` does not wrap our ``forward`` in its own.
        Every other subclass (``FSDP<Class>`` made by ``fully_shard`` on top of ours) runs them as
        usual. A metaclass's ``__new__``/``__init__`` still runs."""
        if BASE_ATTR in cls.__dict__:
            return
        super().__init_subclass__(**kwargs)

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        """The module as it was before :func:`~autoremat.wrap.apply`, for ``pickle`` and
        ``torch.save`` (:func:`autoremat.core.classes.reduce_as_plain`)."""
        return reduce_as_plain(self, protocol)

    def __copy__(self) -> nn.Module:
        """A shallow copy, still wrapped (:func:`autoremat.core.classes.copy_as_is`)."""
        return copy_as_is(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        """A deep copy, still wrapped (:func:`autoremat.core.classes.deepcopy_as_is`)."""
        return deepcopy_as_is(self, memo)


class Checkpointed(Wrapped):
    """Mixin placed in front of a module's own class by :func:`~autoremat.wrap.apply` (claim 4).

    ``forward`` runs the module's own ``forward`` through ``torch.utils.checkpoint.checkpoint``
    when gradients are enabled, and directly otherwise (nothing would be stored for backward).
    A module named by call entries (``path@k``) does so for the chosen calls of each forward of
    the model only, and runs the others directly (:mod:`autoremat.wrap.calls`).
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        own_forward = functools.partial(type(self)._autoremat_base.forward, self)
        label = self.__dict__.get(PATH_ATTR, "")
        context_fn = self.__dict__.get(CONTEXT_ATTR)
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
    """Mixin placed in front of a plain ``nn.Sequential`` by :func:`~autoremat.wrap.apply` for plan
    entries ``path[i:j]``: each run ``[i:j)`` of its children is recomputed as one, through
    ``torch.utils.checkpoint.checkpoint`` with a wrapper function that calls the run's own forwards
    in turn. The other children run as usual."""

    def forward(self, input: Any) -> Any:
        children = [m for m in self._modules.values() if m is not None]
        if not torch.is_grad_enabled():
            return type(self)._autoremat_base.forward(self, input)
        runs = dict(self.__dict__[RUNS_ATTR])
        path = self.__dict__.get(PATH_ATTR, "")
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
    ``context_fn`` (:func:`autoremat.core.selective.context_fn`, made once by
    :func:`~autoremat.wrap.apply`), selective: the outputs of its ops are kept, the rest
    recomputed."""
    extra: dict[str, Any] = {}
    if context_fn is not None:
        extra["context_fn"] = context_fn
    if torch.compiler.is_compiling():
        return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)
    call = CheckpointedCall(label, owners)
    # The forward gets the caller's own arguments; checkpoint keeps copies of their lists and
    # dicts for the recompute (:func:`~autoremat.wrap.replay.containers_copied`).
    callers: list[tuple[tuple[Any, ...], dict[str, Any]]] = [(args, kwargs)]

    def run_forward(*a: Any) -> Any:
        """The wrapper function: the split point's own forward, guarded on recompute
        (:mod:`autoremat.wrap.replay`). The keyword arguments arrive as the last positional one
        (see below)."""
        *pos, k = a
        if callers:  # the forward itself: the caller's containers, not the copies
            pos, k = callers.pop()  # type: ignore[assignment]
        return call.run(fn, tuple(pos), k)

    # The keyword arguments travel as one positional dict: checkpoint saves and replays the
    # CUDA RNG state only of the devices of the tensors among its positional arguments, so a
    # module given its tensors by keyword (Hugging Face Llama's self_attn) would draw other
    # dropout masks in the recompute than in the forward on a GPU.
    kept_args, kept_kwargs = containers_copied((args, kwargs))
    try:
        out = checkpoint(
            run_forward,
            *kept_args,
            kept_kwargs,
            use_reentrant=False,
            preserve_rng_state=True,
            **extra,
        )
    finally:
        callers.clear()
    _check_inputs_when_backward_begins(call, args, out)
    return out


def _check_inputs_when_backward_begins(
    call: CheckpointedCall, args: tuple[Any, ...], out: Any
) -> None:
    """Before the backward of any output ``call`` made (not an input passed through), check
    that its positional inputs are unchanged (:meth:`CheckpointedCall.check_inputs`): an input
    changed in place since then fails there with the module's name, not later in torch's
    checkpoint with none. The hook holds the call weakly (the checkpoint holds it). Not under
    saved-tensor hooks (``save_on_cpu``): those may pack a copy, which the recompute then
    gets, so a change to the original is no error there."""
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return
    inputs = {id(a) for a in args if isinstance(a, torch.Tensor)}
    ref = weakref.ref(call)

    def hook(grad_outputs: Any) -> None:
        found = ref()
        if found is not None:
            found.check_inputs()

    nodes = {
        id(t.grad_fn): t.grad_fn
        for _, t in iter_tensors(out)
        if t.grad_fn is not None and id(t) not in inputs
    }
    for node in nodes.values():
        node.register_prehook(hook)


_classes: dict[tuple[type, type], type] = {}


def wrapped_class(mixin: type, base: type) -> type:
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
    """The plan entries :func:`~autoremat.wrap.apply` wrapped in ``model``, in ``named_modules``
    order: module paths, and ``path[i:j]`` for runs of a Sequential's children."""
    found: list[str] = []
    for p, m in model.named_modules():
        chosen = chosen_calls(m)
        if isinstance(m, Checkpointed) and chosen is not None:
            found += [call_entry(p, k) for k in sorted(chosen.chosen)]
        elif isinstance(m, Checkpointed):
            found.append(p)
        elif isinstance(m, CheckpointedRuns):
            found += [run_entry(p, i, j) for i, j in m.__dict__[RUNS_ATTR]]
    return tuple(found)


def selective_paths(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The entries :func:`~autoremat.wrap.apply` wrapped selectively (modules, calls ``path@k``),
    with the ops whose outputs they keep."""
    found: dict[str, tuple[str, ...]] = {}
    for p, m in model.named_modules():
        if not isinstance(m, Checkpointed):
            continue
        chosen = chosen_calls(m)
        if chosen is not None:
            found |= {call_entry(p, k): fn.args[0] for k, fn in sorted(chosen.chosen.items()) if fn}
        elif m.__dict__.get(CONTEXT_ATTR) is not None:
            found[p] = m.__dict__[CONTEXT_ATTR].args[0]
    return found

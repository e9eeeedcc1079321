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
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes as _no_dispatch_modes
from torch.utils.checkpoint import CheckpointError, checkpoint

from autoremat import huggingface, selective
from autoremat.classes import BASE_ATTR, is_wrapped
from autoremat.entries import covered, inside, parse_run, run_entry
from autoremat.nested import iter_tensors

__all__ = [
    "Checkpointed",
    "CheckpointedRuns",
    "apply",
    "remove",
    "selective_paths",
    "wrapped_paths",
]

_PATH_ATTR = "_autoremat_path"
_RUNS_ATTR = "_autoremat_runs"
_SAVE_ATTR = "_autoremat_save_ops"


class Wrapped(nn.Module):
    """Base of the two mixins :func:`apply` puts in front of a module's own class."""

    _autoremat_base: type[nn.Module]


class Checkpointed(Wrapped):
    """Mixin placed in front of a module's own class by :func:`apply` (claim 4).

    ``forward`` runs the module's own ``forward`` through ``torch.utils.checkpoint.checkpoint``
    when gradients are enabled, and directly otherwise (nothing would be stored for backward).
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        own_forward = functools.partial(type(self)._autoremat_base.forward, self)
        if not torch.is_grad_enabled():
            return own_forward(*args, **kwargs)
        path = self.__dict__.get(_PATH_ATTR, "")
        save_ops = self.__dict__.get(_SAVE_ATTR)
        return _checkpoint(path, [self], own_forward, args, kwargs, save_ops)


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
    save_ops: tuple[str, ...] | None = None,
) -> Any:
    """``checkpoint(fn, *args, **kwargs)``, non-reentrant, with the recompute guarded; with
    ``save_ops``, selective (the outputs of those ops are kept, the rest recomputed)."""
    extra: dict[str, Any] = {}
    if save_ops is not None:
        extra["context_fn"] = selective.context_fn(save_ops)
    if torch.compiler.is_compiling():
        return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)
    call = _Call(label, owners)

    def run_forward(*a: Any) -> Any:
        """The wrapper function: the split point's own forward, guarded on recompute. The
        keyword arguments arrive as the last positional one (see below)."""
        *pos, k = a
        if call.first:
            return call.first_run(fn, tuple(pos), k)
        return call.recompute(fn, tuple(pos), k)

    # The keyword arguments travel as one positional dict: checkpoint saves and replays the
    # CUDA RNG state only of the devices of the tensors among its positional arguments, so a
    # module given its tensors by keyword (Hugging Face Llama's self_attn) would draw other
    # dropout masks in the recompute than in the forward on a GPU.
    return checkpoint(
        run_forward, *args, kwargs, use_reentrant=False, preserve_rng_state=True, **extra
    )


class _Call:
    """One checkpointed call: tells the forward from its recomputes."""

    __slots__ = ("first", "label", "owners", "signature")

    def __init__(self, label: str, owners: list[nn.Module]) -> None:
        self.label = label
        self.owners = owners
        self.first = True
        self.signature: list[tuple[str, int, tuple[int, ...], int]] = []

    def first_run(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.first = False
        self.signature = _state_signature(args, kwargs)
        return fn(*args, **kwargs)

    def recompute(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        now = _state_signature(args, kwargs)
        if now != self.signature:
            raise CheckpointError(self._changed_message(now))
        # Kernels such as batch_norm update running statistics without bumping the tensor's
        # version counter, so compare values: put back every buffer the recompute changed.
        # (outside any dispatch mode: selective checkpointing's would take these copies for
        # ops of the recompute)
        with _no_dispatch_modes():
            saved = [
                (b, b.detach().clone())
                for m in self.owners
                for b in m.buffers()
                if b.device.type != "meta"
            ]
        try:
            return fn(*args, **kwargs)
        finally:
            with torch.no_grad(), _no_dispatch_modes():
                for buffer, value in saved:
                    if not torch.equal(buffer, value):
                        buffer.copy_(value)

    def _changed_message(self, now: list[tuple[str, int, tuple[int, ...], int]]) -> str:
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


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


def _state_signature(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[str, int, tuple[int, ...], int]]:
    """Identity, shape and version of every tensor reachable from the inputs, also inside
    plain objects (a key/value cache), up to a small depth.

    Positional tensors are left out: checkpoint saves those itself and checks their version
    when it gives them back, or saved-tensor hooks (``torch.autograd.graph.save_on_cpu``)
    give back another object holding the value they packed. Depth 6 reaches the tensors of a
    Hugging Face ``EncoderDecoderCache`` (cache -> DynamicCache -> layers -> layer -> keys).
    """
    own = {f"inputs[0][{i}]" for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    return [
        (where, id(t), tuple(t.shape), _version(t))
        for where, t in iter_tensors((args, kwargs), "inputs", objects=True, depth=6)
        if where not in own
    ]


_classes: dict[tuple[type, type], type] = {}


def _wrapped_class(mixin: type, base: type) -> type:
    """``Checkpointed<Base>`` (or ``CheckpointedRuns<Base>``): a wrapped module's class, made
    once per pair."""
    if (mixin, base) not in _classes:
        _classes[mixin, base] = type(
            f"{mixin.__name__}{base.__name__}",
            (mixin, base),
            {BASE_ATTR: base, "__module__": __name__},
        )
    return _classes[mixin, base]


def wrapped_paths(model: nn.Module) -> tuple[str, ...]:
    """The plan entries :func:`apply` wrapped in ``model``, in ``named_modules`` order: module
    paths, and ``path[i:j]`` for runs of a Sequential's children."""
    found: list[str] = []
    for p, m in model.named_modules():
        if isinstance(m, Checkpointed):
            found.append(p)
        elif isinstance(m, CheckpointedRuns):
            found += [run_entry(p, i, j) for i, j in m.__dict__[_RUNS_ATTR]]
    return tuple(found)


def selective_paths(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The modules :func:`apply` wrapped selectively, with the ops whose outputs they keep."""
    return {
        p: m.__dict__[_SAVE_ATTR]
        for p, m in model.named_modules()
        if isinstance(m, Checkpointed) and m.__dict__.get(_SAVE_ATTR) is not None
    }


def apply(
    model: nn.Module,
    paths: Sequence[str],
    *,
    selective: Sequence[str] | Mapping[str, Sequence[str]] = (),
    save_ops: Sequence[str] = selective.DEFAULT_SAVE_OPS,
) -> nn.Module:
    """Wrap the plan entries ``paths`` of ``model`` in place; return ``model``.

    An entry is a module's qualified name (as in ``model.named_modules()``), or ``path[i:j]``:
    the run of children ``i..j-1`` of the plain ``nn.Sequential`` at ``path``, recomputed as
    one (:mod:`autoremat.entries`). The entries also in ``selective`` (module paths, not runs)
    are recomputed selectively: the outputs of the ops in ``save_ops`` are kept from the
    forward, the other ops run again (:mod:`autoremat.selective`); ``selective`` may also map
    each such entry to its own ops (``{"h.0": ("aten.mm", "aten.addmm")}``, as
    :attr:`autoremat.Plan.selective` does), and then ``save_ops`` is not used. Nothing is
    changed when the call raises. Applying the same entries to a model that already has them
    wrapped is a no-op.

    Raises:
        ValueError: an entry names no module of ``model`` (the message lists them), or a run
            that is not inside a plain ``nn.Sequential``; one entry is inside another (the
            recomputes would nest); the model already has other entries wrapped (call
            :func:`remove` first); or a module cannot be wrapped (a ``torch.jit.ScriptModule``,
            or one whose ``forward`` was replaced on the instance); a ``selective`` entry
            not in ``paths`` or a run; a ``save_ops`` name not of the form ``"aten.mm"``.
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
            f"{type(model).__name__} already has {len(already)} wrapped modules from another "
            f"plan; call autoremat.remove(model) before applying a new one"
        )
    chosen = sorted(set(paths))
    _check_not_nested(chosen)
    runs = _runs_by_parent(chosen, modules)
    for e in chosen:
        if parse_run(e) is None:
            m = modules[e]
            m.__class__ = _wrapped_class(Checkpointed, type(m))
            m.__dict__[_PATH_ATTR] = e
            if e in wanted_selective:
                m.__dict__[_SAVE_ATTR] = wanted_selective[e]
    for parent, spans in runs.items():
        seq = modules[parent]
        seq.__class__ = _wrapped_class(CheckpointedRuns, type(seq))
        seq.__dict__[_PATH_ATTR] = parent
        seq.__dict__[_RUNS_ATTR] = tuple(sorted(spans))
    if chosen:
        huggingface.turn_cache_off_in_training(model)
    return model


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
            f"selective entries must be module paths among the plan's entries: "
            f"{', '.join(map(repr, odd[:5]))} {'is' if len(odd) == 1 else 'are'} not"
        )
    return found


def _check_present(model: nn.Module, paths: Sequence[str], modules: dict[str, nn.Module]) -> None:
    def module_of(entry: str) -> str:
        run = parse_run(entry)
        return entry if run is None else run[0]

    missing = [e for e in paths if module_of(e) not in modules]
    if missing:
        raise ValueError(
            f"the plan names modules that {type(model).__name__} does not have: "
            f"{', '.join(map(repr, missing[:5]))}{' ...' if len(missing) > 5 else ''}; "
            f"make the plan from this model (autoremat.plan(model, ...))"
        )


def _check_not_nested(chosen: list[str]) -> None:
    covers = {e: covered(e) for e in chosen}
    for a, b in itertools.combinations(chosen, 2):
        for x in covers[a]:
            for y in covers[b]:
                if inside(x, y) or inside(y, x):
                    inner, outer = (a, b) if inside(x, y) else (b, a)
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
            _check_wrappable(e, modules[e])
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
    unchanged (a no-op, not an error).

    Raises:
        ValueError: a wrapped module had its class swapped again after :func:`apply` (as
            ``torch.distributed.fsdp.fully_shard`` does to each module it shards, making
            ``FSDPCheckpointed<Cls>``); the message names it. Nothing is changed then.
    """
    for m in model.modules():
        if is_wrapped(m) and BASE_ATTR not in type(m).__dict__:
            raise ValueError(
                f"module {m.__dict__.get(_PATH_ATTR)!r} had its class changed again after "
                f"autoremat wrapped it ({type(m).__name__}, e.g. by fully_shard); autoremat "
                f"cannot undo its wrap under that class, and changed nothing: undo the other "
                f"change first, or rebuild the model"
            )
    for m in model.modules():
        if is_wrapped(m):
            m.__class__ = type(m).__dict__[BASE_ATTR]
            m.__dict__.pop(_PATH_ATTR, None)
            m.__dict__.pop(_RUNS_ATTR, None)
            m.__dict__.pop(_SAVE_ATTR, None)
    huggingface.remove_cache_hooks(model)
    return model

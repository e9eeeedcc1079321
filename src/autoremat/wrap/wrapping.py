"""Wrapping a model's plan entries in place, all or nothing, and unwrapping it again
(:func:`apply`, :func:`remove`); what the wrapped classes do is :mod:`autoremat.wrap.checkpointed`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from autoremat.core import huggingface, selective
from autoremat.core.classes import (
    BASE_ATTR,
    SWITCHED_OFF_ATTR,
    is_wrapped,
    pickle_as_plain,
    stop_pickling_as_plain,
)
from autoremat.core.entries import first_nested, module_of, parse_call, parse_run
from autoremat.core.own_checkpointing import switched_on, turned_off_message
from autoremat.core.selective import context_fn as selective_context
from autoremat.record.snapshot import UndoLog, all_or_nothing
from autoremat.wrap.calls import ATTR as CALLS_ATTR
from autoremat.wrap.calls import ChosenCalls, add_new_step_hook, remove_new_step_hooks
from autoremat.wrap.checkpointed import (
    CONTEXT_ATTR,
    PATH_ATTR,
    RUNS_ATTR,
    Checkpointed,
    CheckpointedRuns,
    selective_paths,
    wrapped_class,
    wrapped_paths,
)

__all__ = ["Change", "apply", "remove", "unwrappable_reason"]

logger = logging.getLogger(__name__)

# one module to wrap: (path, module, its wrapped class, autoremat's instance attributes)
Change = tuple[str, nn.Module, type, dict[str, Any]]


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
    one (:mod:`autoremat.core.entries`). The entries also in ``selective`` (module paths, not runs)
    are recomputed selectively: the outputs of the ops in ``save_ops`` are kept from the
    forward, the other ops run again (:mod:`autoremat.core.selective`); ``selective`` may also map
    each such entry to its own ops (``{"h.0": ("aten.mm", "aten.addmm")}``, as
    :attr:`autoremat.Plan.selective` does), and then ``save_ops`` is not used. Applying the
    same entries to a model that already has them wrapped is a no-op.

    A call entry ``path@k`` recomputes only the ``k``-th call of the module in each forward
    of ``model`` (:mod:`autoremat.wrap.calls`: a pre-hook on ``model`` counts the calls afresh
    each forward); ``calls`` maps such a module's path to the number of calls the plan was
    made for, so that a forward with another number warns (:attr:`autoremat.Plan.calls`).

    Hugging Face-style modules are called with ``use_cache=False`` while training with
    gradients, with entries or without (:mod:`autoremat.core.huggingface`): plans are priced on
    that step.

    All or nothing: every entry is checked and every wrapped class made before any module
    changes; when changing them fails half-way, every module gets back its class, attributes
    and hooks (:func:`autoremat.record.snapshot.all_or_nothing`) before the error goes on.

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
        _switch_off_own_checkpointing(model, log)


def _switch_off_own_checkpointing(model: nn.Module, log: UndoLog) -> None:
    """Turn the model's own activation checkpointing off (the plan's recompute replaces it),
    each module remembering its switches for :func:`remove`; one warning says so."""
    found = switched_on(model)
    log.keep(dict.fromkeys((path, m) for path, m, _ in found))
    for path, m, name in found:
        log.set_attribute(path, m, name, False)
        switches = (*m.__dict__.get(SWITCHED_OFF_ATTR, ()), name)
        log.set_attribute(path, m, SWITCHED_OFF_ATTR, switches)
        pickle_as_plain(m)  # a pickle holds the model as it was: its checkpointing on
    if found:
        how = "while the plan is applied (autoremat.remove turns it back on)"
        paths = [p for p, _, _ in found]
        logger.warning("%s", turned_off_message(model, paths, how))


def _switch_own_checkpointing_back_on(model: nn.Module, log: UndoLog) -> None:
    """Undo :func:`_switch_off_own_checkpointing`."""
    for path, m in model.named_modules():
        if SWITCHED_OFF_ATTR not in m.__dict__:
            continue
        log.keep([(path, m)])
        for name in m.__dict__[SWITCHED_OFF_ATTR]:
            log.set_attribute(path, m, name, True)
        log.set_attribute(path, m, SWITCHED_OFF_ATTR)
        stop_pickling_as_plain(m)


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
        own: dict[str, Any] = {PATH_ATTR: path}
        own[CALLS_ATTR] = ChosenCalls(path, picked, calls.get(path))
        changes.append((path, m, _class_for(path, Checkpointed, m), own))
    for e in chosen:
        if parse_run(e) is None and parse_call(e) is None:
            m = modules[e]
            attributes: dict[str, Any] = {PATH_ATTR: e}
            if e in wanted_selective:
                attributes[CONTEXT_ATTR] = selective_context(wanted_selective[e])
            changes.append((e, m, _class_for(e, Checkpointed, m), attributes))
    for parent, spans in runs.items():
        seq = modules[parent]
        attributes = {PATH_ATTR: parent, RUNS_ATTR: tuple(sorted(spans))}
        changes.append((parent, seq, _class_for(parent, CheckpointedRuns, seq), attributes))
    return changes


def _class_for(path: str, mixin: type, m: nn.Module) -> type:
    """:func:`wrapped_class` for the module at ``path``. Making it fails when the module's
    class refuses subclasses through its metaclass, or cannot be combined with ``mixin``: a
    ``ValueError`` naming the module and the fix, raised before anything changed."""
    try:
        return wrapped_class(mixin, type(m))
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
                f"module {m.__dict__.get(PATH_ATTR)!r} had its class changed again after "
                f"autoremat wrapped it ({type(m).__name__}, e.g. by fully_shard); autoremat "
                f"cannot undo its wrap under that class, and changed nothing: undo the other "
                f"change first, or rebuild the model"
            )
    with all_or_nothing() as log:
        for path, m in model.named_modules():
            if is_wrapped(m):
                log.set_class(path, m, type(m).__dict__[BASE_ATTR])
                for name in (PATH_ATTR, RUNS_ATTR, CONTEXT_ATTR, CALLS_ATTR):
                    if name in m.__dict__:
                        log.set_attribute(path, m, name)
        _switch_own_checkpointing_back_on(model, log)
        log.keep([("", model)])
        remove_new_step_hooks(model)
        log.keep(huggingface.cache_modules(model))
        huggingface.remove_cache_hooks(model)
    return model

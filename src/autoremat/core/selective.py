"""Selective recompute: which ops' outputs a selectively recomputed module keeps.

A module recomputed *selectively* runs through ``torch.utils.checkpoint.checkpoint`` with
``context_fn=create_selective_checkpoint_contexts(policy)``: the outputs of the ops named in its
plan's ``save_ops`` (by default the expensive ones: matrix products, convolutions, attention
kernels) are kept from the forward in the checkpoint's own cache, and every other op (pointwise
ops, normalisations, softmax, dropout) is run again in backward. The recompute then costs
almost no FLOPs, and the memory kept is what those ops wrote.

Ops are named as ``torch.ops`` spells them without the overload, ``"aten.mm"``. The kept outputs
live outside autograd's saved tensors (``saved_tensors_hooks`` does not see them); the memory
tracker of :mod:`autoremat.record.memory` does, and the profile prices them
(:mod:`autoremat.costs`).
"""

from __future__ import annotations

import functools
import re
import reprlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = [
    "BATCHED_MATMUL_OPS",
    "DEFAULT_SAVE_OPS",
    "FULL",
    "WAYS",
    "check_names",
    "context_fn",
    "draws_random",
    "keeps",
    "op_name",
    "ops_on",
    "resolve",
]

# The expensive ops: their outputs are kept, everything else is recomputed.
DEFAULT_SAVE_OPS: tuple[str, ...] = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten.convolution",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
)

# Batched matrix products: in unfused attention, the T x T scores (q @ k^T) and the weighted
# values (probs @ v); rarely a product with parameters.
BATCHED_MATMUL_OPS: tuple[str, ...] = ("aten.bmm", "aten.baddbmm")

# The ways a module can be recomputed besides whole ("full"): selectively, keeping the outputs
# of these ops. "selective" keeps every expensive op; "selective-bmm" recomputes the batched
# matrix products too (Megatron's selective recompute of the attention core: the T x T scores,
# their softmax and dropout are recomputed, the projections kept), which frees more for a few
# more FLOPs. A way is named the same in the profile, the solver, the plan and its JSON.
FULL = "full"
WAYS: dict[str, tuple[str, ...]] = {
    "selective": DEFAULT_SAVE_OPS,
    "selective-bmm": tuple(op for op in DEFAULT_SAVE_OPS if op not in BATCHED_MATMUL_OPS),
}


def op_name(func: Any) -> str:
    """``"aten.mm"`` for ``torch.ops.aten.mm.default``."""
    packet = getattr(func, "overloadpacket", func)
    return f"{packet._qualified_op_name.replace('::', '.')}"


# An op name: "namespace.op", both Python identifiers (as torch.ops spells them).
_OP_NAME = re.compile(r"[A-Za-z_]\w*\.[A-Za-z_]\w*", re.ASCII)


class _Dispatcher:
    """The ops torch's dispatcher has (``"aten.mm"``), and their namespaces, read from
    ``torch._C._dispatch_get_all_op_names()`` without touching ``torch.ops`` (whose
    ``getattr`` creates a namespace for any name). Read again on a miss: libraries of custom
    ops register theirs when they are imported."""

    def __init__(self) -> None:
        self.ops: frozenset[str] = frozenset()
        self.namespaces: frozenset[str] = frozenset()

    def read(self) -> None:
        self.ops = frozenset(
            name.partition(".")[0].replace("::", ".")
            for name in torch._C._dispatch_get_all_op_names()
        )
        self.namespaces = frozenset(op.partition(".")[0] for op in self.ops)

    def has_op(self, name: str) -> bool:
        if name not in self.ops:
            self.read()
        return name in self.ops

    def has_namespace(self, namespace: str) -> bool:
        if namespace not in self.namespaces:
            self.read()
        return namespace in self.namespaces


_dispatcher = _Dispatcher()


def _check_form(name: str) -> None:
    if not _OP_NAME.fullmatch(name):
        raise ValueError(
            f"save_ops entry {name[:80]!r} is not an op name such as 'aten.mm' "
            f"(namespace.op, without the overload)"
        )


@functools.cache
def resolve(names: tuple[str, ...]) -> frozenset[Any]:
    """The op packets named by ``names`` (``"aten.mm"``); names this build of torch does not
    have are skipped (attention kernels differ between builds). Only ops the dispatcher has
    are looked up in ``torch.ops``, so an unknown name creates nothing there.

    Raises:
        ValueError: a name is not of the form ``"namespace.op"`` (Python identifiers).
    """
    for name in names:
        _check_form(name)
    found = set()
    for name in names:
        if _dispatcher.has_op(name):
            namespace, _, op = name.partition(".")
            try:
                found.add(getattr(getattr(torch.ops, namespace), op))
            except (AttributeError, RuntimeError):  # a library's op, since deregistered
                continue
    return frozenset(found)


def check_names(names: Iterable[str], *, strict: bool = False) -> tuple[str, ...]:
    """``names`` as a tuple, each checked by :func:`resolve`.

    With ``strict`` (the plan loader, :mod:`autoremat.planning.plan_json`), nothing is looked up in
    ``torch.ops`` (no side effects): each name must be of the form ``"namespace.op"`` and its
    namespace one this build of torch has ops in (``"os.system"`` is refused); an op the
    namespace lacks is accepted, as :func:`resolve` skips it (a plan made with another build).

    Raises:
        TypeError: ``names`` is a string or holds a non-string (``ValueError`` with
            ``strict``).
        ValueError: a name is malformed; with ``strict``, also a namespace torch lacks.
    """
    if not isinstance(names, str):
        names = tuple(names)
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        error = ValueError if strict else TypeError
        shown = reprlib.repr(names)
        raise error(f"save_ops must be a sequence of op names such as 'aten.mm', got {shown}")
    names = tuple(names)
    if not strict:
        resolve(names)
        return names
    for name in names:
        _check_form(name)
        namespace = name.partition(".")[0]
        if not _dispatcher.has_namespace(namespace):
            raise ValueError(
                f"save_ops entry {name[:80]!r} names no op namespace of this build of torch "
                f"({namespace[:40]!r}); name ops as torch.ops does, such as 'aten.mm'"
            )
    return names


# The dispatch keys of an op's kernels that run on any device.
_COMPOSITE = ("CompositeImplicitAutograd", "CompositeExplicitAutograd")


def ops_on(names: Sequence[str], device_type: str | None) -> tuple[str, ...]:
    """The ops among ``names`` that have a kernel for ``device_type`` (``"cpu"``, ``"cuda"``)
    or one for every device in this build of torch: what a selective recompute on that
    device can keep (the CUDA attention kernels are in the default list, and never run on a
    CPU). All of ``names`` for ``None`` or ``"meta"`` (the target device is not known)."""
    if device_type in (None, "meta"):
        return tuple(names)
    keys = (device_type.upper(), *_COMPOSITE)
    return tuple(
        n
        for n in names
        if any(
            torch._C._dispatch_has_kernel_for_dispatch_key(n.replace(".", "::", 1), k)
            for k in keys
        )
    )


def draws_random(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call of ``func`` draws random numbers: an op tagged
    ``nondeterministic_seeded``, unless it has a ``dropout_p`` argument and it is 0 (attention
    kernels are tagged whether or not they drop anything)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            if arg.name in kwargs:
                p = kwargs[arg.name]
            elif i < len(args):
                p = args[i]
            else:
                p = arg.default_value
            return bool(p)
    return True


def keeps(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], packets: frozenset) -> bool:
    """Whether a selective recompute keeps this op call's outputs: the op is one of
    ``packets`` and draws no random numbers.

    An op that draws random numbers is always recomputed: checkpoint replays the RNG state
    from the start of the module, so if such an op were skipped in the recompute, every random
    op after it would draw other numbers than in the forward (an attention kernel with
    dropout, kept, would shift the dropout masks after it: wrong gradients on CUDA).
    """
    return func.overloadpacket in packets and not draws_random(func, args, kwargs)


def context_fn(save_ops: Sequence[str]) -> functools.partial[tuple[Any, Any]]:
    """The ``context_fn`` for ``checkpoint`` that keeps the outputs of ``save_ops`` (except
    calls that draw random numbers, see :func:`keeps`) and recomputes the rest.

    It is a ``functools.partial`` of a module-level function with the op names as a tuple of
    strings, carrying a ``cache_hash``: that is the form ``torch.compile`` accepts (dynamo
    refuses closures, "checkpoint not implemented for NestedUserFunctionVariable context_fn"),
    and AOTAutograd's cache keys on the hash. Make it once, outside compiled code (the wrap
    keeps it on the module), so dynamo reads it as a constant.

    Its recompute context empties the cache when the recompute ends. Checkpoint's early stop
    ends a recompute once every tensor backward needs is back, so the kept outputs of the ops
    after that (the output of the module's last matmul, typically) are never taken out of the
    cache, which would otherwise hold them until the autograd graph is freed, after the whole
    backward. A second recompute (a second backward) then recomputes every op."""
    names = check_names(save_ops)
    made = functools.partial(_contexts, names)
    made.cache_hash = ("autoremat.core.selective", names)  # type: ignore[attr-defined]
    return made


def _policy(packets: frozenset[Any], ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    if keeps(func, args, kwargs, packets):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _contexts(names: tuple[str, ...]) -> tuple[Any, Any]:
    """Selective checkpointing's forward and recompute modes for ``names``, the recompute one
    emptying its cache on exit."""
    policy = functools.partial(_policy, resolve(names))
    forward, recompute = create_selective_checkpoint_contexts(policy)
    mode = type(recompute)
    if mode not in _emptying_classes:
        _emptying_classes[mode] = _emptying(mode)
    recompute.__class__ = _emptying_classes[mode]
    recompute.keep_packets = resolve(names)
    return forward, recompute


_emptying_classes: dict[type, type] = {}


def _emptying(mode: Any) -> type:
    """``mode`` (selective checkpointing's recompute mode) whose cache is emptied on exit, and
    which recomputes every op once it has served a recompute. An op it keeps not is run when
    torch's storage has no entry for it: under autocast a module called several times casts a
    weight only in its first call's forward (autocast caches the cast) but in every recompute,
    and torch would raise "invocation index ... not found in storage".

    A second recompute of the same forward (a second backward: ``retain_graph=True`` twice,
    or a gradient penalty, ``create_graph=True``, whose second backward recomputes again)
    finds the cache empty; torch would raise ("not found in storage", or "Trying to backward
    an extra time"). Instead it then runs the kept ops too: they draw no random numbers
    (:func:`keeps`) and their inputs are recomputed exactly, so their outputs are the
    forward's, and the second backward is what it would have been unwrapped, at the cost of a
    full recompute."""

    class Emptying(mode):
        served = False
        keep_packets: frozenset[Any] = frozenset()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            if self.served:
                return func(*args, **(kwargs or {}))
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            except RuntimeError as exc:
                # An op the forward did not run as often (autocast's cast cache: a weight cast
                # once per forward, again in each recompute) is recomputed anyway unless kept.
                kept = keeps(func, args, kwargs or {}, self.keep_packets)
                if kept or "not found in storage" not in str(exc):
                    raise
                return func(*args, **(kwargs or {}))

        def __exit__(self, *exc: Any) -> Any:
            try:
                return super().__exit__(*exc)
            finally:
                self.storage.clear()
                self.served = True

    Emptying.__name__ = Emptying.__qualname__ = f"Emptying{mode.__name__}"
    return Emptying

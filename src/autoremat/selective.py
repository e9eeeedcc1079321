"""Selective recompute: which ops' outputs a selectively recomputed module keeps.

A module recomputed *selectively* runs through ``torch.utils.checkpoint.checkpoint`` with
``context_fn=create_selective_checkpoint_contexts(policy)``: the outputs of the ops named in its
plan's ``save_ops`` (by default the expensive ones: matrix products, convolutions, attention
kernels) are kept from the forward in the checkpoint's own cache, and every other op (pointwise
ops, normalisations, softmax, dropout) is run again in backward. The recompute then costs
almost no FLOPs, and the memory kept is what those ops wrote.

Ops are named as ``torch.ops`` spells them without the overload, ``"aten.mm"``. The kept outputs
live outside autograd's saved tensors (``saved_tensors_hooks`` does not see them); the memory
tracker of :mod:`autoremat.memory` does, and the profile prices them (:mod:`autoremat.costs`).
"""

from __future__ import annotations

import functools
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


@functools.cache
def resolve(names: tuple[str, ...]) -> frozenset[Any]:
    """The op packets named by ``names`` (``"aten.mm"``); names this build of torch does not
    have are skipped (attention kernels differ between builds).

    Raises:
        ValueError: a name is not of the form ``"namespace.op"``.
    """
    found = set()
    for name in names:
        namespace, _, op = name.partition(".")
        if not namespace or not op or "." in op:
            raise ValueError(
                f"save_ops entry {name!r} is not an op name such as 'aten.mm' "
                f"(namespace.op, without the overload)"
            )
        try:
            found.add(getattr(getattr(torch.ops, namespace), op))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(found)


def check_names(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` as a tuple, each checked by :func:`resolve`."""
    if not isinstance(names, str):
        names = tuple(names)
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"save_ops must be a sequence of op names such as 'aten.mm', got {names!r}")
    names = tuple(names)
    resolve(names)
    return names


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


def context_fn(save_ops: Sequence[str]) -> Any:
    """The ``context_fn`` for ``checkpoint`` that keeps the outputs of ``save_ops`` (except
    calls that draw random numbers, see :func:`keeps`) and recomputes the rest.

    Its recompute context empties the cache when the recompute ends. Checkpoint's early stop
    ends a recompute once every tensor backward needs is back, so the kept outputs of the ops
    after that (the output of the module's last matmul, typically) are never taken out of the
    cache, which would otherwise hold them until the autograd graph is freed, after the whole
    backward. Nothing else reads the cache: a second backward through a selectively
    checkpointed module is an error either way."""
    packets = resolve(tuple(save_ops))

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if keeps(func, args, kwargs, packets):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def contexts() -> tuple[Any, Any]:
        forward, recompute = create_selective_checkpoint_contexts(policy)
        mode = type(recompute)
        if mode not in _emptying_classes:
            _emptying_classes[mode] = _emptying(mode)
        recompute.__class__ = _emptying_classes[mode]
        return forward, recompute

    return contexts


_emptying_classes: dict[type, type] = {}


def _emptying(mode: Any) -> type:
    """``mode`` (selective checkpointing's recompute mode) whose cache is emptied on exit."""

    class Emptying(mode):
        def __exit__(self, *exc: Any) -> Any:
            try:
                return super().__exit__(*exc)
            finally:
                self.storage.clear()

    Emptying.__name__ = Emptying.__qualname__ = f"Emptying{mode.__name__}"
    return Emptying

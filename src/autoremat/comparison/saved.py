"""The bytes a training step keeps from the forward for backward, as autograd sees them: the one
figure on which eager and compiled models (selective recompute included) compare directly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autoremat.comparison.applied import Args, Kwargs
from autoremat.core.nested import iter_tensors, run_model, storage_key
from autoremat.record.snapshot import preserved
from autoremat.record.step import LossFn, default_loss

__all__ = ["saved_by_autograd"]


def saved_by_autograd(
    model: nn.Module,
    args: Args | Any = (),
    kwargs: Kwargs | None = None,
    *,
    loss_fn: LossFn | None = None,
    selective_cache: bool = True,
) -> int:
    """Bytes of the distinct tensor storages autograd saves for backward during the forward
    and the loss of one training step, as packed by
    ``torch.autograd.graph.saved_tensors_hooks``.

    Storages of the model's parameters and buffers and of the input tensors are left out (a
    weight saved for a matmul's backward costs nothing extra), and each storage counts once
    however many tensors view it. The hooks also fire for the tensors a graph compiled by
    ``torch.compile`` saves, so compiled and eager models are measured alike; they do not see
    what a non-reentrant checkpoint recomputes (it stores placeholders).

    They do not see the cache of selective checkpointing either (the op outputs its policy
    keeps for backward, held by ``torch.utils.checkpoint``'s caching dispatch mode): with
    ``selective_cache`` (the default) the storages in those caches count too, each storage
    still once, so that an eager model recomputed selectively is measured on the same basis
    as a compiled one (everything kept from the forward for backward, less parameters and
    inputs). No backward runs; the model is left as found (see
    :func:`autoremat.record.snapshot.preserved`).
    """
    loss_fn = default_loss if loss_fn is None else loss_fn
    known = {
        storage_key(t)
        for t in [*model.parameters(), *model.buffers()]
        + [t for _, t in iter_tensors((args, kwargs))]
    }
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key is not None and key not in known:
            sizes[key] = max(sizes.get(key, 0), t.untyped_storage().nbytes())
        return t

    caches: list[Any] = []
    with preserved(model), torch.enable_grad():
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            _selective_caches(caches) if selective_cache else contextlib.nullcontext(),
        ):
            loss = loss_fn(run_model(model, args, kwargs))
        # the caches hold _VersionWrapper objects: their .val is the tensor kept
        for _, t in iter_tensors(caches, objects=True):
            pack(t)
        del loss, caches
    return sum(sizes.values())


@contextlib.contextmanager
def _selective_caches(caches: list[Any]) -> Iterator[None]:
    """Append to ``caches`` the cache of every selective checkpoint that begins inside: the
    ``storage`` of ``torch.utils.checkpoint._CachingTorchDispatchMode`` (torch 2.4+), where the
    outputs its policy saves are kept (as ``_VersionWrapper``s) until backward. Collects nothing
    on a torch without that class."""
    from torch.utils import checkpoint

    cls = getattr(checkpoint, "_CachingTorchDispatchMode", None)
    if cls is None:  # pragma: no cover - other torch versions
        yield
        return
    original = cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        caches.append(getattr(self, "storage", None))

    cls.__init__ = init
    try:
        yield
    finally:
        cls.__init__ = original

"""How a training job shards the model over its ranks: ``fit(..., world_size=8, sharding="fsdp2")``.

:class:`Sharding` names the strategy and the ranks; the per-rank memory it implies is
:mod:`autoremat.training.per_rank`'s. Two strategies, as ``torch.distributed`` has them:

* ``"ddp"`` (``DistributedDataParallel``): every rank holds the whole model, its gradients and
  the optimizer's whole state, and, from construction on, DDP's gradient buckets: one more copy
  of the trainable parameters' bytes (``gradient_as_bucket_view=False``, the default: the
  buckets and ``.grad`` are separate tensors; measured to the byte, ``tests/test_per_rank.py``);
* ``"fsdp2"`` (``fully_shard`` on each of ``units``, then on the root): each rank holds
  1/``world_size`` of every parameter (dim 0 padded to a multiple of ``world_size``), of the
  gradients and of the optimizer's state; during the step it gathers the unsharded parameters
  of the unit running (and of the one it prefetches) and frees them after
  (``reshard_after_forward=True``) or keeps them from forward to backward (``False``).

``units``: the paths of the modules ``fully_shard`` is called on, the root excluded. By
default (:func:`default_units`) the classes a Hugging Face model names in
``_no_split_modules`` (what transformers and accelerate shard), else the children of the
``nn.ModuleList`` holding the most parameters (a transformer's blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["SHARDINGS", "Sharding", "default_units", "sharding_of"]

SHARDINGS = ("ddp", "fsdp2")


@dataclass(frozen=True)
class Sharding:
    """``strategy`` (``"ddp"`` or ``"fsdp2"``) over ``world_size`` ranks; for FSDP2 the
    ``units`` it shards one by one (paths, the root excluded), ``reshard_after_forward`` and
    ``mp_policy`` (an FSDP2 ``MixedPrecisionPolicy``: ``param_dtype=torch.bfloat16`` gathers
    and computes in bf16 from fp32 shards), as ``fully_shard`` takes them."""

    strategy: str
    world_size: int
    units: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    mp_policy: Any = None

    def __str__(self) -> str:
        text = f"{self.strategy} over {self.world_size} ranks"
        if self.strategy == "fsdp2":
            keep = "" if self.reshard_after_forward else ", reshard_after_forward=False"
            dtype = getattr(self.mp_policy, "param_dtype", None)
            cast = "" if dtype is None else f", parameters in {str(dtype).replace('torch.', '')}"
            text += f" ({len(self.units)} units and the root{keep}{cast})"
        return text


def default_units(model: nn.Module) -> tuple[str, ...]:
    """The modules to ``fully_shard`` one by one (module docstring): the outermost modules
    of a class in the model's ``_no_split_modules``, else the children of its largest
    ``nn.ModuleList``; none when it has neither (then only the root is a unit)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found: list[str] = []
        for path, module in model.named_modules():
            inside = any(path.startswith(f"{unit}.") for unit in found)
            if path and type(module).__name__ in names and not inside:
                found.append(path)
        if found:
            return tuple(found)
    lists = [(sum(p.numel() for p in m.parameters()), path) for path, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m)]  # fmt: skip
    if not lists:
        return ()
    _, path = max(lists)
    children = model.get_submodule(path).named_children()
    return tuple(f"{path}.{name}" if path else name for name, _ in children)


def sharding_of(
    model: nn.Module,
    world_size: int,
    sharding: str | Sharding | None,
    units: tuple[str, ...] | list[str] | None = None,
    reshard_after_forward: bool = True,
) -> Sharding | None:
    """The :class:`Sharding` ``world_size`` ranks and ``sharding`` (a name of
    :data:`SHARDINGS`, or a :class:`Sharding`, returned as it is) give ``model``; ``None``
    for one device (``sharding=None``, ``world_size=1``).

    Raises:
        ValueError: ``world_size`` below 1, or above 1 without a strategy; an unknown
            strategy, or a unit that is not a submodule of ``model`` (named).
    """
    if isinstance(sharding, Sharding):
        return sharding
    if sharding is None:
        if world_size != 1:
            raise ValueError(
                f"world_size={world_size} needs sharding='ddp' or 'fsdp2': how the ranks "
                f"share the model decides what each holds"
            )
        return None
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    if sharding == "ddp":
        return Sharding("ddp", world_size)
    chosen = default_units(model) if units is None else tuple(units)
    paths = {path for path, _ in model.named_modules()}
    missing = [u for u in chosen if u not in paths or not u]
    if missing:
        raise ValueError(
            f"fsdp2 units {missing} are not submodules of {type(model).__name__}: name the "
            f"modules fully_shard is called on, by path (the root is always a unit)"
        )
    return Sharding("fsdp2", world_size, chosen, reshard_after_forward)

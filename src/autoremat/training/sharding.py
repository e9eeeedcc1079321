"""How a training job shards the model over its ranks: ``sharding=Sharding("fsdp2", 8)``.

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

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["SHARDINGS", "Sharding", "default_units", "sharding_of"]

logger = logging.getLogger(__name__)

SHARDINGS = ("ddp", "fsdp2")


@dataclass(frozen=True)
class Sharding:
    """``strategy`` (``"ddp"`` or ``"fsdp2"``) over ``world_size`` ranks; for FSDP2 the
    ``units`` it shards one by one (paths, the root excluded; ``None``: the model's blocks,
    :func:`default_units`), ``reshard_after_forward`` and ``mp_policy`` (an FSDP2
    ``MixedPrecisionPolicy``: ``param_dtype=torch.bfloat16`` gathers and computes in bf16
    from fp32 shards), as ``fully_shard`` takes them.

    Raises:
        ValueError: an unknown strategy, ``world_size`` not a whole number >= 1, FSDP2's
            settings given for DDP, an ``mp_policy`` that is not a ``MixedPrecisionPolicy``.
    """

    strategy: str
    world_size: int
    units: tuple[str, ...] | None = None
    reshard_after_forward: bool = True
    mp_policy: Any = None

    def __post_init__(self) -> None:
        if self.strategy not in SHARDINGS:
            raise ValueError(
                f"sharding must be one of {', '.join(SHARDINGS)}, got {self.strategy!r}"
            )
        _check_world(self.world_size)
        if self.units is not None:
            object.__setattr__(self, "units", tuple(self.units))
        fsdp_only = self.units is not None or not self.reshard_after_forward or self.mp_policy
        if self.strategy == "ddp" and fsdp_only:
            raise ValueError(
                "units, reshard_after_forward and mp_policy are FSDP2's settings: DDP keeps "
                "the whole model on every rank; drop them, or use sharding='fsdp2'"
            )
        if self.mp_policy is not None and not hasattr(self.mp_policy, "param_dtype"):
            raise ValueError(
                f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
                f"{type(self.mp_policy).__name__}"
            )

    def __str__(self) -> str:
        ranks = "rank" if self.world_size == 1 else "ranks"
        text = f"{self.strategy} over {self.world_size} {ranks}"
        if self.strategy == "fsdp2":
            keep = "" if self.reshard_after_forward else ", reshard_after_forward=False"
            dtype = getattr(self.mp_policy, "param_dtype", None)
            cast = "" if dtype is None else f", parameters in {str(dtype).replace('torch.', '')}"
            count = len(self.units or ())
            units = f"{count} unit{'s' * (count != 1)} and the root" if count else "the root only"
            text += f" ({units}{keep}{cast})"
        return text


def _check_world(world_size: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")


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


def sharding_of(model: nn.Module, sharding: Sharding | None) -> Sharding | None:
    """``sharding`` for ``model``, its FSDP2 units checked (and, when not given, its blocks);
    ``None`` for one device. Warns when FSDP2 finds no block to shard.

    Raises:
        TypeError: ``sharding`` is not a :class:`Sharding` (a strategy's name alone does not
            say how many ranks share the model).
        ValueError: a unit that is not a submodule of ``model`` (named).
    """
    if sharding is None:
        return None
    if not isinstance(sharding, Sharding):
        raise TypeError(
            f"sharding must be an autoremat.Sharding, such as Sharding('fsdp2', world_size=8), "
            f"or None for one device; got {sharding!r}: the number of ranks decides what "
            f"each holds"
        )
    return _with_units(model, sharding)


def _with_units(model: nn.Module, spec: Sharding) -> Sharding:
    """``spec`` with FSDP2's units checked against ``model``, its blocks when not given."""
    if spec.strategy != "fsdp2":
        return spec
    chosen = default_units(model) if spec.units is None else spec.units
    paths = {path for path, _ in model.named_modules()}
    missing = [u for u in chosen if u not in paths or not u]
    if missing:
        raise ValueError(
            f"fsdp2 units {missing} are not submodules of {type(model).__name__}: name the "
            f"modules fully_shard is called on, by path (the root is always a unit)"
        )
    if not chosen:
        logger.warning(
            "fsdp2: %s has no blocks to shard one by one (no _no_split_modules, no "
            "nn.ModuleList): only the root is a unit, gathered whole for the step; name the "
            "modules you fully_shard with Sharding(..., units=[...]) (--fsdp-units)",
            type(model).__name__,
        )
    return dataclasses.replace(spec, units=tuple(chosen))

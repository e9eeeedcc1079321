"""Using a plan in data-parallel training (DDP, FSDP2): make it on one rank, send it to all.

Every rank must wrap the same modules. Under FSDP2 (``torch.distributed.fsdp.fully_shard``)
a recomputed module that contains sharded modules calls their forward again in backward, and
their pre-forward hooks all-gather their parameters then; a rank without that recompute
all-gathers them at other points of the backward, so the ranks' collectives no longer match
(on gloo with 2 ranks, the step hung when only rank 0 recomputed the root). Under DDP,
different plans gave the same gradients, but each rank would use other memory. Planning on
every rank does not make the plans equal: ranks see different data, and a budget plan depends
on the profile of the batch it ran on. So make the plan once, on one rank, and send it to the
others with :func:`broadcast_plan`.

.. note::
    A budget plan's ``budget`` and ``estimated_peak`` are for the data rank ``src``
    profiled, on the model without sharding: plan on the batch one rank sees. Under FSDP2
    each rank's peak is about that estimate plus FSDP2's unsharded parameters and
    communication buffers (see docs/guide.md, "Distributed training").

.. warning::
    If rank ``src`` fails before it calls :func:`broadcast_plan` (planning raised), the other
    ranks wait in the broadcast until the process group's timeout, or until the
    backend notices that rank ``src`` died. The plan is sent with ``pickle`` (as
    ``broadcast_object_list`` does), so only use it with ranks you trust.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from autoremat.planning.plans import Plan

__all__ = ["broadcast_plan"]


def broadcast_plan(plan: Plan | None, src: int = 0, group: Any = None) -> Plan:
    r"""Send rank ``src``'s plan to every rank of ``group`` and return it there.

    A collective: every rank of ``group`` must call it, with the same ``src``. The plan travels
    as :meth:`Plan.to_dict` through :func:`torch.distributed.broadcast_object_list` and comes
    back through :meth:`Plan.from_dict`, so every rank gets a plan equal to rank ``src``'s
    (same modules, fingerprint, budget and estimates; the ``tree`` is not sent, and rank
    ``src`` gets its own object back). Then call ``plan.apply(model)`` on every rank, before
    wrapping the model in ``DistributedDataParallel`` or calling ``fully_shard``:
    :meth:`Plan.apply` raises on a rank whose model's module structure differs from the one
    the plan was made for.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> dist.init_process_group("gloo")
        >>> p = autoremat.plan(model, (x,), budget="60%") if dist.get_rank() == 0 else None
        >>> p = autoremat.broadcast_plan(p)
        >>> p.apply(model)
        >>> for block in model.blocks:
        ...     fully_shard(block)
        >>> fully_shard(model)

    See the module docstring for budgets under FSDP2, a failing ``src`` rank and trust.

    Args:
        plan: the :class:`~autoremat.Plan` to send, on rank ``src``; ignored on the other
            ranks (pass ``None``).
        src: the rank that sends its plan, a global rank (as in
            ``broadcast_object_list``). Default: 0.
        group: the process group to broadcast in; ``None`` is the default group.

    Returns:
        The plan of rank ``src``, on every rank of ``group``.

    Raises:
        RuntimeError: ``torch.distributed`` is not available, or no process group is
            initialised (call ``torch.distributed.init_process_group`` first).
        ValueError: rank ``src`` passed something other than a :class:`Plan` (``None``,
            say), or a plan the other ranks could not load (one built by hand, without a
            fingerprint). It raises on every rank, not only on ``src``: the broadcast still takes
            place, so no rank is left waiting. Also raised on a rank that is not in
            ``group`` (torch skips the broadcast there).
        Exception: whatever ``broadcast_object_list`` raises (``src`` not in ``group``, a
            failed or timed-out collective).
    """
    _require_process_group()
    payload: list[Any] = [None]
    if dist.get_rank() == src:
        payload = [_outgoing(plan)]
    dist.broadcast_object_list(payload, src=src, group=group)
    data = _received(payload, src)
    if dist.get_rank() == src:
        assert isinstance(plan, Plan)
        return plan
    return Plan.from_dict(data)


def _require_process_group() -> None:
    if not dist.is_available():
        raise RuntimeError(
            "autoremat.broadcast_plan needs torch.distributed, which this build of torch "
            "does not have"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "autoremat.broadcast_plan needs an initialised process group: call "
            "torch.distributed.init_process_group(...) on every rank first"
        )


def _outgoing(plan: Any) -> tuple[str, Any]:
    """What rank ``src`` broadcasts: the plan's dict, checked as the other ranks will load it
    (a plan without a fingerprint is refused there), or why there is none."""
    if not isinstance(plan, Plan):
        return ("error", f"{type(plan).__name__}, not a Plan")
    data = plan.to_dict()
    try:
        Plan.from_dict(data)
    except ValueError as exc:
        return ("error", f"a plan the other ranks cannot load ({exc})")
    return ("plan", data)


def _received(payload: list[Any], src: int) -> Any:
    """The plan data rank ``src`` broadcast, or the ``ValueError`` every rank raises when it
    sent none (or this rank was outside the group)."""
    if payload[0] is None:  # torch skips the broadcast on a rank outside the group
        raise ValueError(
            f"autoremat.broadcast_plan: rank {dist.get_rank()} is not in the group it was "
            f"given; call it on the ranks of that group only"
        )
    kind, data = payload[0]
    if kind == "error":
        raise ValueError(
            f"autoremat.broadcast_plan: rank {src} (the src rank) passed {data}; "
            f"make the plan on rank {src} (autoremat.plan(model, ...)) and pass it there"
        )
    return data

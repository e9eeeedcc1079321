"""Using a plan in data-parallel training (DDP, FSDP2): make it on one rank, send it to all
(docs/guide.md, "Distributed training", says why every rank needs the same plan)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from autoremat.planning.plans import Plan

__all__ = ["broadcast_plan"]


def broadcast_plan(plan: Plan | None, src: int = 0, group: Any = None) -> Plan:
    r"""Send rank ``src``'s plan to every rank of ``group`` and return it there.

    A collective: every rank of ``group`` calls it, with the same ``src``. The plan travels as
    :meth:`Plan.to_dict` (without its ``tree``) and comes back through :meth:`Plan.from_dict`;
    rank ``src`` gets its own object back. Then ``plan.apply(model)`` on every rank (see
    docs/guide.md, "Distributed training"). It is sent with ``pickle`` (as
    ``broadcast_object_list`` does): use it only with ranks you trust. If rank ``src`` fails
    before it calls this, the others wait in the broadcast until the group's timeout.

    Args:
        plan: the :class:`~autoremat.Plan` to send, on rank ``src``; ``None`` on the others.
        src: the rank that sends, a global rank (as in ``broadcast_object_list``). Default: 0.
        group: the process group to broadcast in; ``None`` is the default group.

    Raises:
        RuntimeError: ``torch.distributed`` is not available, or no process group is
            initialised.
        ValueError: on every rank, when rank ``src`` passed no :class:`Plan` or one the others
            cannot load (no fingerprint): the broadcast still takes place, so no rank is left
            waiting; and on a rank that is not in ``group``.
        Exception: whatever ``broadcast_object_list`` raises.
    """
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
    payload: list[Any] = [None]
    if dist.get_rank() == src:  # the plan's dict, checked as the other ranks will load it
        payload = [("error", f"{type(plan).__name__}, not a Plan")]
        if isinstance(plan, Plan):
            data = plan.to_dict()
            try:
                Plan.from_dict(data)
                payload = [("plan", data)]
            except ValueError as exc:
                payload = [("error", f"a plan the other ranks cannot load ({exc})")]
    dist.broadcast_object_list(payload, src=src, group=group)
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
    return plan if dist.get_rank() == src and isinstance(plan, Plan) else Plan.from_dict(data)

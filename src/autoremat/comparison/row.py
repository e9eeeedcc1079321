"""One result of a comparison: one contender on one model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autoremat.planning.plans import Plan

__all__ = ["Row"]


@dataclass
class Row:
    """One contender on one model (``strategy``: the contender's name, the column of the
    tables). Byte counts are ints, ratios are relative to the ``none`` row of the same model;
    ``None`` where a figure is unknown (every figure of a contender that failed).

    Attributes:
        peak: bytes alive at most during the step, above what existed before it
            (:class:`~autoremat.record.measure.Measurement`; for compiled models, and for every row
            of a ``compare(memory="allocator")``, as the allocator reports them).
        saved: bytes created by the forward and still alive before backward
            (:class:`~autoremat.record.measure.Measurement`, measured as ``peak``).
        autograd_saved: bytes of the distinct storages kept from the forward for backward:
            autograd's saved tensors plus selective checkpointing's cache
            (:func:`autoremat.comparison.saved_by_autograd`); the basis on which eager and
            compiled strategies compare.
        flops: FLOPs of one step, recompute included.
        seconds: median wall time of one step.
        time_spread: (slowest - fastest) / median of the timed steps: how noisy ``seconds``
            is.
        saved_ratio: ``saved`` over the baseline's ``saved``.
        grads_match: loss and every parameter gradient equal to the baseline's within
            ``rtol=1e-5, atol=1e-6`` after one step from the same seed.
        grads_error: the worst relative error of the loss and the gradients against the
            baseline's (:func:`autoremat.comparison.gradients.worst_error`): rounding (about
            1e-5 and below) tells apart from another computation (about 1).
        note: what else is known, ``; ``-separated: what the contender wraps, a budget plan's
            predicted peak and its error, what differs from the baseline, why it failed.
        compiled: the contender ran through ``torch.compile``.
        identical: one step from the same seed gave the baseline's loss, every gradient and
            every buffer bit for bit (:func:`autoremat.comparison.gradients.identical`).
        plan: the :class:`autoremat.Plan` the contender applied (``levels``, ``budget``), without
            its ``tree``; ``None`` for the others. Not one of the figures (no table or CSV
            shows it; rows compare equal whatever it is).
    """

    model: str
    strategy: str
    peak: int | None
    saved: int | None
    autograd_saved: int | None
    flops: int | None
    seconds: float | None
    time_spread: float | None
    peak_ratio: float | None
    saved_ratio: float | None
    autograd_saved_ratio: float | None
    flops_ratio: float | None
    time_ratio: float | None
    grads_match: bool
    grads_error: float | None = None
    note: str = ""
    compiled: bool = False
    identical: bool = False
    plan: Plan | None = dataclasses.field(default=None, repr=False, compare=False)

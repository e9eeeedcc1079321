"""Compare ways to recompute side by side on one model: memory, FLOPs, time, gradients.

A :class:`Contender` turns a fresh copy of the model into the model to train (the same object
with modules wrapped, a wrapper module, or a compiled module) and returns it in an
:class:`Applied` (with the plan it applied, its predicted peak, a note). :func:`compare` runs
every contender on the same inputs and returns one :class:`Row` per contender that applies::

    rows = compare(model, args, kwargs, [no_recompute(), every_block(), levels_plan(4)])
    print(to_markdown(rows))

Files: ``applied`` (:class:`Contender`, :class:`Applied`), ``contenders`` (the eager ones),
``inductor`` (:func:`compiled`), ``saved`` (:func:`saved_by_autograd`), ``gradients`` (one
step compared with the baseline's), ``harness`` (:func:`compare`, :func:`bench_target`),
``row`` (:class:`Row`), ``report`` (:func:`to_markdown`). CSV files and plots are the benchmark
scripts' (``benchmarks/report.py``).

Built-in contenders:

* :func:`no_recompute` (``none``): the baseline; every ratio is relative to it.
* :func:`every_block`: what users do by hand. A Hugging Face model that supports it gets its own
  ``activation_checkpointing_enable`` (non-reentrant); any other model has its "blocks" wrapped
  (:func:`find_blocks`: the largest group of same-class, non-leaf siblings in the module tree).
* :func:`sqrt_segments`: ``torch.utils.checkpoint.checkpoint_sequential`` with
  ``round(sqrt(n))`` segments (Chen et al. 2016); only for an ``nn.Sequential``.
* :func:`levels_plan`: :func:`autoremat.plan` with ``segments=k``, applied.
* :func:`budget_plan`: :func:`autoremat.plan` with ``budget=f`` (or the lowest budget), applied.
* :func:`compiled`: ``torch.compile`` (inductor) with
  ``torch._functorch.config.activation_memory_budget``; the min-cut partitioner then decides
  what to recompute.

How the figures are obtained (see :class:`Row`):

* ``peak``, ``saved``, ``flops`` of eager contenders come from :func:`autoremat.measure`
  (a dispatch-level storage tracker and ``FlopCounterMode``).
* ``autograd_saved`` (:func:`saved_by_autograd`) is the bytes of the distinct storages packed by
  ``torch.autograd.graph.saved_tensors_hooks`` during the forward and the loss, plus those kept
  in the cache of selective checkpointing (which the hooks do not see), parameters, buffers and
  inputs left out. Those hooks also fire under ``torch.compile``, so this is the one figure on
  which compiled and eager contenders (selective recompute included) compare directly.
* A compiled model cannot be measured by a dispatch mode (dynamo runs the original Python code
  eagerly when a ``TorchDispatchMode`` is active): its ``peak`` and ``saved`` come from the
  allocator (:func:`autoremat.measure` picks :class:`autoremat.record.memory.CpuAllocatorMemory` on
  CPU, the CUDA allocator on a GPU), and its ``flops`` are counted on the forward and backward
  graphs inductor compiled (recompute included) with the formulas of ``FlopCounterMode``.
  ``compare(..., memory="allocator")`` measures the eager rows by the allocator too, for a
  like-for-like table.
* ``seconds`` is the median of ``repeats`` timed steps, interleaved across contenders (one step
  of each contender per round, the order reversed every other round) so that a noisy machine
  disturbs every contender alike.
* ``grads_match``: one step of each contender from the same seed gives the loss and every
  parameter's gradient of the baseline within ``rtol=1e-5, atol=1e-6`` (parameters compared by
  name, wrapper prefixes such as ``_orig_mod.`` removed).
"""

from autoremat.comparison.applied import Applied, CompileInfo, Contender
from autoremat.comparison.contenders import (
    SqrtSegments,
    applied_plan,
    budget_plan,
    every_block,
    levels_plan,
    no_recompute,
    sqrt_segments,
)
from autoremat.comparison.harness import bench_target, compare
from autoremat.comparison.inductor import compiled, graph_flops
from autoremat.comparison.report import to_markdown
from autoremat.comparison.row import Row
from autoremat.comparison.saved import saved_by_autograd
from autoremat.record.tree import find_blocks

__all__ = [
    "Applied",
    "CompileInfo",
    "Contender",
    "Row",
    "SqrtSegments",
    "applied_plan",
    "bench_target",
    "budget_plan",
    "compare",
    "compiled",
    "every_block",
    "find_blocks",
    "graph_flops",
    "levels_plan",
    "no_recompute",
    "saved_by_autograd",
    "sqrt_segments",
    "to_markdown",
]

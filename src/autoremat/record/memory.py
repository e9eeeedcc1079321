"""Count the bytes of tensor memory a piece of code keeps alive, op by op.

:class:`LiveMemory` is a :class:`~torch.utils._python_dispatch.TorchDispatchMode`: while it is
active it sees the output of every ATen op that reaches the Python dispatcher, on every device
(``cpu``, ``cuda``, ``meta``) and in every phase of a training step: the forward; the backward
(the autograd engine carries the dispatch mode stack into the thread that runs it, so
gradients, the ``.grad`` of parameters included, are seen); checkpoint's recompute inside
backward; the outputs selective checkpointing keeps in its own cache, outside autograd's saved
tensors (``saved_tensors_hooks`` do not see them; this mode does, because the
selective-checkpoint mode calls each op through the modes below it).

What it counts
    *Tensor storages*. Each :class:`torch.UntypedStorage` that first appears as the output of an
    op while the mode is active, and is not the storage of one of that op's inputs, is *new*: it
    is counted once, with its ``nbytes()``, however many views share it, from the op that made
    it until the storage is freed. Frees are seen through a ``weakref`` callback on the Python
    storage object: PyTorch keeps one Python object per storage alive for as long as the C++
    storage lives (PyObject preservation), so the callback fires exactly when the last tensor,
    view or autograd saved-tensor slot holding the storage lets go (checked on torch 2.13 by
    ``tests/test_measure.py``). A storage that grows through an op (an ``out=`` argument
    resized) is re-measured when an op returns it. The counts continue to fall after the mode
    exits, as tracked storages die.

What it does not count
    * Storages that existed before the mode was entered (parameters, inputs, optimizer state),
      even when an op writes into them or returns a view of them; and memory freed by them.
    * Allocations inside a C++ kernel that never surface as an op output (a kernel's scratch
      buffers, a ``.contiguous()`` copy made inside ``mm``, cuDNN/cuBLAS workspaces). Other
      dispatch modes can change what is seen: what a mode entered *before* this one does runs
      below it, out of sight; a mode entered *after* it sees ops first and may replace them
      (``FlopCounterMode`` decomposes ops it has no formula for). Measure alone.
    * Allocator behaviour: these are storage bytes, not allocator blocks. The CUDA caching
      allocator rounds to 512-byte blocks and fragments; CPU allocators align. Use
      :class:`CudaMemory` for what the CUDA allocator reports, :class:`CpuAllocatorMemory` for
      what the CPU allocator reports.
    * Tensors created without an op the dispatcher sees (``torch.from_numpy``, storages made
      directly with ``torch.UntypedStorage(...)``), ``UntypedStorage.resize_`` called directly
      (FSDP does this), sparse tensors and other tensors without a storage. Code compiled by
      ``torch.compile`` is not seen at all: dynamo runs a model eagerly while a dispatch mode
      is active, so this mode would measure the eager model. Measure a compiled model with
      :class:`CpuAllocatorMemory` or :class:`CudaMemory`.
    * Python garbage: a storage held by a reference cycle counts until the garbage collector
      frees it, which is what the allocator sees too.

Numbers are summed over devices; use the tracker on a model that lives on one device.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import tempfile
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from typing_extensions import Self

from autoremat.core.nested import op_tensors
from autoremat.record.meta_kernels import fresh_only, run_kernel

__all__ = [
    "CUDA_BLOCK",
    "CpuAllocatorMemory",
    "CudaMemory",
    "LiveMemory",
    "block_bytes",
    "cpu_allocator_countable",
]

# The CUDA caching allocator's rounding: every block a multiple of 512 bytes, at least 512
# (``kMinBlockSize`` in ``c10/cuda/CUDACachingAllocator.cpp``); ``max_memory_allocated``
# counts these blocks.
CUDA_BLOCK = 512


def block_bytes(nbytes: int, block: int = 1) -> int:
    """The bytes an allocator that rounds every allocation up to a multiple of ``block``
    (at least one block; nothing for an empty storage) gives ``nbytes``: ``block=1`` the bytes
    themselves, :data:`CUDA_BLOCK` what the CUDA caching allocator counts as allocated."""
    return -(-nbytes // block) * block


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The untyped storages behind ``t`` (several for a traceable wrapper subclass, none for a
    tensor without storage, such as a sparse tensor)."""
    if type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):
        inner = [getattr(t, attr) for attr in t.__tensor_flatten__()[0]]
        return [st for x in inner if isinstance(x, torch.Tensor) for st in _storages(x)]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):
        return []


def _inputs(func: Any, args: Any, kwargs: Any, first: torch.Tensor) -> set[int]:
    """The ids of the storages of an op's inputs (none: its outputs are all new)."""
    if func is torch.ops.aten.lift_fresh.default or (first.is_meta and fresh_only(func)):
        return set()  # (torch.tensor(...)'s data; on meta, a fresh-only op's outputs)
    return {id(st) for t in op_tensors((args, kwargs)) for st in _storages(t)}


class LiveMemory(TorchDispatchMode):
    """Live bytes of the tensor storages created while this mode is active.

    Use as a context manager::

        with LiveMemory() as mem:
            out = model(x)
            loss = out.sum()
            saved = mem.snapshot("forward")   # bytes alive now, created inside
            loss.backward()
        mem.peak                              # most bytes alive at once, created inside

    Attributes:
        current: bytes of the storages created inside that are alive now.
        peak: the largest ``current`` seen just after an op's outputs appeared (the live total
            only rises when an op returns, so this is the maximum over time).
        allocated: bytes of all storages created inside, alive or not.
        marks: the values recorded by :meth:`snapshot` with a label.
        events: with ``trace=True``, ``(op name, +bytes or -bytes, current)`` for every new
            storage and every free, in order (a free names the op that made the storage).

    Thread-safe: on CUDA the autograd engine runs backward on a device thread, where both the
    mode and the free callbacks run. A ``LiveMemory`` may be entered again; storages it already
    tracks stay tracked.

    Options (why: docs/cost-model.md, "What a figure is"): ``rng_states`` also counts the CPU
    generator states ``torch.get_rng_state()`` returns while the mode is active (checkpoint's,
    which no op makes); ``block`` counts each storage as an allocator rounding to that many
    bytes would (:func:`block_bytes`; :data:`CUDA_BLOCK` as ``max_memory_allocated`` counts).
    """

    def __init__(self, trace: bool = False, *, rng_states: bool = False, block: int = 1) -> None:
        super().__init__()
        self.trace, self.rng_states, self.block = trace, rng_states, block
        self.current = self.peak = self.allocated = 0
        self.marks: dict[str, int] = {}
        self.events: list[tuple[str, int, int]] = []
        # id(storage) -> [weakref to the storage, its nbytes, the op that made it]
        self._live: dict[int, list[Any]] = {}
        self._lock = threading.RLock()

    @classmethod
    def counting_as(cls, device: torch.device | str, trace: bool = False) -> LiveMemory:
        """A tracker that counts a step as ``device`` holds it: on the CPU with checkpoint's
        RNG states (CPU memory there), on CUDA in the caching allocator's blocks (the RNG
        states are host memory there); on other devices the storages' bytes."""
        kind = torch.device(device).type
        return cls(trace, rng_states=kind == "cpu", block=CUDA_BLOCK if kind == "cuda" else 1)

    def snapshot(self, label: str | None = None) -> int:
        """Bytes alive now among the storages created inside; recorded in ``marks[label]``
        when a label is given."""
        with self._lock:
            value = self.current
            if label is not None:
                self.marks[label] = value
        return value

    def reset_peak(self) -> None:
        """Start the peak again from the bytes alive now."""
        with self._lock:
            self.peak = self.current

    def track(self, t: torch.Tensor, name: str) -> None:
        """Count ``t``'s storage from now until it is freed, as if an op called ``name`` had
        made it (for tensors made outside the dispatcher)."""
        with self._lock:
            for st in _storages(t):
                self._add(st, set(), name)
            self.peak = max(self.peak, self.current)

    def __enter__(self) -> Self:
        if self.rng_states:
            original = self._get_rng_state = torch.get_rng_state

            def get_rng_state() -> torch.Tensor:
                state = original()
                self.track(state, "torch.get_rng_state")
                return state

            torch.get_rng_state = get_rng_state
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.rng_states:
            torch.get_rng_state = self._get_rng_state
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = run_kernel(func, args, kwargs or {})  # (on meta, each kernel once per input)
        outputs = [out] if type(out) is torch.Tensor else op_tensors(out)
        known: set[int] | None = None  # the inputs' storages, found once one is needed
        with self._lock:
            for st in (st for t in outputs for st in _storages(t)):
                if known is None and id(st) not in self._live:
                    known = _inputs(func, args, kwargs, outputs[0])
                self._add(st, known or set(), func)  # (named by str() only in the trace)
            self.peak = max(self.peak, self.current)
        return out

    def _add(self, st: torch.UntypedStorage, inputs: set[int], name: Any) -> None:
        key, size = id(st), block_bytes(st.nbytes(), self.block)
        entry = self._live.get(key)
        if entry is not None:
            if size != entry[1]:  # resized by the op (an out= argument)
                self._change(entry[2], size - entry[1])
                entry[1] = size
            return
        if key in inputs:
            return  # an input's storage that existed before the mode was entered
        ref = weakref.ref(st, functools.partial(self._freed, key))
        self._live[key] = [ref, size, name]
        self.allocated += size
        self._change(name, size)

    def _freed(self, key: int, _ref: Any) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self._change(entry[2], -entry[1])

    def _change(self, name: Any, delta: int) -> None:
        self.current += delta
        if self.trace:
            self.events.append((str(name), delta, self.current))


class CudaMemory:
    """What the CUDA caching allocator reports, with the same ``current``/``peak``/``snapshot``
    interface as :class:`LiveMemory`; CUDA only, and not tested on machines without a GPU.

    On entry it synchronizes, records ``torch.cuda.memory_allocated(device)`` and calls
    ``torch.cuda.reset_peak_memory_stats(device)`` (which resets the peak statistic for every
    other user of it). ``current`` is ``memory_allocated - start`` and ``peak`` is
    ``max_memory_allocated - start``: allocator blocks (rounded to 512 bytes), including
    kernels' scratch buffers and anything other code allocates on that device meanwhile, and not
    including cuBLAS/cuDNN workspaces the allocator keeps reserved.
    """

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        self.device = device
        self.start = 0
        self.marks: dict[str, int] = {}
        self._final: tuple[int, int] | None = None  # (current, peak) when the block exited

    def __enter__(self) -> CudaMemory:
        gc.collect()  # (garbage from before, freed inside, would lower the figures)
        torch.cuda.synchronize(self.device)
        self.start = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._final = None
        return self

    def __exit__(self, *exc: object) -> None:
        # Freeze the figures: the allocator's statistics go on counting whatever runs next
        # (measure's FLOP-counting and timing runs), which belongs to no measurement.
        torch.cuda.synchronize(self.device)
        self._final = (self.current, self.peak)  # (read live: __enter__ set it to None)

    @property
    def current(self) -> int:
        """Bytes allocated above the start (at exit, once the block has exited)."""
        if self._final is not None:
            return self._final[0]
        return torch.cuda.memory_allocated(self.device) - self.start

    @property
    def peak(self) -> int:
        """The allocator's peak above the start, over the block (frozen at exit)."""
        if self._final is not None:
            return self._final[1]
        return torch.cuda.max_memory_allocated(self.device) - self.start

    def snapshot(self, label: str | None = None) -> int:
        value = self.current
        if label is not None:
            self.marks[label] = value
        return value


_MARK = "autoremat.record.memory.mark:"

# What kineto (the profiler's C++ library) writes to stderr as each session starts and stops:
# ``USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start`` (and
# ``profiler_stop``). Its ``USDT`` level is above ``ERROR``, the level torch sets it to, and
# ``KINETO_LOG_LEVEL`` is read once, when the process first profiles, and would hide errors too.
_KINETO_MARKER = b"USDT:"


@contextlib.contextmanager
def _without_kineto_markers() -> Iterator[None]:
    """Run the block (starting or stopping this module's own profiler session, never the
    caller's code) with file descriptor 2 sent to a temporary file, then put it back and write
    to it what came there except kineto's session markers (:data:`_KINETO_MARKER`)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (AttributeError, OSError, ValueError):  # no stderr to redirect
        saved = -1
    if saved < 0:
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(AttributeError, OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            with open(2, "wb", closefd=False) as stderr:  # (writes it all)
                stderr.writelines(line for line in caught if not line.startswith(_KINETO_MARKER))


def cpu_allocator_countable(device: torch.device) -> bool:
    """Whether :class:`CpuAllocatorMemory` can count a step on ``device`` now: a CPU, and no
    ``torch.profiler`` session of the caller's running (it needs one of its own)."""
    return device.type == "cpu" and not torch._C._autograd._profiler_enabled()


class CpuAllocatorMemory:
    """What the CPU allocator reports, from the profiler's memory events, with the interface
    of :class:`CudaMemory`: for code no dispatch mode may watch (a ``torch.compile``d model,
    whose generated kernels allocate straight from the allocator).

    On entry it starts ``torch.profiler.profile(activities=[CPU], profile_memory=True)``; on
    exit it replays the allocator's events (every allocation and free of CPU memory, with its
    size in bytes as requested, on every thread the profiler follows: a CPU backward runs on
    the calling thread) in time order. ``current`` and ``peak`` are bytes above the start,
    known once the block has exited; memory allocated before the block and freed inside
    counts negative, as with ``memory_allocated``. :meth:`snapshot` leaves a mark in the
    profile; its value is in ``marks`` after exit, and in ``highs`` the most the allocator's
    figure reached since the mark before (the block's start for the first): a kernel's scratch
    included, what the stretch between two marks held at most.

    Not for use inside another ``torch.profiler`` session (the profiler raises). Sizes are the
    bytes asked for, not the allocator's aligned blocks.
    """

    def __init__(self) -> None:
        self.current = self.peak = 0
        self.marks: dict[str, int] = {}
        self.highs: dict[str, int] = {}
        self._profile: Any = None

    def __enter__(self) -> CpuAllocatorMemory:
        from torch.profiler import ProfilerActivity, profile

        gc.collect()  # (a cycle of blocks an earlier session saw made, freed inside: negative)
        self.current = self.peak = 0
        self.marks, self.highs = {}, {}
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _without_kineto_markers():
            self._profile.__enter__()
        return self

    def snapshot(self, label: str | None = None) -> None:
        """Mark this point; with a label, ``marks[label]`` holds the bytes above the start
        here once the block has exited."""
        if label is not None:  # (a record function no dispatch mode sees as an op)
            with torch._C._profiler._RecordFunctionFast(_MARK + label):
                pass

    def __exit__(self, *exc: object) -> None:
        with _without_kineto_markers():
            self._profile.__exit__(*exc)
        timeline: list[tuple[int, int, Any]] = []  # sorted below: a change before a mark at a tie
        for e in self._profile.profiler.kineto_results.events():
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU:
                timeline.append((e.start_ns(), 0, e.nbytes()))
            elif _MARK in e.name():
                timeline.append((e.start_ns(), 1, e.name()[len(_MARK) :]))
        self._profile = None
        current = peak = high = 0  # high: the most since the last mark
        for _, is_mark, what in sorted(timeline):
            if is_mark:
                self.marks[what], self.highs[what] = current, high
                high = current
            else:
                current += what
                peak, high = max(peak, current), max(high, current)
        self.current, self.peak = current, peak

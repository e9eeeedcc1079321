"""A device's memory as the user states it, and what it holds beyond the step's tensors.

``device_memory="24GiB"`` (or bytes, or ``"90%"`` / ``0.9`` of the device's total memory; on
the CPU of the RAM available now, :func:`device_total`) is
the memory the whole training step may use, as ``nvidia-smi`` shows it: tensors (parameters,
gradients, optimizer state, inputs, activations), and on CUDA what the runtime and the caching
allocator take beyond them:

* **runtime**: the CUDA context (driver state, loaded kernels), outside torch's allocator:
  :data:`CUDA_CONTEXT`, typically 300-600 MiB on recent GPUs;
* **workspace**: scratch memory kernels take that no op returns (cuBLAS and cuDNN workspaces):
  :data:`CUDA_WORKSPACE`;
* **fragmentation**: the caching allocator rounds each block up and keeps freed blocks for
  reuse, so what it reserves exceeds what tensors hold: :data:`CUDA_FRAGMENTATION` of the
  tensors (1-15% measured at the lowest budgets, ``benchmarks/results/results_cuda.md``).

These three are estimates, the same for every model (``DeviceModel`` takes others). On the CPU
they are 0: what the allocator sees beyond the tensors, kernels' scratch above all (a
convolution's backward: 15-25% of a conv net's fp32 peak, more than the tensors under bf16), is
measured instead: ``autoremat.plan(..., device_memory=...)`` and :func:`autoremat.fit` size from
real steps profiled by the CPU allocator (``profile(memory="allocator")``).
:func:`autoremat.fit` checks its answer once on the device.

One more the user decides, the **reserve**: bytes kept free for what the step's tensors are
not (``fit(..., reserve="1GiB")``): another process, a loop that keeps the previous step's
output alive through the next forward (``out = model(x)`` reassigned after it;
:class:`~autoremat.training.fit.Fit` says how much that is). (The RNG states
``torch.utils.checkpoint`` keeps per recomputed call are in a plan's step peak, its step run: on the
CPU they are the
device's memory, on CUDA host memory.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from autoremat.core.sizes import Budget, format_size

__all__ = [
    "CUDA_CONTEXT",
    "CUDA_FRAGMENTATION",
    "CUDA_WORKSPACE",
    "DeviceModel",
    "available_memory",
    "device_model",
    "device_total",
]

CUDA_CONTEXT = 512 * 2**20
CUDA_WORKSPACE = 64 * 2**20
CUDA_FRAGMENTATION = 0.10


@dataclass(frozen=True)
class DeviceModel:
    """The memory a step may use on ``device`` (``total`` bytes), and what the runtime
    (``runtime`` bytes), kernels' scratch (``workspace``), the allocator (``fragmentation``,
    a fraction of the tensors) and the user's ``reserve`` take of it (module docstring)."""

    device: str
    total: int
    runtime: int = 0
    workspace: int = 0
    fragmentation: float = 0.0
    reserve: int = 0

    @property
    def limit(self) -> int:
        """The most the step may take on the device: ``total`` less the ``reserve``."""
        return self.total - self.reserve

    def for_tensors(self) -> int:
        """The bytes tensors may hold so that the device's figure stays within ``total``."""
        free = self.total - self.runtime - self.workspace - self.reserve
        return int(free / (1 + self.fragmentation))

    def device_bytes(self, tensors: int) -> int:
        """What the device shows when tensors hold ``tensors`` bytes at most (the reserve
        left out: it is the user's)."""
        return int(tensors * (1 + self.fragmentation)) + self.workspace + self.runtime

    def __str__(self) -> str:
        extra = ""
        if self.runtime or self.workspace or self.fragmentation:
            extra = (
                f" (runtime {format_size(self.runtime)}, workspace {format_size(self.workspace)}, "
                f"allocator +{self.fragmentation:.0%} of the tensors)"
            )
        if self.reserve:
            extra += f", {format_size(self.reserve)} reserved"
        where = "(sized on meta)" if self.device == "meta" else f"on {self.device}"
        return f"{format_size(self.total)} {where}{extra}"


def device_total(device: torch.device) -> int:
    """The memory a fraction (``"90%"``) of ``device``'s memory is taken of: a GPU's total
    (``torch.cuda.get_device_properties``); on the CPU, the RAM available now
    (:func:`available_memory`), not the machine's total, which other processes share."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return available_memory(device)


def available_memory(device: torch.device) -> int:
    """The bytes a new allocation on ``device`` can have now: a GPU's free memory
    (``torch.cuda.mem_get_info``); on the CPU, Linux's ``MemAvailable`` (free memory and the
    page cache it can drop), else the free pages."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def device_model(
    spec: int | float | str, device: torch.device | str = "cpu", reserve: int | str = 0
) -> DeviceModel:
    """The :class:`DeviceModel` for ``device_memory=spec`` on ``device``: bytes (int), a size
    (``"24GiB"``), or a fraction (``0.9``, ``"90%"``) of :func:`device_total`. On CUDA with the
    estimates of the module docstring; ``reserve`` (bytes or a size) kept free.

    Raises:
        ValueError, TypeError: a malformed or non-positive ``spec`` (the message lists the
            forms), or a fraction for a model on ``meta``.
    """
    device = torch.device(device)
    try:
        parsed = Budget.parse(spec)
    except (TypeError, ValueError) as exc:
        raise type(exc)(
            f"device_memory {spec!r} is not understood: give whole bytes (int), a size such as "
            f'"24GiB" or "800MB", or a fraction of the device\'s memory (0.9, "90%")'
        ) from None
    if parsed.bytes is None and device.type == "meta":
        raise ValueError(
            f"device_memory {spec!r} is a fraction of the device's memory, but the model is on "
            f'meta, which has none: give the target device\'s memory, such as "24GiB"'
        )
    total = parsed.resolve(device_total(device) if parsed.bytes is None else 0)
    kept = _reserve(reserve)
    if device.type != "cuda":
        return DeviceModel(str(device), total, reserve=kept)
    return DeviceModel(
        str(device), total, CUDA_CONTEXT, CUDA_WORKSPACE, CUDA_FRAGMENTATION, reserve=kept
    )


def _reserve(reserve: int | str) -> int:
    parsed = Budget.parse(reserve) if reserve else None
    if parsed is not None and parsed.bytes is None:
        raise ValueError(f'reserve {reserve!r} must be bytes or a size such as "1GiB"')
    return 0 if parsed is None else int(parsed.bytes or 0)

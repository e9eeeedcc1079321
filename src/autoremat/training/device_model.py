"""A device's memory as the user states it, and what it holds beyond the step's tensors.

``device_memory="24GiB"`` (or bytes, or ``"90%"`` / ``0.9`` of the device's total memory) is
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

These three are estimates, the same for every model (``DeviceModel`` takes others); on the CPU they
are 0 (the allocator's figure agrees with the tensors' within 1%,
:class:`~autoremat.record.memory.CpuAllocatorMemory`). :func:`autoremat.fit` checks its answer once
on the device.
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
    "device_model",
    "device_total",
]

CUDA_CONTEXT = 512 * 2**20
CUDA_WORKSPACE = 64 * 2**20
CUDA_FRAGMENTATION = 0.10


@dataclass(frozen=True)
class DeviceModel:
    """The memory a step may use on ``device`` (``total`` bytes), and what the runtime
    (``runtime`` bytes), kernels' scratch (``workspace``) and the allocator (``fragmentation``,
    a fraction of the tensors) take of it."""

    device: str
    total: int
    runtime: int = 0
    workspace: int = 0
    fragmentation: float = 0.0

    def for_tensors(self) -> int:
        """The bytes tensors may hold so that the device's figure stays within ``total``."""
        return int((self.total - self.runtime - self.workspace) / (1 + self.fragmentation))

    def device_bytes(self, tensors: int) -> int:
        """What the device shows when tensors hold ``tensors`` bytes at most."""
        return int(tensors * (1 + self.fragmentation)) + self.workspace + self.runtime

    def __str__(self) -> str:
        extra = ""
        if self.runtime or self.workspace or self.fragmentation:
            extra = (
                f" (runtime {format_size(self.runtime)}, workspace {format_size(self.workspace)}, "
                f"allocator +{self.fragmentation:.0%} of the tensors)"
            )
        where = "(sized on meta)" if self.device == "meta" else f"on {self.device}"
        return f"{format_size(self.total)} {where}{extra}"


def device_total(device: torch.device) -> int:
    """The total memory of ``device``: a GPU's (``torch.cuda.get_device_properties``), else
    the machine's RAM."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_model(spec: int | float | str, device: torch.device | str = "cpu") -> DeviceModel:
    """The :class:`DeviceModel` for ``device_memory=spec`` on ``device``: bytes (int), a size
    (``"24GiB"``), or a fraction (``0.9``, ``"90%"``) of :func:`device_total`. On CUDA with the
    estimates of the module docstring; elsewhere none.

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
    if device.type != "cuda":
        return DeviceModel(str(device), total)
    return DeviceModel(str(device), total, CUDA_CONTEXT, CUDA_WORKSPACE, CUDA_FRAGMENTATION)

"""Import torchvision's models beside the CPU build of torch.

torchvision's PyPI wheel for torch 2.13 (0.28.0) is built against CUDA torch: its C++ extension
(``torchvision/_C.so``) needs ``libtorch_cuda.so`` and does not load beside the CPU wheel of
torch. torchvision then carries on without its ops (``torchvision.extension._has_ops()`` is
False), except that ``torchvision/_meta_registrations.py`` registers fake kernels for two of them,
``torchvision::nms`` and ``torchvision::qnms``, without checking, and that fails the import:
``RuntimeError: operator torchvision::nms does not exist``. transformers imports torchvision
whenever it is installed, so that error also breaks every transformers model.

:func:`allow_import` declares those two operators' schemas (as torchvision's C++ code declares
them) when the extension does not load, before torchvision is imported. The import then
succeeds; the models (pure Python) work; the detection ops still raise torchvision's own
"Couldn't load custom C++ ops" error if called. When the extension does load (a matching build),
nothing is declared.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

__all__ = ["allow_import"]

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: torch.library.Library | None = None


def _extension_loads() -> bool:
    """torchvision's ``_C`` extension loads beside this torch (or torchvision is absent)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return True
    found = sorted(Path(spec.origin).parent.glob("_C*.so"))
    if not found:
        return False
    try:
        torch.ops.load_library(str(found[0]))
    except OSError:
        return False
    return True


def allow_import() -> None:
    """Make ``import torchvision`` (and transformers, timm, diffusers) work beside CPU torch:
    declare ``torchvision::nms`` and ``torchvision::qnms`` when torchvision's extension does not
    load (module docstring). Idempotent; call it before the first of those imports."""
    global _library
    if _library is not None or hasattr(torch.ops.torchvision, "nms") or _extension_loads():
        return
    _library = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        _library.define(schema)

"""Autocast where autocast cannot act: the casts it would make, made by a function mode.

``torch.autocast`` acts through a dispatch key of real devices (CUDA, CPU): a model on ``meta``
runs under it in float32 and its profile shows float32 activations, twice a bf16 run's.
:class:`MetaAutocast` makes the same casts at the same level (above autograd, so the cast
copies are what autograd saves, as under autocast): before each function of autocast's lists
it casts the floating-point tensor arguments, to the lower precision (matrix products,
convolutions, attention), to float32 (losses, and on CUDA softmax, normalisations, reductions
that need range) or to the widest among them (ops that mix dtypes). Like autocast it casts a
leaf that requires grad (a weight) once per region and keeps the copy until the region ends.

The lists follow PyTorch's autocast op lists for ``cuda`` and ``cpu``
(``aten/src/ATen/autocast_mode.cpp``), by function name as ``torch.overrides`` sees them
(``linear``, ``matmul``, ``softmax``, ``cross_entropy``). What is left uncast (an op autocast
casts only inside another function: CPU's recurrent cells) and how the lists were checked
(``tests/test_fit.py``): docs/guide.md, "Fitting a device" (Autocast).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["LOWER", "TO_FLOAT32", "MetaAutocast", "meta_autocast_now"]

_MATMULS = {
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linear",
    "addbmm", "baddbmm", "bmm", "chain_matmul", "multi_dot", "scaled_dot_product_attention",
}  # fmt: skip
# CUDA's autocast lists the recurrent cells; CPU's casts only the products inside them (docstring)
_CELLS = {"lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"}
_LOSSES = {
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss",
    "cosine_embedding_loss", "hinge_embedding_loss", "margin_ranking_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "multilabel_margin_loss", "ctc_loss",
}  # fmt: skip
# function names autocast runs in the lower precision, by device type
LOWER: dict[str, frozenset[str]] = {
    "cuda": frozenset(_MATMULS | _CELLS),
    "cpu": frozenset(_MATMULS - {"addmv", "addr", "einsum", "mv", "chain_matmul", "multi_dot"}),
}
# ... and in float32
TO_FLOAT32: dict[str, frozenset[str]] = {
    "cuda": frozenset(_LOSSES | {
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "group_norm",
        "norm", "cosine_similarity", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "softmax", "log_softmax", "cumsum", "cumprod", "sum", "prod",
    }),
    "cpu": frozenset(_LOSSES | {"cdist", "prod", "trace", "grid_sampler", "stft"}),
}  # fmt: skip
_WIDEST = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "tensordot",
                     "index_put", "scatter_add", "cat", "stack"})  # fmt: skip


class MetaAutocast(TorchFunctionMode):
    """The casts of ``torch.autocast(device_type, dtype)``, as a function mode (module
    docstring). Use around a step on ``meta`` that will run under autocast on the device."""

    def __init__(self, device_type: str, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if device_type not in LOWER:
            raise ValueError(f"device_type must be one of {list(LOWER)}, got {device_type!r}")
        self.lower, self.fp32 = LOWER[device_type], TO_FLOAT32[device_type]
        self.device_type, self.dtype = device_type, dtype
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "").strip("_")
        dtype = self.dtype if name in self.lower else torch.float32 if name in self.fp32 else None
        if dtype is None and name in _WIDEST:
            dtype = _widest((args, kwargs))
        if dtype is not None:
            args, kwargs = tree_map(lambda v: self._cast(v, dtype), (args, kwargs))
        return func(*args, **kwargs)

    def again(self) -> MetaAutocast:
        """A region of its own with the same casts (what a recompute runs in: checkpoint
        enters an autocast region of its own for it, whose cast cache starts empty)."""
        return MetaAutocast(self.device_type, self.dtype)

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        floating = isinstance(value, torch.Tensor) and value.is_floating_point()
        if not floating or value.dtype in (dtype, torch.float64):
            return value
        leaf = value.is_leaf and value.requires_grad
        cacheable = leaf and dtype == self.dtype and torch.is_grad_enabled()
        if not cacheable:
            return value.to(dtype)
        if id(value) not in self.cache:
            self.cache[id(value)] = (value, value.to(dtype))
        return self.cache[id(value)][1]

    def __exit__(self, *exc: Any) -> Any:
        self.cache.clear()
        return super().__exit__(*exc)


def _widest(tree: Any) -> torch.dtype | None:
    floats = (v for v in tree_leaves(tree) if isinstance(v, torch.Tensor) and v.is_floating_point())
    return max((v.dtype for v in floats), key=lambda d: torch.finfo(d).bits, default=None)


def meta_autocast_now() -> MetaAutocast | None:
    """The innermost :class:`MetaAutocast` active where this is called, or ``None``."""
    found = [m for m in _get_current_function_mode_stack() if isinstance(m, MetaAutocast)]
    return found[-1] if found else None

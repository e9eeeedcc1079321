"""Meta kernels remembered (``autoremat.record.meta_kernels``): the same outputs as the kernel
gives, views and in-place ops never remembered, and a step on ``meta`` priced the same."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import autoremat
from autoremat.examples import llama_on_meta
from autoremat.record import meta_kernels
from autoremat.record.meta_kernels import RememberedKernels

aten = torch.ops.aten


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype)


@pytest.mark.parametrize(
    "func, args",
    [
        (aten.mm.default, (meta(4, 8), meta(8, 3))),
        (aten.add.Tensor, (meta(4, 8), meta(8))),
        (aten.native_layer_norm.default, (meta(2, 5, 8), [8], meta(8), meta(8), 1e-5)),
        (aten._to_copy.default, (meta(4, 8).t(),)),
        (aten.cat.default, ([meta(2, 3), meta(4, 3)],)),
    ],
)
def test_a_remembered_op_gives_what_its_kernel_gives(func: Any, args: tuple) -> None:
    """Twice through the memory: the second answer, made without the kernel, has the kernel's
    shapes, strides and dtypes, in new storages of the same size."""
    meta_kernels._SEEN.clear()
    first = meta_kernels.run_kernel(func, args, {})
    assert len(meta_kernels._SEEN) == 1 and next(iter(meta_kernels._SEEN.values()))
    again = meta_kernels.run_kernel(func, args, {})
    for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (first, again)), strict=True):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
        assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
        assert a.untyped_storage()._cdata != b.untyped_storage()._cdata


def test_views_in_place_ops_and_other_devices_run_their_kernel_every_time() -> None:
    meta_kernels._SEEN.clear()
    x = meta(4, 8)
    view = meta_kernels.run_kernel(aten.view.default, (x, [8, 4]), {})
    assert view.untyped_storage()._cdata == x.untyped_storage()._cdata
    meta_kernels.run_kernel(aten.add_.Tensor, (x, x), {})
    meta_kernels.run_kernel(aten.mm.default, (torch.ones(2, 2), torch.ones(2, 2)), {})
    assert not meta_kernels._SEEN


def test_a_step_on_meta_is_priced_the_same_and_its_layers_kernels_run_once(monkeypatch) -> None:
    """A Llama on meta: its forward remembers as many kernels with 4 identical layers as with
    one (the later layers' ops are all met before), and the whole step's memory is the same
    with the kernels remembered and without."""
    seen = []
    for layers in (1, 4):
        model, args, kwargs = llama_on_meta(layers=layers)
        meta_kernels._SEEN.clear()
        with RememberedKernels():
            model(*args, **kwargs)
        seen.append(len(meta_kernels._SEEN))
    assert seen[0] == seen[1] > 0
    remembered = autoremat.predict_memory(model, args, kwargs)
    monkeypatch.setattr(meta_kernels, "_key", lambda *a: None)
    assert autoremat.predict_memory(model, args, kwargs) == remembered

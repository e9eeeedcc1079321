"""What "the model left exactly as found" means in the library zoo: :func:`state_of` takes
every piece of a model's state a training run depends on, :func:`changes` lists what differs
between two such snapshots, and :func:`probe` runs the model the way a user inspects it
(``output_hidden_states=True`` on a Hugging Face model), so a hook lost on the way shows."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

from autoremat.core.nested import iter_tensors

__all__ = ["changes", "probe", "state_of"]

HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)
PLAIN = (bool, int, float, str, type(None))


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, PLAIN)


def _attributes(module: nn.Module) -> dict[str, Any]:
    """The module's own plain attributes (numbers, strings, flags, tuples of them; of the
    private ones, flags only: transformers' ``_output_capturing_hooks_installed``)."""
    return {
        k: v
        for k, v in vars(module).items()
        if (isinstance(v, bool) if k.startswith("_") else _plain(v))
    }


def state_of(model: nn.Module) -> dict[str, Any]:
    """Parameters and buffers (values, ``requires_grad``), every module's mode, plain
    attributes and hook counts, and the host's random generators."""
    return {
        "tensors": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "requires_grad": {k: p.requires_grad for k, p in model.named_parameters()},
        "modules": {
            path: (
                type(m).__name__,
                m.training,
                _attributes(m),
                tuple(len(getattr(m, h, {})) for h in HOOK_DICTS),
            )
            for path, m in model.named_modules()
        },
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tobytes()),
    }


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between two :func:`state_of` snapshots, in words (empty: nothing)."""
    found = []
    t0, t1 = before["tensors"], after["tensors"]
    if t0.keys() != t1.keys():
        found.append(f"state_dict keys {sorted(t0.keys() ^ t1.keys())[:3]}")
    found += [f"value of {k}" for k in t0.keys() & t1.keys() if not torch.equal(t0[k], t1[k])]
    if before["requires_grad"] != after["requires_grad"]:
        found.append("requires_grad")
    m0, m1 = before["modules"], after["modules"]
    if m0.keys() != m1.keys():
        found.append(f"modules {sorted(m0.keys() ^ m1.keys())[:3]}")
    for path in m0.keys() & m1.keys():
        if m0[path] != m1[path]:
            found.append(f"module {path or '(root)'}: {_difference(m0[path], m1[path])}")
    r0, r1 = before["rng"], after["rng"]
    if not torch.equal(r0[0], r1[0]) or r0[1:] != r1[1:]:
        found.append("the random generators' state")
    return sorted(found)[:6]


def _difference(a: tuple[Any, ...], b: tuple[Any, ...]) -> str:
    if a[1] != b[1]:
        return "training mode"
    if a[3] != b[3]:
        return f"hook counts {a[3]} -> {b[3]}"
    keys = {k for k in a[2].keys() | b[2].keys() if a[2].get(k) != b[2].get(k)}
    return "attributes " + ", ".join(f"{k}: {a[2].get(k)!r} -> {b[2].get(k)!r}" for k in keys)


def probe(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor of one eval-mode forward without gradients (``output_hidden_states=True``
    on a Hugging Face model), the model's mode and the random state put back."""
    hf = hasattr(getattr(model, "config", None), "output_hidden_states")  # transformers'
    extra = {"output_hidden_states": True} if hf else {}
    was_training = model.training
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        model.eval()
        try:
            output = model(*args, **kwargs, **extra)
        finally:
            model.train(was_training)
    return [t for _, t in iter_tensors(output)]

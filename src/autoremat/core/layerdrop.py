"""LayerDrop off while autoremat runs a step of the model: every layer runs.

LayerDrop (transformers' BART, mBART, Marian, PLBart, Whisper, wav2vec2 and others; fairseq)
skips each layer of a stack at random in training, with a probability kept on the stack's
module (``self.layerdrop``) or its config (``layerdrop``, ``encoder_layerdrop``,
``decoder_layerdrop``, ...). A step that happened to skip a layer holds less than one that
runs them all: a plan made from it could exceed its budget on the next step, and two steps
differ, so ``fit`` could not scale them. Autoremat's own steps (the profile, each plan's run,
``fit``'s steps, ``measure``) run every layer, the most a step holds: :func:`every_layer`,
entered by :func:`autoremat.core.nested.run_model`. The user's training is not touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["every_layer"]


@contextlib.contextmanager
def every_layer(model: nn.Module) -> Iterator[None]:
    """Inside, every positive float attribute named ``*layerdrop`` of ``model``'s modules and
    of their ``config`` is 0.0; put back on exit."""
    changed: list[tuple[object, str, float]] = []
    try:
        for module in model.modules():
            for owner in (module, getattr(module, "config", None)):
                for name, value in list(getattr(owner, "__dict__", {}).items()):
                    if name.endswith("layerdrop") and type(value) is float and value > 0:
                        changed.append((owner, name, value))
                        setattr(owner, name, 0.0)
        yield
    finally:
        for owner, name, value in reversed(changed):
            setattr(owner, name, value)

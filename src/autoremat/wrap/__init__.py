"""Claim 4: the wrap. :func:`apply` wraps plan entries in place so that they are recomputed in
backward through ``torch.utils.checkpoint``, :func:`remove` undoes it; :func:`wrapped_paths`
and :func:`selective_paths` say what is wrapped. The files: ``checkpointed`` (the wrapped
classes and their ``forward``), ``wrapping`` (apply, remove), ``replay`` (what a recompute
sees), ``calls`` (which calls of a module are recomputed)."""

from autoremat.wrap.checkpointed import selective_paths, wrapped_paths
from autoremat.wrap.wrapping import apply, remove

__all__ = ["apply", "remove", "selective_paths", "wrapped_paths"]

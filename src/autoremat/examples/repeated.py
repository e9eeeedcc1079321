"""Built-in models that run one module many times in a forward (the CLI's, the benchmarks' and
the tests' examples of per-call planning): one transformer block applied at every depth, a
recurrent cell stepped in a Python loop, two towers sharing one encoder. Hugging Face ALBERT,
which applies one shared layer at every depth, is among the examples of
:mod:`autoremat.examples` (``hf-albert``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoremat.examples.models import Block

__all__ = ["CellRNN", "LoopedTransformer", "SharedEncoder", "TwoTower"]


class LoopedTransformer(nn.Module):
    """A decoder whose one pre-norm block (:class:`autoremat.examples.models.Block`) is applied
    ``depth`` times, its weights shared across depth (a looped or recurrent-depth
    transformer). ``forward(idx, targets=None)`` returns a dict with ``logits`` and, given
    targets, ``loss``."""

    def __init__(
        self,
        vocab: int = 512,
        width: int = 128,
        depth: int = 8,
        heads: int = 4,
        context: int = 128,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.depth = depth
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.block = Block(width, heads, dropout)
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for _ in range(self.depth):
            x = self.block(x)
        logits = self.lm_head(self.ln_f(x))
        out = {"logits": logits}
        if targets is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return out


class CellRNN(nn.Module):
    """An ``nn.LSTMCell`` stepped over the sequence in a Python loop, with dropout on each
    step's input, and a classifier on the last hidden state. ``forward(x, targets=None)``
    (``x``: batch x steps x features) returns a dict with ``logits`` and, given targets,
    ``loss``."""

    def __init__(
        self, features: int = 64, hidden: int = 256, classes: int = 10, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.hidden = hidden
        self.drop = nn.Dropout(dropout)
        self.cell = nn.LSTMCell(features, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        h = c = x.new_zeros(x.shape[0], self.hidden)
        for t in range(x.shape[1]):
            h, c = self.cell(self.drop(x[:, t]), (h, c))
        logits = self.head(h)
        out = {"logits": logits}
        if targets is not None:
            out["loss"] = F.cross_entropy(logits, targets)
        return out


class SharedEncoder(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm, mean-pooled."""

    def __init__(
        self, vocab: int, width: int, layers: int, heads: int, context: int, dropout: float
    ):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x).mean(dim=1)


class TwoTower(nn.Module):
    """A two-tower (Siamese) retrieval model: queries and documents go through one shared
    :class:`SharedEncoder`, trained with an in-batch contrastive loss.
    ``forward(query, document)`` returns a dict with ``logits`` (query x document scores) and
    ``loss``."""

    def __init__(
        self,
        vocab: int = 1000,
        width: int = 128,
        layers: int = 2,
        heads: int = 4,
        context: int = 128,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.encoder = SharedEncoder(vocab, width, layers, heads, context, dropout)
        self.scale = nn.Parameter(torch.tensor(10.0))

    def forward(self, query: torch.Tensor, document: torch.Tensor) -> dict[str, torch.Tensor]:
        q = F.normalize(self.encoder(query), dim=-1)
        d = F.normalize(self.encoder(document), dim=-1)
        logits = self.scale * q @ d.T
        target = torch.arange(len(q), device=q.device)
        return {"logits": logits, "loss": F.cross_entropy(logits, target)}

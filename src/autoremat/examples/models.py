"""The plain PyTorch models of the built-in examples: a GPT-2-shaped decoder (its attention,
MLP and block), a VGG-style CNN and a UNet-like encoder-decoder."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "Block", "CausalSelfAttention", "ConvNet", "TinyGPT", "UNet", "conv_bn"]


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.attn_drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A GPT-2-shaped decoder in plain PyTorch: token and position embeddings, pre-norm blocks
    of causal attention and MLP in an ``nn.ModuleList``, a final norm and a tied LM head.
    ``forward(idx, targets=None)`` returns a dict with ``logits`` and, given targets, ``loss``."""

    def __init__(
        self,
        vocab: int = 512,
        width: int = 128,
        layers: int = 4,
        heads: int = 4,
        context: int = 128,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        out = {"logits": logits}
        if targets is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return out


def conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
    )


class ConvNet(nn.Module):
    """A small VGG-style CNN: stages of conv-BatchNorm-ReLU pairs with pooling and dropout."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), classes: int = 10) -> None:
        super().__init__()
        stages, cin = [], 3
        for w in widths:
            stages.append(nn.Sequential(conv_bn(cin, w), conv_bn(w, w), nn.MaxPool2d(2)))
            cin = w
        self.features = nn.Sequential(*stages)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(cin, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class UNet(nn.Module):
    """A UNet-like encoder-decoder: skip connections carry encoder features to the decoder."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), channels: int = 3) -> None:
        super().__init__()
        self.down = nn.ModuleList()
        cin = channels
        for w in widths:
            self.down.append(nn.Sequential(conv_bn(cin, w), conv_bn(w, w)))
            cin = w
        self.pool = nn.MaxPool2d(2)
        self.middle = nn.Sequential(conv_bn(cin, 2 * cin), nn.Dropout2d(0.1), conv_bn(2 * cin, cin))
        self.up = nn.ModuleList()
        for w in reversed(widths):
            self.up.append(nn.Sequential(conv_bn(cin + w, w), conv_bn(w, w)))
            cin = w
        self.out = nn.Conv2d(cin, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for stage in self.down:
            x = stage(x)
            skips.append(x)
            x = self.pool(x)
        x = self.middle(x)
        for stage, skip in zip(self.up, reversed(skips), strict=True):
            x = F.interpolate(x, scale_factor=2.0)
            x = stage(torch.cat([x, skip], dim=1))
        return self.out(x)

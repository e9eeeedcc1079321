"""The benchmark zoo: models whose activations dominate the memory of a training step.

Each entry of :data:`ZOO` is ``name -> factory``; a factory returns ``(model, args, kwargs)``
with fixed random weights (the global random state is not touched), the model in training mode
(dropout on wherever the architecture has it) and example inputs. Sizes are chosen so that one
eager training step takes a fraction of a second on a 2-core CPU while the activations saved for
backward are several times the parameters.

The Hugging Face models are built from configs (random weights, nothing is downloaded).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from autoremat.examples import (
    ConvNet,
    Example,
    TinyGPT,
    UNet,
    hf_albert,
    require_transformers,
    seeded,
)
from autoremat.examples.repeated import CellRNN, LoopedTransformer, TwoTower

SEQ = 256  # tokens per sequence for the language models
VOCAB = 2048  # small vocabulary: the logits do not swamp the blocks' activations


@seeded
def gpt2() -> Example:
    """Hugging Face GPT2LMHeadModel: 4 layers, width 256, 4 heads, batch 4 x 256 tokens."""
    t = require_transformers()
    config = t.GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=SEQ, vocab_size=VOCAB)
    ids = torch.randint(0, VOCAB, (4, SEQ))
    return t.GPT2LMHeadModel(config), (), {"input_ids": ids, "labels": ids}


@seeded
def llama() -> Example:
    """Hugging Face LlamaForCausalLM: 4 layers, width 256, GQA 8/4 heads, batch 2 x 256."""
    t = require_transformers()
    config = t.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=688,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        attention_dropout=0.1,
    )
    ids = torch.randint(0, VOCAB, (2, SEQ))
    return t.LlamaForCausalLM(config), (), {"input_ids": ids, "labels": ids}


@seeded
def bert() -> Example:
    """Hugging Face BertForMaskedLM: 4 layers, width 256, 4 heads, batch 2 x 256."""
    t = require_transformers()
    config = t.BertConfig(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        intermediate_size=1024,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    ids = torch.randint(0, VOCAB, (2, SEQ))
    labels = torch.where(torch.rand(2, SEQ) < 0.15, ids, torch.full_like(ids, -100))
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    return t.BertForMaskedLM(config), (), kwargs


@seeded
def vit() -> Example:
    """Hugging Face ViTForImageClassification: 4 layers, width 256, 128 x 128 images in 8 x 8
    patches (256 tokens), batch 2."""
    t = require_transformers()
    config = t.ViTConfig(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        intermediate_size=1024,
        image_size=128,
        patch_size=8,
        num_labels=10,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    kwargs = {"pixel_values": torch.randn(2, 3, 128, 128), "labels": torch.randint(0, 10, (2,))}
    return t.ViTForImageClassification(config), (), kwargs


@seeded
def gpt_torch() -> Example:
    """GPT-2-like decoder in plain PyTorch (TinyGPT): 4 blocks, width 256, batch 2 x 256."""
    model = TinyGPT(vocab=VOCAB, width=256, layers=4, heads=4, context=SEQ)
    idx = torch.randint(0, VOCAB, (2, SEQ))
    return model, (idx,), {"targets": torch.roll(idx, -1, dims=1)}


@seeded
def cnn() -> Example:
    """VGG-style CNN with BatchNorm and dropout: 4 stages (16-128 channels), batch 8 x 3 x 96^2."""
    return ConvNet(widths=(16, 32, 64, 128)), (torch.randn(8, 3, 96, 96),), {}


@seeded
def unet() -> Example:
    """UNet-like model with skip connections, BatchNorm and dropout: 3 levels (16-64 channels),
    batch 4 x 3 x 96 x 96."""
    return UNet(widths=(16, 32, 64)), (torch.randn(4, 3, 96, 96),), {}


@seeded
def mlp() -> Example:
    """Deep MLP chain: nn.Sequential of 32 Linear(128, 128) + GELU pairs (64 modules), batch
    2048."""
    layers: list[nn.Module] = []
    for _ in range(32):
        layers += [nn.Linear(128, 128), nn.GELU()]
    return nn.Sequential(*layers), (torch.randn(2048, 128),), {}


ZOO: dict[str, Callable[[], Example]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "vit": vit,
    "gpt-torch": gpt_torch,
    "cnn": cnn,
    "unet": unet,
    "mlp": mlp,
}


def albert(layers: int = 6) -> Example:
    """Hugging Face AlbertForMaskedLM: one shared layer applied at each of ``layers`` depths,
    width 256, 4 heads, batch 4 x 48 tokens (Hugging Face's gradient checkpointing does not
    support it): :func:`autoremat.examples.hf_albert` at the zoo's width and vocabulary."""
    return hf_albert(layers, width=256, vocab=VOCAB)


@seeded
def looped() -> Example:
    """One pre-norm transformer block applied 8 times (shared weights), width 256, 4 heads,
    batch 4 x 256 tokens."""
    model = LoopedTransformer(vocab=VOCAB, width=256, depth=8, heads=4, context=SEQ)
    idx = torch.randint(0, VOCAB, (4, SEQ))
    return model, (idx,), {"targets": torch.roll(idx, -1, dims=1)}


@seeded
def lstm_cell() -> Example:
    """An nn.LSTMCell stepped over 64 time steps in a Python loop, 128 features, hidden 512,
    batch 64."""
    model = CellRNN(features=128, hidden=512)
    return model, (torch.randn(64, 64, 128),), {"targets": torch.randint(0, 10, (64,))}


@seeded
def two_tower() -> Example:
    """Two towers sharing one encoder (4 blocks, width 256), in-batch contrastive loss, 16
    queries x 64 tokens and 16 documents x 256 tokens."""
    model = TwoTower(vocab=VOCAB, width=256, layers=4, heads=4, context=SEQ)
    query, document = torch.randint(0, VOCAB, (16, 64)), torch.randint(0, VOCAB, (16, SEQ))
    return model, (query, document), {}


# Models that run one module many times (issue 14; benchmarks/calls.py), each with the path of
# that module: what per-call checkpointing by hand wraps.
REPEATED: dict[str, tuple[Callable[[], Example], str]] = {
    "albert-6": (lambda: albert(6), "albert.encoder.albert_layer_groups.0"),
    "albert-12": (lambda: albert(12), "albert.encoder.albert_layer_groups.0"),
    "looped-8": (looped, "block"),
    "lstm-cell-64": (lstm_cell, "cell"),
    "two-tower": (two_tower, "encoder"),
}

# torch.compile (cold compiles take 30-70 s each here) runs on these by default.
COMPILE_DEFAULT = ("gpt2", "mlp")

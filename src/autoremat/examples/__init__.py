"""Built-in example models for the CLI, the demo, the tests and the benchmarks.

Each factory returns ``(model, args, kwargs)``: a model in training mode with fixed random
weights and example inputs for it, made without touching the global random state. The plain
PyTorch ones need nothing but torch; the ``hf-*`` ones build Hugging Face ``transformers``
architectures from small configs with random weights (nothing is downloaded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autoremat.examples.models import (
    MLP,
    Block,
    CausalSelfAttention,
    ConvNet,
    TinyGPT,
    UNet,
    conv_bn,
)
from autoremat.examples.repeated import CellRNN, LoopedTransformer, TwoTower

__all__ = [
    "EXAMPLES",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "ConvNet",
    "Example",
    "TinyGPT",
    "UNet",
    "cnn",
    "conv_bn",
    "gpt2",
    "hf_albert",
    "hf_bert",
    "hf_gpt2",
    "hf_llama",
    "hf_vit",
    "llama_on_meta",
    "looped",
    "lstm_cell",
    "mlp",
    "require_transformers",
    "seeded",
    "two_tower",
    "unet",
]

Example = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


def seeded(build: Callable[..., Example]) -> Callable[..., Example]:
    """``build`` made reproducible: it runs with the global RNG seeded at 0 (and put back
    after), and returns the model in training mode. Arguments go to ``build`` (a size)."""

    def factory(*a: Any, **kw: Any) -> Example:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model, args, kwargs = build(*a, **kw)
        return model.train(), args, kwargs

    factory.__doc__ = build.__doc__
    factory.__name__ = build.__name__
    return factory


@seeded
def gpt2() -> Example:
    """GPT-2-like decoder (plain PyTorch): 4 blocks, width 128, batch 8 x 128 tokens."""
    model = TinyGPT()
    idx = torch.randint(0, 512, (8, 128))
    return model, (idx,), {"targets": torch.roll(idx, -1, dims=1)}


@seeded
def cnn() -> Example:
    """VGG-style CNN with BatchNorm and dropout: 3 stages, batch 16 x 3 x 64 x 64."""
    return ConvNet(), (torch.randn(16, 3, 64, 64),), {}


@seeded
def unet() -> Example:
    """UNet-like model with skip connections, BatchNorm and dropout: batch 4 x 3 x 64 x 64."""
    return UNet(), (torch.randn(4, 3, 64, 64),), {}


@seeded
def mlp() -> Example:
    """Deep MLP chain (nn.Sequential of 16 Linear+GELU layers, width 256), batch 2048."""
    layers: list[nn.Module] = []
    for _ in range(16):
        layers += [nn.Linear(256, 256), nn.GELU()]
    return nn.Sequential(*layers), (torch.randn(2048, 256),), {}


def require_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError(
            "the hf-* examples need Hugging Face transformers: pip install transformers"
        ) from exc
    transformers.logging.set_verbosity_error()
    return transformers


@seeded
def hf_gpt2() -> Example:
    """Hugging Face GPT2LMHeadModel, 4 layers, width 128, batch 4 x 128, labels given."""
    t = require_transformers()
    config = t.GPT2Config(n_layer=4, n_embd=128, n_head=4, n_positions=256, vocab_size=1000)
    ids = torch.randint(0, 1000, (4, 128))
    return t.GPT2LMHeadModel(config), (), {"input_ids": ids, "labels": ids}


@seeded
def hf_bert() -> Example:
    """Hugging Face BertForSequenceClassification, 4 layers, width 128, batch 4 x 128."""
    t = require_transformers()
    config = t.BertConfig(
        num_hidden_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        intermediate_size=512,
        vocab_size=1000,
        max_position_embeddings=256,
    )
    ids = torch.randint(0, 1000, (4, 128))
    kwargs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.randint(0, 2, (4,)),
    }
    return t.BertForSequenceClassification(config), (), kwargs


@seeded
def hf_llama() -> Example:
    """Hugging Face LlamaForCausalLM, 4 layers, width 128, GQA 4/2 heads, batch 4 x 128."""
    t = require_transformers()
    config = t.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=344,
        vocab_size=1000,
        max_position_embeddings=256,
        attention_dropout=0.1,
    )
    ids = torch.randint(0, 1000, (4, 128))
    return t.LlamaForCausalLM(config), (), {"input_ids": ids, "labels": ids}


@seeded
def hf_vit() -> Example:
    """Hugging Face ViTForImageClassification, 4 layers, width 128, 64x64 images, batch 8."""
    t = require_transformers()
    config = t.ViTConfig(
        num_hidden_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        intermediate_size=512,
        image_size=64,
        patch_size=8,
        num_labels=10,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    kwargs = {"pixel_values": torch.randn(8, 3, 64, 64), "labels": torch.randint(0, 10, (8,))}
    return t.ViTForImageClassification(config), (), kwargs


@seeded
def hf_albert(layers: int = 6, width: int = 128, vocab: int = 1000) -> Example:
    """Hugging Face AlbertForMaskedLM: one shared layer applied at each of 6 depths, width
    128, batch 4 x 48, labels given (Hugging Face's own gradient checkpointing does not
    support it). Other sizes: ``layers``, ``width`` (embeddings half, MLP four times it),
    ``vocab``."""
    t = require_transformers()
    config = t.AlbertConfig(
        vocab_size=vocab,
        embedding_size=width // 2,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=4 * width,
        max_position_embeddings=64,
    )
    ids = torch.randint(0, vocab, (4, 48))
    return t.AlbertForMaskedLM(config), (), {"input_ids": ids, "labels": ids}


@seeded
def looped() -> Example:
    """One transformer block applied 8 times (shared weights), width 128, batch 8 x 64."""
    idx = torch.randint(0, 512, (8, 64))
    return LoopedTransformer(), (idx,), {"targets": torch.roll(idx, -1, dims=1)}


@seeded
def lstm_cell() -> Example:
    """An nn.LSTMCell stepped over 64 time steps in a Python loop, hidden 256, batch 32."""
    return CellRNN(), (torch.randn(32, 64, 64),), {"targets": torch.randint(0, 10, (32,))}


@seeded
def two_tower() -> Example:
    """Two towers sharing one 2-block encoder (width 128), in-batch contrastive loss, batch 16
    queries x 32 tokens and 16 documents x 96 tokens."""
    query, document = torch.randint(0, 1000, (16, 32)), torch.randint(0, 1000, (16, 96))
    return TwoTower(), (query, document), {}


def llama_on_meta(
    layers: int = 32,
    width: int = 4096,
    heads: int = 32,
    ffn: int = 11008,
    batch: int = 1,
    sequence: int = 4096,
) -> Example:
    """A Hugging Face LlamaForCausalLM built on the ``meta`` device (no memory), Llama-2-7B's
    shape by default, with meta ``input_ids`` and ``labels``: for profiling and planning big
    models without their memory. Not in :data:`EXAMPLES`, since nothing on meta can train."""
    t = require_transformers()
    config = t.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=ffn,
        vocab_size=32000,
        max_position_embeddings=sequence,
    )
    with torch.device("meta"):
        model = t.LlamaForCausalLM(config)
        ids = torch.randint(0, 32000, (batch, sequence))
    return model, (), {"input_ids": ids, "labels": ids}


EXAMPLES: dict[str, Callable[[], Example]] = {
    "gpt2": gpt2,
    "cnn": cnn,
    "unet": unet,
    "mlp": mlp,
    "hf-gpt2": hf_gpt2,
    "hf-bert": hf_bert,
    "hf-llama": hf_llama,
    "hf-vit": hf_vit,
    "hf-albert": hf_albert,
    "looped": looped,
    "lstm-cell": lstm_cell,
    "two-tower": two_tower,
}

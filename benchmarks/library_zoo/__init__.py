"""The library zoo: real architectures from torchvision, timm, diffusers, transformers and
peft, small configs, for ``make zoo`` (:mod:`library_zoo.check`, ``python -m library_zoo``)
and ``tests/test_library_zoo.py``.

Needs the ``zoo`` extra (``pip install -e '.[dev,zoo]'``; ``make zoo`` makes ``.venv-zoo``).
Importing this package first makes torchvision importable beside the CPU build of torch
(:mod:`library_zoo.torchvision_cpu`), which transformers, timm and diffusers need too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from autoremat.examples import Example
from library_zoo.torchvision_cpu import allow_import

allow_import()

from library_zoo import diffusion, language, vision  # noqa: E402

__all__ = ["ZOO", "ZooModel", "own_checkpointing_on"]


@dataclass(frozen=True)
class ZooModel:
    """One architecture: ``build()`` gives ``(model, args, kwargs)``; ``library`` it comes
    from; ``exercises``: what in it autoremat must get right."""

    name: str
    library: str
    exercises: str
    build: Callable[[], Example]


def _entries() -> list[ZooModel]:
    table = [
        (vision.tv_resnet18, "torchvision", "BatchNorm, in-place ReLU, residuals"),
        (vision.tv_densenet, "torchvision", "named Sequential, dense list inputs"),
        (vision.tv_regnet, "torchvision", "named Sequential, squeeze-excite"),
        (vision.tv_efficientnet, "torchvision", "squeeze-excite, stochastic depth"),
        (vision.tv_mobilenet_v3, "torchvision", "in-place hardswish, squeeze-excite"),
        (vision.tv_convnext, "torchvision", "layer scale, stochastic depth"),
        (vision.tv_swin, "torchvision", "windowed attention, stochastic depth"),
        (vision.tv_vit, "torchvision", "vision transformer, dropout"),
        (vision.tv_squeezenet, "torchvision", "in-place ReLU into concatenation"),
        (vision.timm_vit, "timm", "drop path, own checkpointing switch"),
        (vision.timm_levit, "timm", "named Sequentials, BatchNorm in linears"),
        (vision.timm_convnext, "timm", "drop path, LayerNorm2d"),
        (vision.timm_seresnet, "timm", "squeeze-excite, BatchNorm"),
        (vision.timm_efficientnet, "timm", "BatchNormAct, drop path"),
        (vision.timm_swin, "timm", "windowed attention, drop path"),
        (vision.timm_mixer, "timm", "token and channel MLPs"),
        (diffusion.df_unet_conditional, "diffusers", "conditional UNet, cross-attention"),
        (diffusion.df_unet, "diffusers", "UNet with self-attention, dropout"),
        (diffusion.df_vae, "diffusers", "VAE with a sampled posterior"),
        (language.hf_gpt2, "transformers", "decoder, Conv1D, dropout"),
        (language.hf_llama, "transformers", "decoder, rotary, GQA"),
        (language.hf_gemma2, "transformers", "sliding-window decoder, soft-capping"),
        (language.hf_phi, "transformers", "parallel attention and MLP"),
        (language.hf_gpt_neox, "transformers", "parallel residual decoder"),
        (language.hf_falcon, "transformers", "multi-query decoder"),
        (language.hf_bert, "transformers", "encoder, masked LM"),
        (language.hf_deberta_v2, "transformers", "relative-position encoder"),
        (language.hf_modernbert, "transformers", "local/global encoder"),
        (language.hf_bart, "transformers", "encoder-decoder, LayerDrop"),
        (language.hf_t5, "transformers", "encoder-decoder, relative buckets"),
        (language.hf_mamba, "transformers", "state-space scan"),
        (language.hf_rwkv, "transformers", "recurrent state over tokens"),
        (language.hf_recurrent_gemma, "transformers", "gated linear recurrence"),
        (language.hf_zamba2, "transformers", "hybrid Mamba-2/attention, layers of two classes"),
        (language.hf_wav2vec2, "transformers", "audio CTC, SpecAugment masks from NumPy"),
        (language.hf_olmoe, "transformers", "mixture of experts, router loss"),
        (language.hf_mixtral, "transformers", "mixture of experts, router loss"),
        (language.peft_lora_llama, "peft", "LoRA on a decoder, frozen base"),
        (language.peft_lora_vit, "peft", "LoRA on a timm ViT, frozen base"),
    ]
    return [
        ZooModel(build.__name__, library, exercises, build) for build, library, exercises in table
    ]


ZOO: dict[str, ZooModel] = {m.name: m for m in _entries()}


def own_checkpointing_on(model: nn.Module) -> bool:
    """Switch the model's own activation checkpointing on, as its library does; False when it
    has none (torchvision) or does not support it."""
    for method, args in (
        ("gradient_checkpointing_enable", ()),  # transformers (and peft, which forwards it)
        ("enable_gradient_checkpointing", ()),  # diffusers
        ("set_grad_checkpointing", (True,)),  # timm
    ):
        switch = getattr(model, method, None)
        if callable(switch):
            try:
                switch(*args)
            except (ValueError, NotImplementedError, AttributeError):
                return False
            return True
    return False

"""The library zoo's vision models: torchvision and timm classifiers, small configs.

Each factory returns ``(model, args, kwargs)``: random weights (seeded), training mode, a batch
of images. Dropout, stochastic depth and drop path are on wherever the architecture has them.
"""

from __future__ import annotations

import torch

from autoremat.examples import Example, seeded

IMAGES = 4  # images per batch
CLASSES = 10


def _images(size: int, batch: int = IMAGES) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch, 3, size, size),)


# --- torchvision ---------------------------------------------------------------------------


@seeded
def tv_resnet18() -> Example:
    """torchvision ResNet-18 (BatchNorm, in-place ReLU, residual adds), 96 px."""
    from torchvision import models

    return models.resnet18(num_classes=CLASSES), _images(96), {}


@seeded
def tv_densenet() -> Example:
    """torchvision DenseNet (named Sequential, dense connectivity: each layer gets the list of
    all earlier features, appended to after the call), growth 8, blocks 2-2-2-2, 32 px."""
    from torchvision.models import DenseNet

    model = DenseNet(growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16,
                     num_classes=CLASSES, drop_rate=0.1)
    return model, _images(32), {}


@seeded
def tv_regnet() -> Example:
    """torchvision RegNetY-400MF (named Sequential stages, squeeze-excite), 32 px."""
    from torchvision import models

    return models.regnet_y_400mf(num_classes=CLASSES), _images(32), {}


@seeded
def tv_efficientnet() -> Example:
    """torchvision EfficientNet-B0 (squeeze-excite, stochastic depth, dropout), 32 px."""
    from torchvision import models

    return models.efficientnet_b0(num_classes=CLASSES), _images(32), {}


@seeded
def tv_mobilenet_v3() -> Example:
    """torchvision MobileNetV3-Small (squeeze-excite, in-place hardswish), 32 px."""
    from torchvision import models

    return models.mobilenet_v3_small(num_classes=CLASSES), _images(32), {}


@seeded
def tv_convnext() -> Example:
    """torchvision ConvNeXt (layer scale, stochastic depth 0.1), widths 32-64, 32 px."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    settings = [CNBlockConfig(32, 64, 2), CNBlockConfig(64, None, 2)]
    model = ConvNeXt(settings, stochastic_depth_prob=0.1, num_classes=CLASSES)
    return model, _images(32), {}


@seeded
def tv_swin() -> Example:
    """torchvision Swin Transformer (windowed attention, shifted windows, stochastic depth),
    width 32, depths 2-2, 32 px."""
    from torchvision.models import SwinTransformer

    model = SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                            window_size=[4, 4], stochastic_depth_prob=0.1, dropout=0.1,
                            num_classes=CLASSES)
    return model, _images(32), {}


@seeded
def tv_vit() -> Example:
    """torchvision VisionTransformer: 4 layers, width 64, patch 8, dropout 0.1, 32 px."""
    from torchvision.models import VisionTransformer

    model = VisionTransformer(image_size=32, patch_size=8, num_layers=4, num_heads=4,
                              hidden_dim=64, mlp_dim=128, dropout=0.1, attention_dropout=0.1,
                              num_classes=CLASSES)
    return model, _images(32), {}


@seeded
def tv_squeezenet() -> Example:
    """torchvision SqueezeNet 1.1 (Fire modules: in-place ReLU feeding a concatenation), 64 px."""
    from torchvision import models

    return models.squeezenet1_1(num_classes=CLASSES), _images(64), {}


# --- timm ----------------------------------------------------------------------------------


def _timm(name: str, size: int, **overrides: object) -> Example:
    import timm

    model = timm.create_model(name, pretrained=False, num_classes=CLASSES, **overrides)
    return model, _images(size), {}


@seeded
def timm_vit() -> Example:
    """timm ViT-Tiny: depth 4, patch 8, drop path 0.1, dropout 0.1, 64 px (64 tokens)."""
    return _timm("vit_tiny_patch16_224", 64, img_size=64, patch_size=8, depth=4,
                 drop_rate=0.1, drop_path_rate=0.1)


@seeded
def timm_levit() -> Example:
    """timm LeViT-128S (named Sequentials, BatchNorm in every linear, attention biases), 64 px."""
    return _timm("levit_128s", 64, img_size=64, drop_path_rate=0.1)


@seeded
def timm_convnext() -> Example:
    """timm ConvNeXt-Atto (drop path 0.1, LayerNorm2d), 32 px."""
    return _timm("convnext_atto", 32, drop_path_rate=0.1)


@seeded
def timm_seresnet() -> Example:
    """timm ResNet-10-T with squeeze-excite in every block (BatchNorm, drop path), 64 px."""
    return _timm("resnet10t", 64, block_args={"attn_layer": "se"}, drop_path_rate=0.1)


@seeded
def timm_efficientnet() -> Example:
    """timm EfficientNet-B0 (squeeze-excite, drop path 0.1, BatchNormAct), 32 px."""
    return _timm("efficientnet_b0", 32, drop_rate=0.1, drop_path_rate=0.1)


@seeded
def timm_swin() -> Example:
    """timm Swin-Tiny (windowed attention), depths 2-2, width 32, window 4, 32 px."""
    return _timm("swin_tiny_patch4_window7_224", 32, img_size=32, window_size=4, embed_dim=32,
                 depths=(2, 2), num_heads=(2, 4), drop_path_rate=0.1)


@seeded
def timm_mixer() -> Example:
    """timm MLP-Mixer (token and channel MLPs), depth 4, width 64, patch 4, 32 px."""
    from timm.models.mlp_mixer import MlpMixer

    model = MlpMixer(num_classes=CLASSES, img_size=32, patch_size=4, num_blocks=4,
                     embed_dim=64, drop_rate=0.1, drop_path_rate=0.1)
    return model, _images(32), {}

"""The library zoo's diffusers models: a conditional UNet, an unconditional UNet, a VAE, tiny.

Each factory returns ``(model, args, kwargs)`` (random weights, seeded, training mode); the
loss is autoremat's default (the mean square of the output's float tensors).
"""

from __future__ import annotations

import torch

from autoremat.examples import Example, seeded


@seeded
def df_unet_conditional() -> Example:
    """diffusers UNet2DConditionModel: cross-attention to a text embedding, widths 32-64,
    GroupNorm, 16 x 16 latents, batch 2."""
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), norm_num_groups=16, cross_attention_dim=32,
        attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )
    sample = torch.randn(2, 4, 16, 16)
    kwargs = {"timestep": torch.tensor([10, 500]), "encoder_hidden_states": torch.randn(2, 8, 32)}
    return model, (sample,), kwargs


@seeded
def df_unet() -> Example:
    """diffusers UNet2DModel: an unconditional denoiser with a self-attention block, widths
    32-64, dropout 0.1, 32 x 32 images, batch 2."""
    from diffusers import UNet2DModel

    model = UNet2DModel(
        sample_size=32, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(32, 64), norm_num_groups=16, dropout=0.1,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )
    return model, (torch.randn(2, 3, 32, 32),), {"timestep": torch.tensor([3, 700])}


@seeded
def df_vae() -> Example:
    """diffusers AutoencoderKL: encoder, sampled posterior (``sample_posterior=True``: a random
    draw in every forward), decoder; widths 32-64, 32 x 32 images, batch 2."""
    from diffusers import AutoencoderKL

    model = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), norm_num_groups=16,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    )
    return model, (torch.randn(2, 3, 32, 32),), {"sample_posterior": True}

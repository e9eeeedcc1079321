"""The library zoo's language models: transformers decoders, encoders, encoder-decoders, a
state-space model, mixture-of-experts with their router losses, and LoRA through peft.

All from configs (random weights, nothing downloaded): 2 layers, width 64, 4 heads, vocabulary
512, batch 2 x 32 tokens, labels given (the loss is the model's own), dropout on wherever the
config has it.
"""

from __future__ import annotations

from typing import Any

import torch

from autoremat.examples import Example, seeded

VOCAB = 512
TOKENS = 32
BATCH = 2
SMALL: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 64,
}


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, TOKENS))


def _small(cls_name: str, config_name: str, **config: Any) -> Any:
    """transformers' ``cls_name`` from its ``config_name`` at :data:`SMALL` sizes."""
    import transformers

    settings = {**SMALL, **config}
    return getattr(transformers, cls_name)(getattr(transformers, config_name)(**settings))


def _language_model(model: Any) -> Example:
    """``model`` with a batch of tokens as its inputs and labels (its own shifted LM loss)."""
    ids = _ids()
    return model, (), {"input_ids": ids, "labels": ids}


def _causal(cls_name: str, config_name: str, **config: Any) -> Example:
    return _language_model(_small(cls_name, config_name, **config))


@seeded
def hf_gpt2() -> Example:
    """GPT2LMHeadModel (learned positions, Conv1D projections, dropout 0.1)."""
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64,
                                     vocab_size=VOCAB)
    return _language_model(transformers.GPT2LMHeadModel(config))


@seeded
def hf_llama() -> Example:
    """LlamaForCausalLM (RMSNorm, rotary, grouped-query attention 4/2, attention dropout)."""
    return _causal("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2,
                   attention_dropout=0.1)


@seeded
def hf_gemma2() -> Example:
    """Gemma2ForCausalLM (sliding-window and global layers, logit soft-capping, four norms)."""
    return _causal("Gemma2ForCausalLM", "Gemma2Config", num_key_value_heads=2, head_dim=16,
                   sliding_window=16, attention_dropout=0.1)


@seeded
def hf_phi() -> Example:
    """PhiForCausalLM (parallel attention and MLP, partial rotary, residual dropout)."""
    return _causal("PhiForCausalLM", "PhiConfig", resid_pdrop=0.1, attention_dropout=0.1)


@seeded
def hf_gpt_neox() -> Example:
    """GPTNeoXForCausalLM (parallel residual, fused QKV, hidden dropout)."""
    return _causal("GPTNeoXForCausalLM", "GPTNeoXConfig", hidden_dropout=0.1,
                   attention_dropout=0.1)


@seeded
def hf_falcon() -> Example:
    """FalconForCausalLM (multi-query attention, parallel attention)."""
    return _causal("FalconForCausalLM", "FalconConfig", hidden_dropout=0.1,
                   attention_dropout=0.1)


@seeded
def hf_bert() -> Example:
    """BertForMaskedLM (post-norm encoder, dropout 0.1), 15% of tokens labelled."""
    return _masked("BertForMaskedLM", "BertConfig")


@seeded
def hf_deberta_v2() -> Example:
    """DebertaV2ForMaskedLM (disentangled relative attention)."""
    return _masked("DebertaV2ForMaskedLM", "DebertaV2Config")


@seeded
def hf_modernbert() -> Example:
    """ModernBertForMaskedLM (alternating local and global attention, GeGLU)."""
    return _masked("ModernBertForMaskedLM", "ModernBertConfig", global_attn_every_n_layers=2,
                   local_attention=16, mlp_dropout=0.1, attention_dropout=0.1, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)


def _masked(cls_name: str, config_name: str, **config: Any) -> Example:
    model = _small(cls_name, config_name, **config)
    ids = _ids()
    labels = torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))
    labels[:, 0] = ids[:, 0]  # at least one labelled token per row
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    return model, (), kwargs


@seeded
def hf_bart() -> Example:
    """BartForConditionalGeneration (encoder-decoder, cross-attention, LayerDrop 0.1)."""
    import transformers

    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=64, encoder_layerdrop=0.1,
        decoder_layerdrop=0.1,
    )
    return _language_model(transformers.BartForConditionalGeneration(config))


@seeded
def hf_t5() -> Example:
    """T5ForConditionalGeneration (relative position buckets, encoder-decoder, dropout 0.1)."""
    import transformers

    config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128,
                                   num_layers=2, num_heads=4, decoder_start_token_id=0)
    return _language_model(transformers.T5ForConditionalGeneration(config))


@seeded
def hf_mamba() -> Example:
    """MambaForCausalLM (selective state-space scan, the slow path: no CUDA kernels)."""
    import transformers

    config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                      state_size=8, expand=2, conv_kernel=4)
    return _language_model(transformers.MambaForCausalLM(config))


@seeded
def hf_olmoe() -> Example:
    """OlmoeForCausalLM (mixture of 4 experts, top-2, router loss in the loss)."""
    return _causal("OlmoeForCausalLM", "OlmoeConfig", num_experts=4, num_experts_per_tok=2,
                   output_router_logits=True, num_key_value_heads=4)


@seeded
def hf_mixtral() -> Example:
    """MixtralForCausalLM (mixture of 4 experts, top-2, router loss, sliding window)."""
    return _causal("MixtralForCausalLM", "MixtralConfig", num_local_experts=4,
                   num_experts_per_tok=2, output_router_logits=True, num_key_value_heads=2,
                   attention_dropout=0.1)


@seeded
def peft_lora_llama() -> Example:
    """LoRA (rank 8, dropout 0.1) on a Llama's attention projections through peft: the base
    weights frozen, only the adapters train."""
    import peft

    model, args, kwargs = _causal("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2)
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return peft.get_peft_model(model, config), args, kwargs


@seeded
def peft_lora_vit() -> Example:
    """LoRA (rank 4) on a timm ViT's qkv and MLP through peft, the classifier trained too."""
    import peft

    from library_zoo.vision import _timm

    model, args, kwargs = _timm("vit_tiny_patch16_224", 32, img_size=32, patch_size=8, depth=4,
                                drop_path_rate=0.1)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                             target_modules=["qkv", "fc1", "fc2"], modules_to_save=["head"])
    return peft.get_peft_model(model, config), args, kwargs


@seeded
def hf_rwkv() -> Example:
    """RwkvForCausalLM (a recurrent model: time-mixing WKV state stepped over the tokens, the
    CPU path's Python loop)."""
    import transformers

    config = transformers.RwkvConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                     attention_hidden_size=64, intermediate_size=128,
                                     context_length=64)
    return _language_model(transformers.RwkvForCausalLM(config))


@seeded
def hf_recurrent_gemma() -> Example:
    """RecurrentGemmaForCausalLM (Griffin: gated linear recurrences and local attention)."""
    import transformers

    config = transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, intermediate_size=128, lru_width=64, attention_window_size=16,
        block_types=("recurrent", "recurrent", "attention"), head_dim=16,
    )
    return _language_model(transformers.RecurrentGemmaForCausalLM(config))


@seeded
def hf_zamba2() -> Example:
    """Zamba2ForCausalLM (a hybrid: a Mamba-2 layer and a layer of shared attention plus its
    own Mamba-2, two classes, so the model's blocks are its container's layers)."""
    import transformers

    config = transformers.Zamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=128, max_position_embeddings=64,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_headdim=16, mamba_ngroups=1,
        n_mamba_heads=8, layers_block_type=["mamba", "hybrid"],
        layer_types=["mamba", "hybrid"], use_mem_rope=True,
    )
    return _language_model(transformers.Zamba2ForCausalLM(config))


@seeded
def hf_wav2vec2() -> Example:
    """Wav2Vec2ForCTC with SpecAugment (time and feature masks drawn from NumPy's generator
    in training, a recompute must draw the same) and a CTC loss, on 2 x 4,000 samples."""
    import transformers

    config = transformers.Wav2Vec2Config(
        vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, conv_dim=(32, 32, 32), conv_stride=(5, 4, 4),
        conv_kernel=(10, 4, 4), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        mask_time_prob=0.3, mask_time_length=4, mask_feature_prob=0.2,
        mask_feature_length=8, layerdrop=0.0, ctc_loss_reduction="mean",
    )
    labels = torch.randint(1, 32, (BATCH, 8))
    model = transformers.Wav2Vec2ForCTC(config)
    return model, (), {"input_values": torch.randn(BATCH, 4000), "labels": labels}

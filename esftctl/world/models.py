"""Small MoE models of every supported architecture, made from transformers' config classes.

Dimensions are ones vLLM's CPU build accepts (checked by running it): attention head size 64 (MLA: 512 + 64),
bf16 weights. Used by the tiny world (DeepSeek-V2, the ESFT architecture) and by tests of the others.
"""

from __future__ import annotations

from pathlib import Path

import torch


def quiet_transformers() -> None:
    """No progress bars or load reports from transformers (recipes and benches print their own)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


ARCHITECTURES = ("deepseek_v2", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3", "gpt_oss",
                 "qwen3_next")


def tiny_config(architecture: str, vocab_size: int = 512, **overrides):
    """A small config of `architecture` (one of ARCHITECTURES)."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        Glm4MoeConfig,
        GptOssConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
        Qwen3NextConfig,
    )

    common = dict(vocab_size=vocab_size, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    if architecture == "deepseek_v2":
        config = DeepseekV2Config(
            **common, intermediate_size=512, moe_intermediate_size=64, n_routed_experts=16, n_shared_experts=2,
            num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
            qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=64, topk_method="greedy", n_group=1,
            topk_group=1, num_key_value_heads=4)
    elif architecture == "qwen2_moe":
        config = Qwen2MoeConfig(
            **common, num_key_value_heads=2, intermediate_size=512, moe_intermediate_size=128, num_experts=16,
            num_experts_per_tok=4, shared_expert_intermediate_size=256)
    elif architecture == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common, num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=128,
            num_experts=16, num_experts_per_tok=4)
    elif architecture == "mixtral":
        config = MixtralConfig(
            **common, num_key_value_heads=2, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)
    elif architecture == "olmoe":
        config = OlmoeConfig(**common, num_key_value_heads=2, intermediate_size=128, num_experts=16,
                             num_experts_per_tok=4)
    elif architecture == "glm4_moe":  # GLM-4.5(-Air): one group, sigmoid scores with a correction bias
        config = Glm4MoeConfig(
            **common, num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=128,
            n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1, n_group=1,
            topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)
    elif architecture == "deepseek_v3":
        # MLA as DeepSeek-V2's above; routing as DeepSeek-V3's published config: transformers' config class does
        # not write scoring_func and topk_method, which vLLM reads (without them it routes with softmax, no bias)
        config = DeepseekV3Config(
            **common, intermediate_size=512, moe_intermediate_size=64, n_routed_experts=16, n_shared_experts=1,
            num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
            qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=64, num_key_value_heads=4, n_group=4,
            topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid",
            topk_method="noaux_tc")
    elif architecture == "qwen3_next":  # layers 0-2 linear attention (Gated DeltaNet), layer 3 full attention
        config = Qwen3NextConfig(
            **common, num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=128,
            num_experts=16, num_experts_per_tok=4, shared_expert_intermediate_size=256, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64)
    elif architecture == "gpt_oss":  # expert intermediate 192: 2I differs from H, so no transposition goes unseen
        config = GptOssConfig(**common, num_key_value_heads=2, head_dim=64, intermediate_size=192, num_local_experts=8,
                              num_experts_per_tok=2, sliding_window=128)
    else:
        raise ValueError(f"no tiny config for {architecture!r}")
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def build_model(config, seed: int):
    """A freshly initialised causal LM for `config`, float32, seeded. Router correction biases (DeepSeek-V3,
    GLM-4.5) and GPT-OSS's biases and attention sinks, which transformers initialises to zero, are drawn too, so
    that what reads them is seen to read them right."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape) * 0.05)
        if config.model_type == "gpt_oss":
            for name, param in sorted(model.named_parameters()):
                if name.endswith(("bias", "sinks")):
                    param.copy_(torch.randn(param.shape) * 0.02)
    return model


def save_model(model, out_dir: Path, tokenizer=None) -> Path:
    """Save `model` in bf16 safetensors (the hub layout) with its tokenizer beside it."""
    model.to(torch.bfloat16).save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return Path(out_dir)


def make_random_model(architecture: str, out_dir: Path, seed: int = 0, tokenizer=None, **overrides) -> Path:
    """Write a randomly initialised tiny model of `architecture` to `out_dir`."""
    vocab = len(tokenizer) if tokenizer is not None else 512
    return save_model(build_model(tiny_config(architecture, vocab_size=max(vocab, 512), **overrides), seed),
                      out_dir, tokenizer)

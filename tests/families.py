"""Tiny random targets of the families users train drafters for, built from their Hugging Face configs
with the embedded tiny target's tokenizer (nothing downloaded): 4 decoder layers, hidden 64."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import TINY_TARGET

MASK_ID = 3  # <|mask|> of the tiny tokenizer

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=4096)
_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
# GatedDeltaNet hybrids: three linear-attention layers, then full attention (Qwen3.5 / Qwen3-Next's pattern)
_HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               layer_types=["linear_attention"] * 3 + ["full_attention"])
# multi-head latent attention (DeepSeek-V3, GLM-5); head_dim is the RoPE part of a head
_MLA = dict(kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8,
            num_key_value_heads=4, n_group=1, topk_group=1, n_routed_experts=4, n_shared_experts=1,
            first_k_dense_replace=1)
_WINDOWED = dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2)

# model_type -> what its tiny config sets beyond _COMMON (None: leaves it out); windows and top-k are far
# below the documents' length
FAMILIES = {
    "qwen3": {},
    "llama": {},
    "mistral": dict(sliding_window=16),
    "gemma3_text": dict(_WINDOWED, query_pre_attn_scalar=16),
    "qwen3_moe": dict(_MOE, num_experts=4),
    "qwen3_5_text": dict(_HYBRID),
    "qwen3_5_moe_text": dict(_HYBRID, **_MOE, num_experts=4, shared_expert_intermediate_size=32,
                             intermediate_size=None),  # as its real configs: no dense MLP width
    "qwen3_next": dict(_HYBRID, **_MOE, num_experts=4, shared_expert_intermediate_size=32),
    "gpt_oss": dict(_WINDOWED, num_local_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(_MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1),
    "deepseek_v3": dict(_MLA, **_MOE),
    "glm_moe_dsa": dict(_MLA, **_MOE, index_topk=16, index_head_dim=16, index_n_heads=2),
}
HYBRIDS = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
MOE = ("qwen3_moe", "qwen3_5_moe_text", "qwen3_next", "gpt_oss", "glm4_moe", "deepseek_v3", "glm_moe_dsa")


def tiny_target(model_type: str, path: Path, seed: int = 0) -> Path:
    """A tiny random `model_type` model saved as a Hugging Face folder (fp32) with the tiny tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    sizes = {k: v for k, v in {**_COMMON, **FAMILIES[model_type]}.items() if v is not None}
    config = AutoConfig.for_model(model_type, **sizes, vocab_size=len(tok),
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                                  tie_word_embeddings=False)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path

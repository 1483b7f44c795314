"""Synthetic models for benchmarks: published configs with random weights, built on the device."""
from __future__ import annotations

import copy

LLAMA_3_2_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}

SYNTHETIC_CONFIGS: dict[str, dict] = {
    # a toy size for smoke-testing benchmarks on the CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096,
                 rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 architectures=["LlamaForCausalLM"]),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       architectures=["LlamaForCausalLM"]),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_scaling=LLAMA_3_2_ROPE,
                         architectures=["LlamaForCausalLM"]),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_scaling=LLAMA_3_2_ROPE,
                         architectures=["LlamaForCausalLM"]),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       architectures=["Qwen2ForCausalLM"]),
}


def synthetic_config(name: str):
    """A transformers config for `synthetic:NAME`; ValueError for an unknown name."""
    from transformers import LlamaConfig, Qwen2Config

    if name not in SYNTHETIC_CONFIGS:
        raise ValueError(f"unknown synthetic model {name!r}; known: {', '.join(SYNTHETIC_CONFIGS)}")
    values = copy.deepcopy(SYNTHETIC_CONFIGS[name])  # transformers may edit nested dicts in place
    cls = Qwen2Config if values["architectures"][0] == "Qwen2ForCausalLM" else LlamaConfig
    config = cls(**values)
    config.architectures = values["architectures"]
    return config

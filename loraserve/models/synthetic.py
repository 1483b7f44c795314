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
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
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
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                     use_sliding_window=False, max_window_layers=36, architectures=["Qwen3ForCausalLM"]),
    # the text model of gemma-3-12b-it: 5 sliding-window layers (1024) to 1 full-attention layer
    "gemma-3-12b": dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=256, vocab_size=262208, max_position_embeddings=131072,
                        query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6,
                        rope_theta=1000000.0, rope_local_base_freq=10000.0,
                        rope_scaling={"rope_type": "linear", "factor": 8.0}, rms_norm_eps=1e-6,
                        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                        architectures=["Gemma3ForCausalLM"]),
    "phi-3-mini": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096,
                       original_max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
                       sliding_window=2047, tie_word_embeddings=False, architectures=["Phi3ForCausalLM"]),
}


def synthetic_config(name: str):
    """A transformers config for `synthetic:NAME`; ValueError for an unknown name."""
    from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen2Config, Qwen3Config

    if name not in SYNTHETIC_CONFIGS:
        raise ValueError(f"unknown synthetic model {name!r}; known: {', '.join(SYNTHETIC_CONFIGS)}")
    values = copy.deepcopy(SYNTHETIC_CONFIGS[name])  # transformers may edit nested dicts in place
    classes = {"Qwen2ForCausalLM": Qwen2Config, "Qwen3ForCausalLM": Qwen3Config,
               "Gemma3ForCausalLM": Gemma3TextConfig, "Phi3ForCausalLM": Phi3Config}
    config = classes.get(values["architectures"][0], LlamaConfig)(**values)
    config.architectures = values["architectures"]
    return config

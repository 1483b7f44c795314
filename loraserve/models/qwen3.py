"""Qwen3: the Llama decoder with a per-head RMSNorm of q and k before rotary, an explicit head_dim, tied or
untied embeddings, and Qwen's sliding-window layers (when use_sliding_window is set)."""
from __future__ import annotations

from dataclasses import replace

from loraserve.models.llama import DecoderOptions, LlamaForCausalLM, qwen_sliding_windows


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config) -> DecoderOptions:
        if getattr(config, "attention_bias", False):
            raise ValueError("attention_bias=True (biased q/k/v/o projections) is not supported for Qwen3")
        return replace(super().decoder_options(config), qk_norm=True)

    @classmethod
    def sliding_windows(cls, config) -> list[int | None]:
        return qwen_sliding_windows(config)

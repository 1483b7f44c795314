"""Gemma 2 and the text model of Gemma 3: the Llama decoder with Gemma's options.

Both: embeddings times sqrt(hidden_size) (the factor in the model dtype, as HF),
RMSNorm as x * (1 + w) in fp32, a norm after attention and after the MLP (before
their residual adds), a GeLU-tanh MLP, scores scaled by query_pre_attn_scalar^-0.5,
and sliding-window layers between full-attention ones (`layer_types`, or each
version's alternation rule). Gemma 2 soft-caps attention scores and logits;
Gemma 3 normalizes q and k per head, gives its sliding layers their own rotary
base (rope_local_base_freq) and may soft-cap logits.
"""
from __future__ import annotations

from loraserve.models.hf_config import FULL, SLIDING, activation, layer_types, rope_settings, windows_of
from loraserve.models.llama import DecoderOptions, LayerAttention, LlamaForCausalLM


def gemma_options(config, **more) -> DecoderOptions:
    if getattr(config, "attention_bias", False):
        raise ValueError("attention_bias=True (biased q/k/v/o projections) is not supported for Gemma")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (Gemma as an encoder) is not supported")
    return DecoderOptions(unit_offset_norms=True, sandwich_norms=True,
                          activation=activation(config, "hidden_activation", "hidden_act"),
                          embed_scale=config.hidden_size ** 0.5, attn_scale=config.query_pre_attn_scalar ** -0.5,
                          final_softcap=getattr(config, "final_logit_softcapping", None), **more)


class Gemma2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config) -> DecoderOptions:
        return gemma_options(config, attn_softcap=getattr(config, "attn_logit_softcapping", None))

    @classmethod
    def sliding_windows(cls, config) -> list[int | None]:
        """`layer_types`, else Gemma 2's rule: sliding attention in the even layers."""
        default = [SLIDING if i % 2 == 0 else FULL for i in range(config.num_hidden_layers)]
        return windows_of(config, layer_types(config, default))


class Gemma3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config) -> DecoderOptions:
        return gemma_options(config, qk_norm=True)  # Gemma 3 does not soft-cap attention scores

    @classmethod
    def layer_attention(cls, config) -> list[LayerAttention]:
        """`layer_types`, else Gemma 3's rule (every sliding_window_pattern-th layer is full attention); the
        sliding layers' rotary: rope_local_base_freq, unscaled (transformers 4), or their own rope parameters
        (transformers 5)."""
        pattern = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", 6)
        default = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config.num_hidden_layers)]
        types = layer_types(config, default)
        rope = {kind: gemma3_rope(config, kind) for kind in (SLIDING, FULL)}
        return [LayerAttention(window, *rope[kind]) for window, kind in zip(windows_of(config, types), types)]


def gemma3_rope(config, kind: str) -> tuple[float, dict | None]:
    """(theta, scaling) of Gemma 3's layers of one type."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params.get(kind), dict):  # transformers 5: per layer type
        return rope_settings(config, params[kind])
    if kind == SLIDING:  # transformers 4: the local base, no scaling
        return float(getattr(config, "rope_local_base_freq", 10000.0)), None
    return rope_settings(config)

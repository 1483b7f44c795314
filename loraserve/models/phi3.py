"""Phi-3: the Llama decoder whose checkpoint (and PEFT adapters) keep q/k/v as one `qkv_proj` and gate/up as
one `gate_up_proj`, with LongRoPE scaling (the -128k models) and a sliding window in every layer."""
from __future__ import annotations

from loraserve.models.hf_config import same_window_everywhere
from loraserve.models.llama import DecoderOptions, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # an adapter's qkv_proj: one A for q, k and v, B's rows q, then k, then v (gate_up_proj: gate, then up)
    checkpoint_packed = frozenset({"qkv_proj", "gate_up_proj"})

    @classmethod
    def decoder_options(cls, config) -> DecoderOptions:
        params = getattr(config, "rope_parameters", None) or {}
        for partial in (params.get("partial_rotary_factor", 1.0), getattr(config, "partial_rotary_factor", 1.0)):
            if partial != 1.0:  # transformers 5 keeps it in rope_parameters, 4 beside them
                raise ValueError(f"partial_rotary_factor {partial} (rotary on part of each head) is not supported")
        return super().decoder_options(config)

    @classmethod
    def sliding_windows(cls, config) -> list[int | None]:
        return same_window_everywhere(config)

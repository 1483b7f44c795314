"""The Llama family (Llama 1-3, Mistral, Qwen2, SmolLM2): one decoder, per-architecture options.

Parameter names follow the HF checkpoints except for the packed layers:
`self_attn.qkv_proj` holds q/k/v and `mlp.gate_up_proj` holds gate/up
(`LlamaForCausalLM.packed_modules` says which checkpoint names go where).
"""
from __future__ import annotations

import torch
from torch import nn

from loraserve.forward_context import ForwardContext
from loraserve.models.attention import PagedAttention
from loraserve.models.layers import LMHead, RMSNorm, RotaryEmbedding, VocabEmbedding
from loraserve.models.linear import LinearOutput, PackedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from loraserve.models.lora_spec import LoRAModelSpec, LoRATarget, spec_of_targets
from loraserve.models.ops import silu_and_mul


class LlamaAttention(nn.Module):
    def __init__(self, config, qkv_bias: bool):
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or d // self.num_heads
        self.qkv_proj = QKVParallelLinear(d, self.head_dim, self.num_heads, self.num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, d, bias=False)
        theta, scaling = rope_settings(config)
        rotary = RotaryEmbedding(self.head_dim, config.max_position_embeddings, theta, scaling)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, rotary)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> LinearOutput:
        # x: [T, D] -> o_proj's output [T, D] (and its LoRA delta)
        qkv, qkv_delta = self.qkv_proj(x, ctx)  # [T, q + 2 kv] each
        q, k, v = self.split_heads(qkv)
        deltas = None if qkv_delta is None else self.split_heads(qkv_delta)
        out = self.attn(positions, q, k, v, ctx.attn, deltas)  # [T, H * hd]
        return self.o_proj(out, ctx)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # [T, q + 2 kv] -> views q: [T, H, hd], k, v: [T, KVH, hd]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = PackedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> LinearOutput:
        # x: [T, D] -> down_proj's output [T, D] (and its LoRA delta)
        gate_up, gate_up_delta = self.gate_up_proj(x, ctx)  # [T, 2I] each
        return self.down_proj(silu_and_mul(gate_up, gate_up_delta), ctx)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, x_delta, residual, ctx):
        # x: [T, D] the previous layer's output, x_delta: its LoRA delta (LinearOutput) or None, residual:
        # [T, D] the stream before it (None at layer 0); the residual adds (and LoRA deltas) are fused into
        # the norms: exactly HF's `residual + x` rounded to the dtype. Returns (x, x_delta, residual) for the next.
        if residual is None:
            h, residual = self.input_layernorm(x)[0], x
        else:
            h, residual = self.input_layernorm(x, residual, x_delta)
        h, h_delta = self.self_attn(positions, h, ctx)
        h, residual = self.post_attention_layernorm(h, residual, h_delta)
        return *self.mlp(h, ctx), residual


class LlamaModel(nn.Module):
    def __init__(self, config, qkv_bias: bool):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, qkv_bias) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, ctx):
        x, x_delta, residual = self.embed_tokens(input_ids), None, None  # [T, D]
        for layer in self.layers:
            x, x_delta, residual = layer(positions, x, x_delta, residual, ctx)
        return self.norm(x, residual, x_delta)[0]


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. `forward` returns hidden states; `compute_logits` the fp32 logits of chosen rows."""

    qkv_bias = False
    # packed module -> the checkpoint modules of its output slices, in order (the loader and LoRA read this)
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.qkv_bias)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden: [T, D]
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, V] fp32

    def lora_targets(self) -> list[LoRATarget]:
        """The linear layers LoRA may wrap, in model order."""
        return [LoRATarget(i, parent, attr, self.packed_modules.get(attr, (attr,)))
                for i, layer in enumerate(self.model.layers)
                for parent, attr in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                     (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj"))]

    def lora_spec(self) -> LoRAModelSpec:
        return spec_of_targets(self.lora_targets(), len(self.model.layers))


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama decoder. Sliding-window attention is not implemented, so the engine caps
    max_model_len at the window (`attention_window`), where full attention is the same thing."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama decoder with q/k/v bias."""

    qkv_bias = True


def rope_settings(config) -> tuple[float, dict | None]:
    """(rope theta, rope scaling dict or None) from a transformers 4.x or 5.x config."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or params
    theta = getattr(config, "rope_theta", None) or params.get("rope_theta") or 10000.0
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def attention_window(config) -> int | None:
    """The sliding attention window the config asks for, or None for full attention."""
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2 carries a window it does not use
        return None
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None

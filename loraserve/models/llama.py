"""One decoder for the Llama family and the architectures built on it.

Llama 1-3, Mistral, Qwen2 (q/k/v bias) and SmolLM2 are this decoder as it is;
Qwen3, Gemma 2/3 and Phi-3 (models/qwen3.py, gemma.py, phi3.py) set its
options: `DecoderOptions` (what every layer does) and one `LayerAttention` per
layer (its sliding window and rotary settings). Each architecture is a subclass
of `LlamaForCausalLM` that reads them from its HF config.

Parameter names follow the HF checkpoints except for the packed layers:
`self_attn.qkv_proj` holds q/k/v and `mlp.gate_up_proj` holds gate/up
(`LlamaForCausalLM.packed_modules` says which checkpoint names go where).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

import torch
from torch import nn

from loraserve.distributed import NO_PARALLEL, ParallelGroup
from loraserve.forward_context import ForwardContext
from loraserve.kernels.fused_reference import QKNorm
from loraserve.models.attention import PagedAttention
from loraserve.models.hf_config import (
    FULL,
    SLIDING,
    activation,
    layer_types,
    rope_settings,
    same_window_everywhere,
    windows_of,
)
from loraserve.models.layers import LMHead, RMSNorm, RotaryEmbedding, VocabEmbedding
from loraserve.models.linear import LinearOutput, PackedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from loraserve.models.lora_spec import LoRAModelSpec, LoRATarget, spec_of_targets
from loraserve.models.ops import gelu_tanh_and_mul, silu_and_mul


@dataclass(frozen=True)
class DecoderOptions:
    """What every layer of an architecture does differently from Llama (the defaults)."""

    qkv_bias: bool = False  # q/k/v projections with a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)
    unit_offset_norms: bool = False  # every RMSNorm multiplies by (1 + w) in fp32 (Gemma)
    sandwich_norms: bool = False  # attention and MLP outputs normalized before their residual adds (Gemma 2/3)
    activation: str = "silu"  # of the MLP: "silu" or "gelu_tanh" (Gemma)
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # attention scores' scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention scores soft-capped (Gemma 2)
    final_softcap: float | None = None  # logits soft-capped (Gemma 2)


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention settings: its sliding window (None: full attention) and rotary theta and scaling."""

    window: int | None
    rope_theta: float
    rope_scaling: dict | None

    def rotary_key(self) -> str:
        """Equal for layers that can share one rotary table."""
        return json.dumps([self.rope_theta, self.rope_scaling], sort_keys=True)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Attention over this rank's heads (tensor parallel: q/k/v column-parallel by heads, o row-parallel)."""

    def __init__(self, config, options: DecoderOptions, layer: LayerAttention, rotary: RotaryEmbedding,
                 tp: ParallelGroup = NO_PARALLEL):
        super().__init__()
        d = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(d, self.head_dim, heads, kv_heads, bias=options.qkv_bias, tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.rank_heads, self.qkv_proj.rank_kv_heads  # this rank's
        self.o_proj = RowParallelLinear(heads * self.head_dim, d, bias=False, tp=tp)
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, options.unit_offset_norms)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, options.unit_offset_norms)
        self.qk_norm = options.qk_norm
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, rotary, options.attn_scale,
                                   layer.window, options.attn_softcap)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> LinearOutput:
        # x: [T, D] -> o_proj's output [T, D] (and its LoRA delta)
        qkv, qkv_delta = self.qkv_proj(x, ctx)  # [T, q + 2 kv] each
        q, k, v = self.split_heads(qkv)
        deltas = None if qkv_delta is None else self.split_heads(qkv_delta)
        qk_norm = None
        if self.qk_norm:  # after the LoRA deltas, before rotary: inside the rotary kernel
            qk_norm = QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.unit_offset)
        columns = self.o_proj.input_columns(ctx, x.shape[0])  # room for its LoRA products after each row
        out = self.attn(positions, q, k, v, ctx.attn, deltas, qk_norm, columns)  # [T, H * hd]
        return self.o_proj(out, ctx)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # [T, q + 2 kv] -> views q: [T, H, hd], k, v: [T, KVH, hd]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config, options: DecoderOptions, tp: ParallelGroup = NO_PARALLEL):
        super().__init__()
        self.gate_up_proj = PackedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False,
                                                       tp=tp)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False, tp=tp)
        self.act_and_mul = gelu_tanh_and_mul if options.activation == "gelu_tanh" else silu_and_mul

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> LinearOutput:
        # x: [T, D] -> down_proj's output [T, D] (and its LoRA delta)
        gate_up, gate_up_delta = self.gate_up_proj(x, ctx)  # [T, 2I] each
        columns = self.down_proj.input_columns(ctx, x.shape[0])  # room for its LoRA products after each row
        return self.down_proj(self.act_and_mul(gate_up, gate_up_delta, columns), ctx)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, options: DecoderOptions, layer: LayerAttention, rotary: RotaryEmbedding,
                 tp: ParallelGroup = NO_PARALLEL):
        super().__init__()
        self.self_attn = LlamaAttention(config, options, layer, rotary, tp)
        self.mlp = LlamaMLP(config, options, tp)
        d, eps, unit_offset = config.hidden_size, config.rms_norm_eps, options.unit_offset_norms
        self.input_layernorm = RMSNorm(d, eps, unit_offset)
        # Llama: the norm before the MLP. Gemma: the norm of the attention output, and pre_feedforward_layernorm
        # the one before the MLP; post_feedforward_layernorm normalizes the MLP output.
        self.post_attention_layernorm = RMSNorm(d, eps, unit_offset)
        self.sandwich = options.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(d, eps, unit_offset)
            self.post_feedforward_layernorm = RMSNorm(d, eps, unit_offset)

    @property
    def output_norm(self) -> RMSNorm | None:
        """The norm this layer's output still needs before its residual add (done by the next norm), or None."""
        return self.post_feedforward_layernorm if self.sandwich else None

    def forward(self, positions, x, x_delta, x_norm, residual, ctx):
        # x: [T, D] the previous layer's output, x_delta: its LoRA delta (LinearOutput) or None, x_norm: the
        # previous layer's output_norm, residual: [T, D] the stream before it (None at layer 0). Residual adds,
        # LoRA deltas and Gemma's output norms are fused into the next norm: exactly HF's
        # `residual + norm(x)` rounded to the dtype. Returns (x, x_delta, residual) for the next layer.
        # each norm leaves room after its rows for the LoRA products of the layer it feeds (input_columns)
        columns = self.self_attn.qkv_proj.input_columns(ctx, x.shape[0])
        if residual is None:
            h, residual = self.input_layernorm(x, columns=columns)[0], x
        else:
            h, residual = self.input_layernorm(x, residual, x_delta, x_norm, columns)
        h, h_delta = self.self_attn(positions, h, ctx)
        columns = self.mlp.gate_up_proj.input_columns(ctx, x.shape[0])
        if self.sandwich:
            h, residual = self.pre_feedforward_layernorm(h, residual, h_delta, self.post_attention_layernorm, columns)
        else:
            h, residual = self.post_attention_layernorm(h, residual, h_delta, columns=columns)
        return *self.mlp(h, ctx), residual


class LlamaModel(nn.Module):
    def __init__(self, config, options: DecoderOptions, layers: list[LayerAttention], tp: ParallelGroup = NO_PARALLEL):
        super().__init__()
        rotaries: dict[str, RotaryEmbedding] = {}  # one table per distinct setting, shared by its layers
        for layer in layers:
            if layer.rotary_key() not in rotaries:
                rotaries[layer.rotary_key()] = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                                               layer.rope_theta, layer.rope_scaling)
        self.rotary_embeddings = nn.ModuleList(rotaries.values())
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, options.embed_scale, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, options, layer, rotaries[layer.rotary_key()], tp)
                                    for layer in layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, options.unit_offset_norms)

    def forward(self, input_ids, positions, ctx):
        x, x_delta, x_norm, residual = self.embed_tokens(input_ids), None, None, None  # [T, D]
        for layer in self.layers:
            x, x_delta, residual = layer(positions, x, x_delta, x_norm, residual, ctx)
            x_norm = layer.output_norm
        return self.norm(x, residual, x_delta, x_norm)[0]


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. `forward` returns hidden states; `compute_logits` the fp32 logits of chosen rows.

    A subclass is an architecture: it reads its `decoder_options` and `layer_attention` from the HF config
    (ValueError for settings it does not serve: `check_config`). `tp`: the tensor-parallel group this rank
    belongs to; the model holds this rank's part of every layer.
    """

    # packed module -> the checkpoint modules of its output slices, in order (the loader and LoRA read this)
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    # packed modules that the checkpoint and its PEFT adapters keep as one module (Phi-3)
    checkpoint_packed: frozenset[str] = frozenset()

    def __init__(self, config, tp: ParallelGroup = NO_PARALLEL):
        super().__init__()
        self.config = config
        options = self.decoder_options(config)
        self.model = LlamaModel(config, options, self.layer_attention(config), tp)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, options.final_softcap, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tie_weights()

    @classmethod
    def decoder_options(cls, config) -> DecoderOptions:
        return DecoderOptions(activation=activation(config, "hidden_act"))

    @classmethod
    def layer_attention(cls, config) -> list[LayerAttention]:
        """Per layer: the window of `sliding_windows` and the config's one rotary setting."""
        theta, scaling = rope_settings(config)
        return [LayerAttention(window, theta, scaling) for window in cls.sliding_windows(config)]

    @classmethod
    def sliding_windows(cls, config) -> list[int | None]:
        """Llama: full attention in every layer."""
        return [None] * config.num_hidden_layers

    @classmethod
    def check_config(cls, config) -> None:
        """ValueError naming a setting of `config` this architecture does not serve."""
        cls.decoder_options(config)
        cls.layer_attention(config)

    @classmethod
    def peft_target_modules(cls) -> tuple[str, ...]:
        """The linear modules a PEFT adapter of this architecture may target (HF's module names)."""
        names = []
        for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            names += [attr] if attr in cls.checkpoint_packed else list(cls.packed_modules.get(attr, (attr,)))
        return tuple(names)

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
        return spec_of_targets(self.lora_targets(), len(self.model.layers), self.checkpoint_packed)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama decoder; `sliding_window` (when set) in every layer."""

    @classmethod
    def sliding_windows(cls, config) -> list[int | None]:
        return same_window_everywhere(config)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama decoder with q/k/v bias; with use_sliding_window, a window in the layers from
    max_window_layers on."""

    @classmethod
    def decoder_options(cls, config) -> DecoderOptions:
        return replace(super().decoder_options(config), qkv_bias=True)

    @classmethod
    def sliding_windows(cls, config) -> list[int | None]:
        return qwen_sliding_windows(config)


def qwen_sliding_windows(config) -> list[int | None]:
    """Qwen2 and Qwen3: `layer_types`, or (older configs) sliding attention from layer max_window_layers on
    when use_sliding_window is set."""
    if not getattr(config, "use_sliding_window", False):  # Qwen configs carry a window they do not use
        return [None] * config.num_hidden_layers
    first = getattr(config, "max_window_layers", 0)
    default = [SLIDING if i >= first else FULL for i in range(config.num_hidden_layers)]
    return windows_of(config, layer_types(config, default))

"""Plain-torch versions of the fused elementwise kernels (kernels/fused.py).

They are the engine's CPU path and the kernels' test oracles. Every op rounds
to the model dtype exactly where the HF Llama code does, so in bf16/fp16 they
reproduce HF bit for bit. The optional deltas (a projection's LoRA product,
computed apart from it; float32 or the model dtype) are added to the input
first and rounded to its dtype, as adding them in place into the projection's
output would.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F


class QKNorm(NamedTuple):
    """The per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3): one weight per head dim each."""

    q_weight: torch.Tensor  # [hd]
    k_weight: torch.Tensor  # [hd]
    eps: float
    unit_offset: bool  # Gemma: (1 + w) * x in fp32; else Llama's w * round(x)


def rms_norm_ref(
    x: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, D]
    x_delta: torch.Tensor | None = None,  # [T, D] float32 or x's dtype
    pre_weight: torch.Tensor | None = None,  # [D]
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(s), s or None) with ``s = x + residual`` rounded to the residual's dtype (``s = x`` without
    residual). With a residual, x may be float32 (a row-parallel layer's unrounded sum): it is rounded to the
    residual's dtype first.

    RMSNorm as HF's Llama: ``w * (sf * rsqrt(mean(sf^2) + eps)).to(dtype)``, ``sf = s.float()``, the output
    dtype the promotion of x's and weight's dtypes; with ``unit_offset`` as HF's Gemma:
    ``((sf * rsqrt(mean(sf^2) + eps)) * (1 + w.float())).to(dtype)``. With ``pre_weight`` x is first
    normalized alone with that weight (the same kind and eps) and rounded, before the residual add: Gemma's
    post-attention / post-feedforward norm followed by the residual add and the next norm.
    """
    if residual is not None:
        x = x.to(residual.dtype)
    x = with_delta(x, x_delta)
    if pre_weight is not None:
        x = _normalized(x, pre_weight, eps, unit_offset)
    s = x if residual is None else (x + residual).to(x.dtype)  # [T, D]
    return _normalized(s, weight, eps, unit_offset), (None if residual is None else s)


def _normalized(s: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """RMSNorm of s over its last dimension, rounded as HF's Llama (or, unit_offset, Gemma) norm rounds."""
    sf = s.float()
    normed = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)  # fp32
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(s.dtype)
    return weight * normed.to(s.dtype)


def with_delta(x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """round(x + delta) to x's dtype, or x itself without a delta."""
    return x if delta is None else (x.float() + delta.float()).to(x.dtype)


def silu_and_mul_ref(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """[T, 2I] (+ delta [T, 2I], float32 or the input dtype) -> [T, I]: ``silu(gate) * up`` in the input dtype (gate: the first I
    columns)."""
    gate, up = with_delta(gate_up, delta).chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """[T, 2I] (+ delta) -> [T, I]: ``gelu(gate, approximate="tanh") * up`` in the input dtype (HF's
    gelu_pytorch_tanh, Gemma's MLP)."""
    gate, up = with_delta(gate_up, delta).chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rotary_and_cache_ref(
    q: torch.Tensor,  # [T, H, hd]
    k: torch.Tensor,  # [T, KVH, hd]
    v: torch.Tensor,  # [T, KVH, hd]
    positions: torch.Tensor,  # [T] int
    cos_sin: torch.Tensor,  # [P, hd] fp32: cos in the first hd/2 columns, sin in the last hd/2
    k_cache: torch.Tensor,  # [NB, BS, KVH, hd]
    v_cache: torch.Tensor,  # [NB, BS, KVH, hd]
    slot_mapping: torch.Tensor,  # [T] int, every entry a valid slot
    qkv_delta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # shaped as q, k, v
    qk_norm: QKNorm | None = None,
) -> torch.Tensor:  # [T, H, hd] rotated q, dtype of q
    """Rotate-half (NeoX) rotary on q and k, rotated k and plain v stored at ``slot_mapping``.

    cos/sin are cast to the model dtype first; each product and the sum round
    to the model dtype (``x1*c - x2*s`` has the bits of HF's ``x*cos + rotate_half(x)*sin``).
    With ``qk_norm``, q and k are first normalized per head (after their deltas), rounded as rms_norm_ref.
    """
    if qkv_delta is not None:
        q, k, v = (with_delta(t, d) for t, d in zip((q, k, v), qkv_delta))
    if qk_norm is not None:
        q = _normalized(q, qk_norm.q_weight, qk_norm.eps, qk_norm.unit_offset)
        k = _normalized(k, qk_norm.k_weight, qk_norm.eps, qk_norm.unit_offset)
    half = q.shape[-1] // 2
    cos, sin = cos_sin[positions].to(q.dtype).unsqueeze(1).split(half, dim=-1)  # [T, 1, hd/2] each

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.split(half, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, rotate(k).to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return rotate(q)

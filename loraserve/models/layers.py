"""Small model layers: RMSNorm, rotary embedding (default/linear/llama3 scaling), embedding, LM head."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.models.ops import rms_norm


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back as HF does.

    With a residual, the residual add is fused in: returns (norm(x + residual), x + residual).
    x_delta (a LinearOutput's delta, float32 or x's dtype) is added to x first.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, x_delta: torch.Tensor | None = None):
        # x, residual, x_delta: [T, D] -> (out [T, D], new residual [T, D] or None)
        return rms_norm(x, self.weight, self.eps, residual, x_delta)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (fp32) with the named rope scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """The cos/sin table of rotate-half (NeoX style) rotary embedding, per position.

    `cos_sin: [max_position, head_dim]` fp32 holds cos in the first half and sin
    in the second; models/ops.rotary_and_cache applies it.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        rope_inv_freq(head_dim, theta, scaling)  # validates the scaling type now
        self.register_buffer("cos_sin", torch.empty(max_position, head_dim), persistent=False)

    def reset_buffers(self) -> None:
        """Fill the cos/sin table on the module's device (after meta-device construction)."""
        device = self.cos_sin.device
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        pos = torch.arange(self.max_position, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, hd/2]
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, hd] fp32


class VocabEmbedding(nn.Module):
    """Token embedding [vocab, D] (vocab-parallel with tp_size 1)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, D]
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Logits = h @ W^T with W: [vocab, D]; may share its weight with the embedding."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # h: [N, D] -> [N, vocab] in fp32
        return F.linear(h, self.weight).float()

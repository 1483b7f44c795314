"""Small model layers: RMSNorm, rotary embedding (default/linear/llama3/longrope scaling), the vocab-parallel
embedding and LM head."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.distributed import NO_PARALLEL, ParallelGroup
from loraserve.models.ops import rms_norm


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back as HF does; `unit_offset`: Gemma's
    x * rsqrt(mean(x^2) + eps) * (1 + weight), all in fp32, cast once.

    With a residual, the residual add is fused in: returns (norm(x + residual), x + residual).
    x_delta (a LinearOutput's delta, float32 or x's dtype) is added to x first. x_norm: a norm of the same
    kind and eps that x still needs before the residual add (Gemma's post-attention and post-feedforward
    norms), applied first in the same launch. columns: room after each output row for the next LoRA layer's
    products (LinearBase.input_columns).
    """

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, x_delta: torch.Tensor | None = None,
                x_norm: RMSNorm | None = None, columns: int = 0):
        # x, residual, x_delta: [T, D] -> (out [T, D], new residual [T, D] or None)
        pre_weight = None
        if x_norm is not None:
            assert (x_norm.eps, x_norm.unit_offset) == (self.eps, self.unit_offset), "norms of different kinds"
            pre_weight = x_norm.weight
        return rms_norm(x, self.weight, self.eps, residual, x_delta, pre_weight, self.unit_offset, columns)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (fp32) with the named rope scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
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
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, longrope)")


LONGROPE = ("longrope", "su")  # Phi-3's scaling ("su" its first name)


def rope_type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def check_rope_scaling(head_dim: int, scaling: dict | None) -> None:
    """ValueError naming what is wrong with a rope scaling loraserve can't apply."""
    if rope_type(scaling) not in LONGROPE:
        rope_inv_freq(head_dim, 10000.0, scaling)  # raises for an unknown type
        return
    if not scaling.get("original_max_position_embeddings"):
        raise ValueError("longrope scaling needs original_max_position_embeddings")
    for key in ("short_factor", "long_factor"):
        if len(scaling.get(key) or ()) != head_dim // 2:
            raise ValueError(f"longrope scaling's {key} needs {head_dim // 2} values (head_dim {head_dim}), "
                             f"got {len(scaling.get(key) or ())}")


def rope_cos_sin(head_dim: int, max_position: int, theta: float, scaling: dict | None,
                 device: torch.device) -> torch.Tensor:
    """[max_position, head_dim] fp32: cos(p * f) in the first half, sin(p * f) in the second."""
    if rope_type(scaling) in LONGROPE:
        return rope_cos_sin_longrope(head_dim, max_position, theta, scaling, device)
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
    pos = torch.arange(max_position, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)  # [P, hd/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rope_cos_sin_longrope(head_dim: int, max_position: int, theta: float, scaling: dict,
                          device: torch.device) -> torch.Tensor:
    """LongRoPE (Phi-3): inverse frequencies divided by `short_factor` for positions below
    original_max_position_embeddings and by `long_factor` from there on, cos and sin times the attention
    factor (sqrt(1 + ln(factor) / ln(original)), factor = max_position_embeddings / original, unless given).

    HF picks one of the two factor sets for a whole forward pass, by its longest position; per position is
    the same thing whenever a prompt fits the original length, generation past it included (each new
    token's position then picks the long factors, and the cached keys keep theirs, as in HF's generate).
    A prompt longer than the original length differs: HF rotates all its positions with the long factors,
    this table its first `original` positions with the short ones.
    """
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    mscale = scaling.get("attention_factor")
    if mscale is None:
        mscale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim  # [hd/2]
    pos = torch.arange(max_position, dtype=torch.float32, device=device)
    tables = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[key], dtype=torch.float32, device=device)  # [hd/2]
        freqs = torch.outer(pos, 1.0 / (ext * theta ** exponents))  # [P, hd/2]
        tables.append(torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1))
    short, long = tables
    return torch.where(pos[:, None] < original, short, long)  # [P, hd]


class RotaryEmbedding(nn.Module):
    """The cos/sin table of rotate-half (NeoX style) rotary embedding, per position.

    `cos_sin: [max_position, head_dim]` fp32 holds cos in the first half and sin
    in the second; models/ops.rotary_and_cache applies it. Layers of the same
    settings share one table (one module).
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        check_rope_scaling(head_dim, scaling)
        self.register_buffer("cos_sin", torch.empty(max_position, head_dim), persistent=False)

    def reset_buffers(self) -> None:
        """Fill the cos/sin table on the module's device (after meta-device construction)."""
        self.cos_sin = rope_cos_sin(self.head_dim, self.max_position, self.theta, self.scaling,
                                    self.cos_sin.device)  # [P, hd] fp32


class VocabParallel(nn.Module):
    """A [vocab, D] weight split by vocabulary rows over a tensor-parallel group: each rank keeps rows
    [r*V', (r+1)*V'), V' = cdiv(vocab, tp) (the last rank's rows past the vocabulary are zeros)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: ParallelGroup = NO_PARALLEL):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.rows = -(-vocab_size // tp.size)  # V': this rank's share of the vocabulary
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        """This rank's rows of the checkpoint's [vocab, D] matrix; rows past the vocabulary are zero."""
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(f"shape {tuple(loaded.shape)}, expected {(self.vocab_size, param.shape[1])}")
        held = max(0, min(self.rows, self.vocab_size - self.start))
        param.data[:held].copy_(loaded[self.start:self.start + held])
        param.data[held:].zero_()


class VocabEmbedding(VocabParallel):
    """Token embedding, vocab-parallel: each rank looks up the ids it holds and the ranks' lookups are summed by
    one all-reduce (exact: one rank holds each id, the others add zeros); times `scale` if given (Gemma:
    sqrt(D), the factor rounded to the model dtype first, as HF's normalizer)."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None, tp: ParallelGroup = NO_PARALLEL):
        super().__init__(vocab_size, hidden_size, tp)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, D]
        if not self.tp.is_parallel:
            x = F.embedding(ids, self.weight)
        else:
            local = ids - self.start
            held = (local >= 0) & (local < self.rows)  # [T]
            x = F.embedding(torch.where(held, local, 0), self.weight) * held.unsqueeze(1).to(self.weight.dtype)
            self.tp.all_reduce(x)
        if self.scale is None:
            return x
        return x * torch.tensor(self.scale, dtype=x.dtype).item()  # a host scalar: no device work to set it up


class LMHead(VocabParallel):
    """Logits = h @ W^T with W: [vocab, D], vocab-parallel as the embedding (it may share its weight): each rank
    computes the logits of its rows and the ranks' logits are gathered for sampling. `softcap`: logits become
    softcap * tanh(logits / softcap), in the model dtype as HF computes them (Gemma 2)."""

    def __init__(self, vocab_size: int, hidden_size: int, softcap: float | None = None,
                 tp: ParallelGroup = NO_PARALLEL):
        super().__init__(vocab_size, hidden_size, tp)
        self.softcap = softcap

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # h: [N, D] -> [N, vocab] in fp32
        logits = F.linear(h, self.weight)  # [N, V'] this rank's share
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.tp.is_parallel:
            logits = self.tp.all_gather(logits)[:, :self.vocab_size]
        return logits.float()

"""Paged attention layer: rotary + KV-cache write in one op, then attention over the cache."""
from __future__ import annotations

import torch
from torch import nn

from loraserve.forward_context import AttentionMetadata
from loraserve.kernels.attention import default_configs, paged_decode_attention, paged_step_attention
from loraserve.kernels.attention_reference import paged_attention_ref
from loraserve.kernels.fused import with_columns
from loraserve.kernels.fused_reference import QKNorm
from loraserve.models.layers import RotaryEmbedding
from loraserve.models.ops import rotary_and_cache


class PagedAttention(nn.Module):
    """Causal attention over a paged KV cache: Triton kernels on CUDA (a step with prompt chunks:
    paged_step_attention), torch on the CPU.

    Per layer: the scores' `scale` (default head_dim^-0.5), a sliding `window` (the query at position p sees
    keys p - window < k <= p; None: full attention) and a `softcap` of the scores (None: none). With a window
    the layer reads only the keys inside it, but the cache keeps every block of a sequence until it ends.

    The model runner binds the layer's cache with `bind_cache` once the cache is
    allocated; the tensors never move afterwards (CUDA graphs rely on that).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding,
                 scale: float | None = None, window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window, self.softcap = window, softcap
        self.decode_config, self.prefill_config = default_configs(head_dim)
        self.rotary = rotary
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, KVH, hd]
        self.v_cache: torch.Tensor | None = None

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, qkv_delta=None, qk_norm: QKNorm | None = None, columns: int = 0) -> torch.Tensor:
        # positions: [T]; q: [T, H, hd]; k, v: [T, KVH, hd] (views of the packed qkv) -> [T, H * hd];
        # qkv_delta: LoRA deltas shaped as q, k, v, or None; qk_norm: per-head norms of q and k before rotary
        q = rotary_and_cache(q, k, v, positions, self.rotary.cos_sin, self.k_cache, self.v_cache,
                             meta.slot_mapping, qkv_delta, qk_norm)
        if meta.split is not None:  # a graph is being captured: the attention runs between two graphs
            return meta.split(self, q).reshape(q.shape[0], -1)
        if q.is_cuda:  # out [T, H, hd], with `columns` of room after each row (LinearBase.input_columns)
            out = with_columns(q.shape[0], q.shape[1] * q.shape[2], columns, q.dtype, q.device).view(q.shape)
            self.attend(q, meta, out)
        else:
            out = paged_attention_ref(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
                                      meta.query_start_loc, self.scale, self.window, self.softcap)
        return out.reshape(q.shape[0], -1)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """The attention of q [T, H, hd] (rotated, its K/V in the cache) into out [T, H, hd], on CUDA. In a step
        that prefills, rows past its sequences' tokens (a graph's padding) are not written."""
        if meta.is_decode:
            paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
                                   self.scale, out, self.decode_config, self.window, self.softcap)
        else:
            paged_step_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
                                 meta.query_start_loc, meta.max_query_len, meta.num_decode_rows, self.scale, out,
                                 (self.decode_config, self.prefill_config), self.window, self.softcap)

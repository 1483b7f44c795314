"""Paged KV-cache attention in plain torch: the kernels' oracle and the engine's CPU path.

Cache layout per layer: ``k_cache, v_cache: [num_blocks, block_size, KVH, D]``.
A token's cache slot is ``block_id * block_size + offset``; a sequence's blocks
are listed, in order, in its row of ``block_tables``.
"""
import torch
import torch.nn.functional as F


def write_kv_cache(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int64, every entry a valid slot
) -> None:
    """Stores token t's K/V at slot ``slot_mapping[t]``.

    Pure device indexing (no host sync), so it can be captured in a CUDA graph.
    Padding tokens must point at a dummy slot the engine reserves, not at -1.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, KVH, D]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, KVH, D]
    k_flat.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_row: torch.Tensor,  # [MB] int32
    first: int,
    seq_len: int,
) -> torch.Tensor:
    """Returns one sequence's cached tokens ``first..seq_len - 1`` as ``[KVH, seq_len - first, D]`` fp32 (only
    the blocks that hold them are read)."""
    block_size = cache.shape[1]
    first_block, num_blocks = first // block_size, -(-seq_len // block_size)
    blocks = block_row[first_block:num_blocks].long()  # [nb]
    skip = first_block * block_size
    tokens = cache[blocks].flatten(0, 1)[first - skip:seq_len - skip]  # [seq_len - first, KVH, D]
    return tokens.transpose(0, 1).float()


def paged_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, MB] int32
    seq_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S+1] int32
    scale: float,
    window: int | None = None,  # sliding window (None: full attention)
    softcap: float | None = None,  # score soft-capping (None: none)
) -> torch.Tensor:  # [T, H, D], dtype of q
    """Causal varlen attention of new queries against a paged context.

    Sequence s owns query rows ``query_start_loc[s]:query_start_loc[s+1]``;
    they are the last ``q_len`` positions of its ``seq_lens[s]`` cached tokens,
    and the query at position p sees keys 0..p, or with a `window` the keys
    ``p - window < k <= p`` (HF's sliding-window mask). A `softcap` turns each
    score (scaled) into ``softcap * tanh(score / softcap)`` before the softmax.
    Computed in fp32 by torch's scaled_dot_product_attention (its fused CPU
    kernel: no [q_len, L] score matrix per head), or, with a softcap, by an
    explicit softmax. A query of a sequence with ``seq_len`` 0 (a decode
    padding row) gets zeros.
    """
    num_tokens, num_heads, head_dim = q.shape
    out = torch.zeros_like(q)  # [T, H, D]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0 or seq_len == 0:
            continue
        # the keys any of the queries sees: [first, seq_len)
        first = 0 if window is None else max(0, seq_len - q_len - window + 1)
        keys = _gather_context(k_cache, block_tables[s], first, seq_len)[None]  # [1, KVH, L, D]
        values = _gather_context(v_cache, block_tables[s], first, seq_len)[None]  # [1, KVH, L, D]
        q_seq = q[q_start:q_end].float().transpose(0, 1)[None]  # [1, H, q_len, D] (4-D: the fused CPU kernel)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]  # [q_len, 1]
        k_pos = torch.arange(first, seq_len, device=q.device)[None, :]  # [1, L]
        if softcap is not None:
            o = _softcapped_attention(q_seq, keys, values, _visible(q_pos, k_pos, window), scale, softcap)
        elif window is None and q_len == seq_len:  # a whole prompt: plain causal
            o = F.scaled_dot_product_attention(q_seq, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:  # the last q_len positions (a chunk, or decode), or a window
            o = F.scaled_dot_product_attention(q_seq, keys, values, attn_mask=_visible(q_pos, k_pos, window),
                                               scale=scale, enable_gqa=True)  # [1, H, q_len, D]
        out[q_start:q_end] = o[0].transpose(0, 1).to(q.dtype)  # query head h reads KV head h // G
    return out


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[q_len, L] bool: the keys each query sees (causal, inside the window)."""
    mask = k_pos <= q_pos
    return mask if window is None else mask & (k_pos > q_pos - window)


def _softcapped_attention(q, keys, values, visible, scale: float, softcap: float) -> torch.Tensor:
    """[1, H, q_len, D] from q [1, H, q_len, D], keys/values [1, KVH, L, D] fp32 and visible [q_len, L]."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)  # [1, H, L, D]
    scores = torch.tanh(q @ keys.transpose(-1, -2) * (scale / softcap)) * softcap  # [1, H, q_len, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values

"""Triton paged attention over the KV cache: decode (split-K, graph-safe) and varlen prefill.

Cache layout per layer: ``k_cache, v_cache: [num_blocks, block_size, KVH, D]``;
``block_tables[s, i]`` is the cache block of sequence s's tokens
``i*block_size .. (i+1)*block_size-1``. Both kernels keep an fp32 online
softmax in the base-2 domain (scores scaled by ``scale*log2(e)``).

Per layer, two options: a sliding ``window`` (the query at position p sees
keys ``p - window < k <= p``, as HF's sliding-window mask; the kernels visit
only the key tiles inside it) and a ``softcap`` (scores become
``softcap * tanh(score / softcap)`` before the softmax, Gemma 2). Any head
dimension is served (a power of two is the fast case; others, e.g. 96, are
padded to the next power of two inside the kernel).
Semantics match ``attention_reference.paged_attention_ref``.
"""
import dataclasses
import math

import torch
import triton
import triton.language as tl

from loraserve.kernels.launch import CachedLauncher, next_power_of_2
from loraserve.kernels.tl_math import tanh

_LOG2E = 1.4426950408889634
# Running max before any key: finite, so exp2(m_old - m_new) never computes inf - inf.
_NEG_BIG = tl.constexpr(-1.0e30)
_MAX_SPLITS = 64
_NO_WINDOW = 1 << 30  # the window of full attention: longer than any context


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel (``num_splits=None``: chosen from shapes and SM count)."""

    num_splits: int | None = None
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def default_configs(head_dim: int) -> tuple[DecodeConfig, PrefillConfig]:
    """The launch parameters a layer of this head dimension uses. Up to 128 the defaults (tuned for 128 on an
    H100: benchmarks/attention_kernels.py); above, half the key tile (and twice the warps in prefill) keeps a
    tile's K, V and accumulator in registers: an untuned choice."""
    if head_dim <= 128:
        return DecodeConfig(), PrefillConfig()
    return DecodeConfig(block_n=32), PrefillConfig(block_n=32, num_warps=8)


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i,  # q: [R, BLOCK_D]; acc: [R, BLOCK_D] fp32; m_i, l_i: [R] fp32
    k_head_ptr, v_head_ptr, page_row_ptr,  # cache base pointers already at this KV head; block-table row
    start, kv_end, q_pos, scale_log2,  # keys start..start+BLOCK_N-1; q_pos: [R] positions
    stride_kb, stride_kt, stride_vb, stride_vt,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    window, softcap_scale,  # keys p - window < k <= p visible (MASKED tiles); scores * softcap_scale go into tanh
    BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """Folds keys ``start..start+BLOCK_N-1`` into the online softmax of rows ``q``. Unmasked tiles must be
    visible to every row (causally and inside the window) and hold only live keys."""
    pos = start + tl.arange(0, BLOCK_N)  # [N]
    d = tl.arange(0, BLOCK_D)
    if MASKED:
        valid = pos < kv_end
        page = tl.load(page_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    else:
        page = tl.load(page_row_ptr + pos // BLOCK_SIZE).to(tl.int64)
    k_ptrs = k_head_ptr + page[:, None] * stride_kb + (pos % BLOCK_SIZE)[:, None] * stride_kt + d[None, :]
    v_ptrs = v_head_ptr + page[:, None] * stride_vb + (pos % BLOCK_SIZE)[:, None] * stride_vt + d[None, :]
    if MASKED:
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [N, BLOCK_D]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [N, BLOCK_D]
    elif BLOCK_D != HEAD_DIM:  # a padded head: the columns past HEAD_DIM read as zeros
        k = tl.load(k_ptrs, mask=(d < HEAD_DIM)[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=(d < HEAD_DIM)[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)  # [N, D]
        v = tl.load(v_ptrs)  # [N, D]
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [R, N] fp32, unscaled
    if SOFTCAP:  # softcap * tanh(scale * s / softcap); the factor softcap * log2(e) is scale_log2
        s = tanh(s * softcap_scale, LIBDEVICE)
    if MASKED:
        visible = ((pos[None, :] <= q_pos[:, None]) & valid[None, :]
                   & (pos[None, :] > q_pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)  # [R]
    alpha = tl.exp2(m_i - m_new)  # [R]
    p = tl.exp2(s * scale_log2 - m_new[:, None])  # [R, N]; scale folded into one FMA
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# Integers whose value changes between eager steps are not specialized on (Triton would compile again for a
# value of 1 or a multiple of 16 while requests wait): the table's row stride (its width, the step's longest
# context in blocks), the first prompt sequence after the decode rows, and the split count.
@triton.jit(do_not_specialize=["stride_btb"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    scale_log2,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_btb, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    window, softcap_scale,
    BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """Program (b, kvh, split): the query heads of KV head kvh against one slice of b's context.

    SPLIT=False (one split): writes the output; SPLIT=True: writes fp32 partials for the reduce.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # The live context (inside the window; not the table width) is cut into num_splits runs of whole tiles.
    first = (tl.maximum(seq_len - window, 0) // BLOCK_N) * BLOCK_N  # the tile of the first visible key
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - first, BLOCK_N), num_splits)
    lo = first + split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g  # [G]
    g_mask = g < GROUP
    qo_mask = g_mask[:, None] & (d < HEAD_DIM)[None, :]  # [G, BLOCK_D]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=qo_mask, other=0.0)  # [G, BLOCK_D]
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + seq_len - 1  # [G]
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    k_head_ptr = k_ptr + kvh * stride_kh
    v_head_ptr = v_ptr + kvh * stride_vh
    page_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb
    for start in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_head_ptr, v_head_ptr, page_row_ptr, start, hi, q_pos, scale_log2,
            stride_kb, stride_kt, stride_vb, stride_vt,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, window, softcap_scale, BLOCK_D, SOFTCAP, LIBDEVICE)

    if not SPLIT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty context (padding row) -> zeros
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=qo_mask)
    else:
        # partials: acc [B, H, num_splits, BLOCK_D], (m, l) [B, H, num_splits, 2], contiguous
        row = (b * (tl.num_programs(1) * GROUP) + heads) * num_splits + split  # [G]
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)


_decode_launch = CachedLauncher(_decode_kernel)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, num_splits, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (b, h): merges the split partials of one head into the output row."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, BLOCK_D)
    sp_mask = sp < num_splits
    row = (b * tl.num_programs(1) + h) * num_splits + sp  # [P]
    m = tl.load(part_ml_ptr + row * 2, mask=sp_mask, other=_NEG_BIG)  # [P]
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=sp_mask, other=0.0)  # [P]
    acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :],
                  mask=sp_mask[:, None], other=0.0)  # [P, BLOCK_D]
    w = tl.exp2(m - tl.max(m, 0))  # [P]
    l_tot = tl.sum(w * l, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(l_tot > 0, l_tot, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


_decode_reduce_launch = CachedLauncher(_decode_reduce_kernel)


@triton.jit(do_not_specialize=["first_seq", "stride_btb"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    scale_log2, first_seq,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_btb, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    window, softcap_scale,
    BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """Program (h, tile, i): BLOCK_M queries of sequence s = first_seq + i, head h, against their causal context
    (inside the window)."""
    h = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # longest (latest) query tiles start first
    s = first_seq + tl.program_id(2)
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + s)
    first_pos = seq_len - q_len + tile * BLOCK_M  # context position of the tile's first query
    kvh = h // GROUP

    m_idx = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
    m_mask = m_idx < q_len
    d = tl.arange(0, BLOCK_D)
    qo_mask = m_mask[:, None] & (d < HEAD_DIM)[None, :]  # [M, BLOCK_D]
    tok = (q_start + m_idx).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=qo_mask, other=0.0)  # [M, BLOCK_D]
    q_pos = first_pos + tl.arange(0, BLOCK_M)  # [M]
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_head_ptr = k_ptr + kvh * stride_kh
    v_head_ptr = v_ptr + kvh * stride_vh
    page_row_ptr = bt_ptr + s.to(tl.int64) * stride_btb

    # Key tiles [lo_tile, kv_end) hold every key a row of the tile sees. Those from full_lo (inside every row's
    # window) to full_end (before the first query: causally visible to all) need no mask; the rest are masked.
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_M)
    lo_tile = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(tl.maximum(first_pos + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    mid_lo = tl.minimum(tl.maximum(full_lo, lo_tile), kv_end)
    mid_hi = tl.maximum(full_end, mid_lo)
    for start in range(lo_tile, mid_lo, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_head_ptr, v_head_ptr, page_row_ptr, start, kv_end, q_pos,
            scale_log2, stride_kb, stride_kt, stride_vb, stride_vt,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, window, softcap_scale, BLOCK_D, SOFTCAP, LIBDEVICE)
    for start in range(mid_lo, mid_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_head_ptr, v_head_ptr, page_row_ptr, start, kv_end, q_pos,
            scale_log2, stride_kb, stride_kt, stride_vb, stride_vt,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, window, softcap_scale, BLOCK_D, SOFTCAP, LIBDEVICE)
    for start in range(mid_hi, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_head_ptr, v_head_ptr, page_row_ptr, start, kv_end, q_pos,
            scale_log2, stride_kb, stride_kt, stride_vb, stride_vt,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, window, softcap_scale, BLOCK_D, SOFTCAP, LIBDEVICE)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # every valid row sees its own key; rows past q_len may not
    tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=qo_mask)


_prefill_launch = CachedLauncher(_prefill_kernel)


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, out) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k/v caches must be [num_blocks, block_size, KVH, D] alike, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    if head_dim < 16:
        raise ValueError(f"head_dim must be at least 16, got {head_dim}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype == out.dtype):
        raise ValueError(f"dtypes differ: q {q.dtype}, caches {k_cache.dtype}/{v_cache.dtype}, "
                         f"out {out.dtype}")
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache, out)):
        raise ValueError("q, caches and out need a contiguous last dimension")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables needs a contiguous last dimension")


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # 16-bit inputs ignore it


def _score_args(q: torch.Tensor, scale: float, window: int | None, softcap: float | None) -> dict:
    """The window and score arguments of both kernels: keys inside the window (full attention: a window
    longer than any context); with a softcap, tanh's input factor and the base-2 factor after it."""
    if window is not None and window < 1:
        raise ValueError(f"the attention window must be positive, got {window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"the attention softcap must be positive, got {softcap}")
    scores = dict(scale_log2=scale * _LOG2E, softcap_scale=1.0)
    if softcap is not None:
        scores = dict(scale_log2=softcap * _LOG2E, softcap_scale=scale / softcap)
    return dict(window=window or _NO_WINDOW, **scores, SOFTCAP=softcap is not None, LIBDEVICE=q.is_cuda,
                BLOCK_D=next_power_of_2(q.shape[2]))


def decode_num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int,
                      block_n: int, device: torch.device, window: int | None = None) -> int:
    """Static split count: enough programs to fill the GPU about twice, at most one per key tile (of the
    table width, or of the window)."""
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = batch * num_kv_heads
    wanted = -(-2 * num_sms // programs)
    max_tiles = -(-max_blocks * block_size // block_n)
    if window is not None:
        max_tiles = min(max_tiles, -(-window // block_n) + 1)
    return max(1, min(wanted, max_tiles, _MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [B, MB] int32
    seq_lens: torch.Tensor,  # [B] int32; 0 = padding row (output zeros)
    scale: float,
    out: torch.Tensor,  # [B, H, D]
    config: DecodeConfig | None = None,  # None: default_configs(D)
    window: int | None = None,  # sliding window (None: full attention)
    softcap: float | None = None,  # score soft-capping (None: none)
) -> None:
    """One query token per sequence against its cached context (including itself; the last `window` keys).

    The grid depends only on (B, KVH, MB) and the device, and nothing syncs with
    the host, so a captured CUDA graph can be replayed with new tables/lengths.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, out)
    config = config or default_configs(q.shape[2])[0]
    batch, num_heads, head_dim = q.shape
    num_blocks_total, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    scores = _score_args(q, scale, window, softcap)
    block_d = scores["BLOCK_D"]
    num_splits = config.num_splits or decode_num_splits(
        batch, num_kv_heads, block_tables.shape[1], block_size, config.block_n, q.device, window)
    if num_splits > 1:
        part_acc = torch.empty(batch, num_heads, num_splits, block_d,
                               dtype=torch.float32, device=q.device)  # [B, H, S, BLOCK_D]
        part_ml = torch.empty(batch, num_heads, num_splits, 2,
                              dtype=torch.float32, device=q.device)  # [B, H, S, (m, l)]
    else:
        part_acc = part_ml = out  # unused by the kernel when SPLIT is False
    _decode_launch((batch, num_kv_heads, num_splits),
        q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_ml,
        scores.pop("scale_log2"),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=config.block_n, SPLIT=num_splits > 1,
        DOT_PRECISION=_dot_precision(q.dtype), **scores,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1:
        _decode_reduce_launch((batch, num_heads),
            part_acc, part_ml, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, SPLITS_P2=next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4,
        )


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, MB] int32
    seq_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S+1] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor,  # [T, H, D]
    config: PrefillConfig | None = None,  # None: default_configs(D)
    window: int | None = None,  # sliding window (None: full attention)
    softcap: float | None = None,  # score soft-capping (None: none)
    first_seq: int = 0,  # the sequences from this one on (those before: decode rows, attended elsewhere)
) -> None:
    """Causal varlen attention of each sequence's last q_len positions over its paged context, for sequences
    first_seq.. of the arrays. The arrays are passed whole with that offset rather than as views from it: Triton
    specializes a pointer on its 16-byte alignment, which a view's would change with the rows before it, so
    each count of decode rows in a mixed step would compile the kernel again while requests wait."""
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, out)
    if query_start_loc.dtype != torch.int32:
        raise ValueError("query_start_loc must be int32")
    if not 0 <= first_seq <= seq_lens.shape[0]:
        raise ValueError(f"first_seq must lie in [0, {seq_lens.shape[0]}], got {first_seq}")
    config = config or default_configs(q.shape[2])[1]
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0] - first_seq
    scores = _score_args(q, scale, window, softcap)
    if num_seqs == 0 or max_query_len == 0:
        return
    grid = (num_heads, math.ceil(max_query_len / config.block_m), num_seqs)
    _prefill_launch(grid,
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scores.pop("scale_log2"), first_seq,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, DOT_PRECISION=_dot_precision(q.dtype), **scores,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def paged_step_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, MB] int32
    seq_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S+1] int32
    max_query_len: int,
    num_decode_rows: int,  # the first D sequences have one query each (rows 0..D-1)
    scale: float,
    out: torch.Tensor,  # [T, H, D]
    configs: tuple[DecodeConfig, PrefillConfig] | None = None,  # None: default_configs(D)
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """The attention of a step that mixes decode rows with prompt chunks: its first `num_decode_rows` sequences
    by the decode kernel, which reads each KV head once for the query heads that share it and splits long
    contexts over programs (the prefill kernel, one program per query head and tile, would read the context
    of a one-query row GROUP times over, in one program), the others by the prefill kernel."""
    decode_config, prefill_config = configs or default_configs(q.shape[2])
    d = num_decode_rows
    if d:
        paged_decode_attention(q[:d], k_cache, v_cache, block_tables[:d], seq_lens[:d], scale, out[:d],
                               decode_config, window, softcap)
    if d < seq_lens.shape[0]:  # query_start_loc from d on points at the chunks' rows of q
        paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale,
                                out, prefill_config, window, softcap, first_seq=d)

"""Fused LoRA for decode-sized batches: y += B_slot (A_slot x) per token in ONE launch.

The two-kernel path (lora_shrink + lora_expand) costs three launches per layer
at decode (split-K shrink, the fixed-order sum of its partials, expand), each
paying a graph launch and the dependent round trips slot vectors -> token ids
-> data. Here one kernel does both halves. Grid (static shapes only):
axis 0 = column groups of the packed output (each `col_tiles` tiles of
BLOCK_N columns), axis 1 = the flat token-tile axis of the other LoRA kernels
(cdiv(T, BLOCK_M) + min(L, T), mapped to (slot, tile within slot) in the
kernel; tiles past the last one, and empty slots, return at once).

Each program, for every slice its columns touch (slice_offsets is constexpr),
first computes inter = x_tile . A_slot[slice, :rank]^T ([BLOCK_M, BLOCK_R]
float32, the whole K = in features; the A rows come from L2 after the first
program of the slot has read them), then walks its column tiles:
y[tok, cols] += inter . B_slot[cols, :rank]^T, one read-modify-write per
element. The rank masks read only the slot's `rank` rows of A and columns of
B; the inner width BLOCK_R is picked at run time from 16, R_P2/2 and R_P2
(R_P2 = next power of two of the buffer rank), so compute is within 2x of the
adapter's own rank. No atomics and a fixed summation order: results are
identical run to run (the start-up graph-vs-eager check relies on that).
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraserve.kernels.lora_meta import LoRAMeta
from loraserve.kernels.lora_shrink import check_meta, dot_precision, loras_p2, slot_tile

# Token counts up to this take the fused kernel in lora_apply (16-token tiles).
FUSED_DECODE_MAX_TOKENS = 64


@dataclass(frozen=True)
class FusedConfig:
    block_m: int = 16  # tokens per tile
    block_n: int = 128  # output columns per inner tile
    block_k: int = 256  # input features per shrink step
    col_groups: int = 32  # target programs along N (each walks cdiv(tiles, col_groups) tiles)
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _slice_delta(x_rows, tok_ok, a_slot, b_slot, y_rows, row0, lo, hi, col0, col_tiles, rank,
                 hidden, stride_xk, stride_an, stride_ak, stride_bn, stride_br, stride_yn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_R: tl.constexpr, RANK_ALIGN: tl.constexpr, PRECISION: tl.constexpr):
    """y[tok, c] += (x[tok] . A[row0 + :rank]) . B[c, :rank] for this program's columns c in [lo, hi).

    The caller guarantees rank <= BLOCK_R and rank % RANK_ALIGN == 0; a mask
    bound that is a multiple of 8 lets B (rank-contiguous) be read in vectors.
    """
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < (rank // RANK_ALIGN) * RANK_ALIGN  # r_ok: [BLOCK_R]
    a_rows = a_slot + (row0 + offs_r)[None, :].to(tl.int64) * stride_an
    inter = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        x = tl.load(x_rows + offs_k[None, :] * stride_xk,
                    mask=tok_ok[:, None] & k_ok[None, :], other=0.0)  # x: [BLOCK_M, BLOCK_K]
        a = tl.load(a_rows + offs_k[:, None] * stride_ak,
                    mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # a: [BLOCK_K, BLOCK_R]
        inter += tl.dot(x, a, input_precision=PRECISION)
    # only the column tiles that overlap [lo, hi)
    j_lo = tl.maximum(lo - col0, 0) // BLOCK_N
    j_hi = tl.minimum((hi - col0 + BLOCK_N - 1) // BLOCK_N, col_tiles)
    for j in range(j_lo, j_hi):
        cols = col0 + j * BLOCK_N + tl.arange(0, BLOCK_N)  # cols: [BLOCK_N]
        col_ok = (cols >= lo) & (cols < hi)
        mask = tok_ok[:, None] & col_ok[None, :]
        old = tl.load(y_rows + cols[None, :] * stride_yn, mask=mask, other=0.0)  # [BM, BN]
        b = tl.load(b_slot + cols[None, :].to(tl.int64) * stride_bn + offs_r[:, None] * stride_br,
                    mask=r_ok[:, None] & col_ok[None, :], other=0.0)  # b: [BLOCK_R, BLOCK_N]
        acc = tl.dot(inter, b.to(tl.float32), input_precision=PRECISION)
        tl.store(y_rows + cols[None, :] * stride_yn, (old.to(tl.float32) + acc).to(old.dtype),
                 mask=mask)


@triton.jit
def _fused_kernel(
    x_ptr, a_ptr, b_ptr, rank_ptr, sorted_ptr, start_ptr, count_ptr, y_ptr,
    num_tokens, hidden, rank_max, num_loras, col_tiles,
    stride_xt, stride_xk, stride_al, stride_an, stride_ak, stride_bl, stride_bn, stride_br,
    stride_yt, stride_yn,
    SLICE_OFFSETS: tl.constexpr, NUM_SLICES: tl.constexpr, LORAS_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    R_MID: tl.constexpr, R_P2: tl.constexpr, PRECISION: tl.constexpr,
):
    slot, m_tile, rank, count, start = slot_tile(tl.program_id(1), rank_ptr, start_ptr, count_ptr,
                                                 num_loras, LORAS_P2, BLOCK_M)
    if slot >= num_loras:
        return
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = tl.load(sorted_ptr + start + offs_m, mask=offs_m < count, other=0)  # tok: [BLOCK_M]
    tok_ok = (offs_m < count) & (tok >= 0) & (tok < num_tokens)
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xt
    y_rows = y_ptr + tok.to(tl.int64)[:, None] * stride_yt
    a_slot = a_ptr + slot.to(tl.int64) * stride_al
    b_slot = b_ptr + slot.to(tl.int64) * stride_bl
    col0 = tl.program_id(0) * col_tiles * BLOCK_N
    col1 = col0 + col_tiles * BLOCK_N
    for s in tl.static_range(NUM_SLICES):
        lo = SLICE_OFFSETS[s]
        hi = SLICE_OFFSETS[s + 1]
        if (col0 < hi) & (col1 > lo):
            row0 = s * rank_max
            if rank % 8 == 0:
                if rank <= 16:
                    _slice_delta(x_rows, tok_ok, a_slot, b_slot, y_rows, row0, lo, hi, col0,
                                 col_tiles, rank, hidden, stride_xk, stride_an, stride_ak,
                                 stride_bn, stride_br, stride_yn,
                                 BLOCK_M, BLOCK_N, BLOCK_K, 16, 8, PRECISION)
                elif rank <= R_MID:
                    _slice_delta(x_rows, tok_ok, a_slot, b_slot, y_rows, row0, lo, hi, col0,
                                 col_tiles, rank, hidden, stride_xk, stride_an, stride_ak,
                                 stride_bn, stride_br, stride_yn,
                                 BLOCK_M, BLOCK_N, BLOCK_K, R_MID, 8, PRECISION)
                else:
                    _slice_delta(x_rows, tok_ok, a_slot, b_slot, y_rows, row0, lo, hi, col0,
                                 col_tiles, rank, hidden, stride_xk, stride_an, stride_ak,
                                 stride_bn, stride_br, stride_yn,
                                 BLOCK_M, BLOCK_N, BLOCK_K, R_P2, 8, PRECISION)
            else:
                _slice_delta(x_rows, tok_ok, a_slot, b_slot, y_rows, row0, lo, hi, col0,
                             col_tiles, rank, hidden, stride_xk, stride_an, stride_ak,
                             stride_bn, stride_br, stride_yn,
                             BLOCK_M, BLOCK_N, BLOCK_K, R_P2, 1, PRECISION)


def lora_shrink_expand_decode(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor,
                              lora_b: torch.Tensor, slot_rank: torch.Tensor, meta: LoRAMeta,
                              slice_offsets: tuple[int, ...],
                              config: FusedConfig | None = None) -> None:
    """y: [T, N] += B_slot(A_slot x: [T, in]) per token; lora_a: [L, S*R, in], lora_b: [L, N, R].

    Same storage and semantics as lora_apply: slice_offsets (S+1 host ints,
    0..N) give each slice's columns, rows of tokens without a slot (or with an
    empty one) are untouched, y may be a column range of a wider tensor. meta
    must have been built from at most T token slots. Meant for small T (the
    shrink is recomputed by every column group); `config` overrides the shape.
    """
    num_tokens, hidden = x.shape
    n_out = y.shape[1]
    num_loras, sr, a_hidden = lora_a.shape
    rank_max = lora_b.shape[2]
    offsets = tuple(int(o) for o in slice_offsets)
    num_slices = len(offsets) - 1
    if num_slices < 1 or offsets[0] != 0 or offsets[-1] != n_out or \
            any(a > b for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"slice_offsets {offsets} must rise from 0 to N={n_out}")
    if a_hidden != hidden or sr != num_slices * rank_max or y.shape[0] != num_tokens:
        raise ValueError(f"shapes do not match: x {list(x.shape)}, y {list(y.shape)}, "
                         f"lora_a {list(lora_a.shape)}, {num_slices} slices of rank {rank_max}")
    if lora_b.shape[:2] != (num_loras, n_out):
        raise ValueError(f"lora_b must be [{num_loras}, {n_out}, R], got {list(lora_b.shape)}")
    if not x.dtype == y.dtype == lora_a.dtype == lora_b.dtype:
        raise ValueError(f"dtypes differ: x {x.dtype}, y {y.dtype}, lora_a {lora_a.dtype}, "
                         f"lora_b {lora_b.dtype}")
    check_meta(meta, slot_rank, num_tokens, num_loras)
    if num_tokens == 0:
        return
    cfg = config or FusedConfig()
    tiles = triton.cdiv(n_out, cfg.block_n)
    col_tiles = triton.cdiv(tiles, min(tiles, cfg.col_groups))
    r_p2 = max(16, triton.next_power_of_2(rank_max))
    grid = (triton.cdiv(tiles, col_tiles),
            triton.cdiv(num_tokens, cfg.block_m) + min(num_loras, num_tokens))
    _fused_kernel[grid](
        x, lora_a, lora_b, slot_rank, meta.sorted_token_ids, meta.slot_start, meta.slot_count, y,
        num_tokens, hidden, rank_max, num_loras, col_tiles,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0), y.stride(1),
        SLICE_OFFSETS=offsets, NUM_SLICES=num_slices, LORAS_P2=loras_p2(num_loras),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        R_MID=max(16, r_p2 // 2), R_P2=r_p2, PRECISION=dot_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

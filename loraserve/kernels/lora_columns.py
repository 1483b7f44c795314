"""LoRA products as extra input columns of the base GEMM: y = [x | z] @ [W | B]^T in one GEMM.

In a large step a LoRA layer's product costs the base GEMM little in FLOPs but, added in place, a
read-modify-write of the whole [T, N] output. Here the product goes into the GEMM instead: the step's
distinct adapters have their rank rows side by side, slot l's at columns cols[l] .. cols[l+1] of r =
cols[L] (the metadata's slot_columns, lora_meta), once per slice of the layer, and

  x_aug [T, K + C]: x, then per token its adapter's shrink output z (rounded to x's dtype) in its slot's
                    columns of each slice, zero in every other column (C >= S * r, a multiple of 64)
  w_aug [N, K + Cmax]: W, then in slice s's columns of slot l the rank rows of the adapter's B^T for the
                    output rows of slice s (zero in the other slices' rows)

so that x_aug @ w_aug[:, :K + C]^T = x @ W^T + each token's LoRA product, summed in the GEMM's fp32
accumulator and rounded once. Columns of a slot past the adapter's rank in this layer read zero.
`place_factors` writes x_aug's extra columns from the shrink's output, `place_b` w_aug's from the pool
pages; the caller (lora/layers.py) runs the shrink and the GEMM. Torch references: lora_reference.py.
"""
import torch
import triton
import triton.language as tl

from loraserve.kernels.launch import CachedLauncher, cdiv
from loraserve.kernels.lora_meta import PAGE_RANK, LoRAMeta

COLUMN_ALIGN = 64  # the extra columns C of a GEMM are a multiple of this (aligned rows for the GEMM)


def padded_columns(num_slices: int, step_columns: int) -> int:
    """C: the extra input columns of a layer of `num_slices` slices in a step whose adapters' ranks sum to
    `step_columns` (0: none)."""
    return cdiv(num_slices * step_columns, COLUMN_ALIGN) * COLUMN_ALIGN


@triton.jit(do_not_specialize=["stride_it", "stride_xt", "num_tokens", "step_columns", "extra"])
def _place_factors_kernel(
    inter_ptr, stride_it, rank_width, x_ptr, stride_xt, k, num_tokens,
    slot_ptr, adapter_ptr, columns_ptr, rank_ptr, num_slices, step_columns, extra,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Program (token block, column block): x[t, k + c] = z of token t's slot in column c, or 0."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] tokens
    t_ok = t < num_tokens
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C] among the C extra columns
    slot = tl.load(slot_ptr + t, mask=t_ok, other=-1)
    has = slot >= 0
    safe = tl.where(has, slot, 0)
    first = tl.load(columns_ptr + safe, mask=has, other=0)  # the slot's first rank row among a slice's columns
    adapter = tl.load(adapter_ptr + safe, mask=has, other=-1)
    rank = tl.load(rank_ptr + adapter, mask=adapter >= 0, other=0)  # [BLOCK_T] its adapter's rank here
    s = cols // step_columns  # [BLOCK_C] the slice of each column
    j = (cols - s * step_columns)[None, :] - first[:, None]  # [BLOCK_T, BLOCK_C] the rank row within the slot
    valid = (j >= 0) & (j < rank[:, None]) & ((s < num_slices) & (cols < extra))[None, :]
    rows = t.to(tl.int64)[:, None]
    z = tl.load(inter_ptr + rows * stride_it + (s * rank_width)[None, :] + j, mask=valid, other=0.0)
    tl.store(x_ptr + rows * stride_xt + k + cols[None, :], z.to(x_ptr.dtype.element_ty),
             mask=t_ok[:, None] & (cols < extra)[None, :])


_place_factors_launch = CachedLauncher(_place_factors_kernel)


def place_factors(inter: torch.Tensor, meta: LoRAMeta, lora_rank: torch.Tensor, step_columns: int,
                  x_aug: torch.Tensor, k: int) -> None:
    """Write x_aug[:, k:] ([T, C] of a [T, k + C] tensor) from the shrink's output inter [T, S*R] (float32):
    each token's z in its slot's columns of each slice (step_columns per slice), rounded to x_aug's dtype,
    zero elsewhere (tokens without an adapter: all zero)."""
    num_tokens, width = x_aug.shape
    extra = width - k
    assert x_aug.stride(-1) == 1 and inter.stride(-1) == 1 and extra > 0 and step_columns > 0
    if num_tokens == 0:
        return
    block_t, block_c = 32, 128
    _place_factors_launch((cdiv(num_tokens, block_t), cdiv(extra, block_c)),
        inter, inter.stride(0), meta.rank_width, x_aug, x_aug.stride(0), k, num_tokens,
        meta.token_slots, meta.slot_adapter, meta.slot_columns, lora_rank, inter.shape[1] // meta.rank_width,
        step_columns, extra, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4)


@triton.jit(do_not_specialize=["step_columns"])
def _place_b_kernel(
    b_ptr, stride_bp, stride_br, stride_bn, page_ptr, stride_pa,
    adapter_ptr, columns_ptr, rank_ptr, offsets_ptr, w_ptr, stride_wn, k, n_out, step_columns,
    BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, PAGE: tl.constexpr,
):
    """Program (row block, slot l, slice s): w[n, k + s * step_columns + cols[l] + j] = B^T rank row j of slot
    l's adapter at output row n where n lies in slice s and j < its rank, else 0, for j < the slot's width."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output rows
    slot = tl.program_id(1)
    s = tl.program_id(2)
    adapter = tl.load(adapter_ptr + slot)
    first = tl.load(columns_ptr + slot)
    width = tl.load(columns_ptr + slot + 1) - first
    rank = tl.load(rank_ptr + adapter)
    lo = tl.load(offsets_ptr + s)
    hi = tl.load(offsets_ptr + s + 1)
    in_slice = (rows >= lo) & (rows < hi)
    row_ok = rows < n_out
    page_row = page_ptr + adapter.to(tl.int64) * stride_pa
    col0 = k + s * step_columns + first
    for j0 in range(0, width, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)  # [BLOCK_J] rank rows
        page = tl.load(page_row + j // PAGE, mask=j < rank, other=0).to(tl.int64)
        b = tl.load(b_ptr + page[:, None] * stride_bp + (j % PAGE)[:, None] * stride_br
                    + rows[None, :] * stride_bn,
                    mask=(j < rank)[:, None] & (in_slice & row_ok)[None, :], other=0.0)  # [BLOCK_J, BLOCK_N]
        tl.store(w_ptr + rows[None, :].to(tl.int64) * stride_wn + (col0 + j)[:, None], b,
                 mask=(j < width)[:, None] & row_ok[None, :])


_place_b_launch = CachedLauncher(_place_b_kernel)


def place_b(lora_b: torch.Tensor, meta: LoRAMeta, lora_rank: torch.Tensor, slice_offsets: torch.Tensor,
            num_slots: int, step_columns: int, w_aug: torch.Tensor, k: int) -> None:
    """Write the step's columns of w_aug ([N, k + Cmax]) past k from the pool's B pages (lora_b [P, PAGE_RANK,
    N]): slice s's columns of slot l hold its adapter's B^T rows for slice s's output rows (slice_offsets:
    [S + 1] int32 on the device) and zeros in the other rows. Slots 0 .. num_slots - 1 are the step's."""
    n_out = w_aug.shape[0]
    num_slices = slice_offsets.shape[0] - 1
    assert w_aug.stride(-1) == 1 and lora_b.shape[2] == n_out
    assert k + num_slices * step_columns <= w_aug.shape[1], "the step's columns do not fit w_aug"
    if num_slots == 0:
        return
    block_n = 128
    _place_b_launch((cdiv(n_out, block_n), num_slots, num_slices),
        lora_b, lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), meta.page_table, meta.page_table.stride(0),
        meta.slot_adapter, meta.slot_columns, lora_rank, slice_offsets, w_aug, w_aug.stride(0), k, n_out,
        step_columns, BLOCK_N=block_n, BLOCK_J=16, PAGE=PAGE_RANK, num_warps=4)

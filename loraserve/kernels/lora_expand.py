"""LoRA expand: y[t, n] += inter[t, s*R + :r] . B_s[adapter_t, n, :r] for the slice s holding column n.

One launch covers every slice of a packed layer (q/k/v, gate/up) and every
adapter of a step. B's rank rows live in pool pages (lora_meta: each page row
is one rank row of B^T over the packed output, read contiguously along the
columns). The grid is static and sized by the step's tokens: groups of
col_tiles column tiles of the packed output times the same token-tile axis as
the shrink (token_programs), which a config may scale up to one program per
token tile a step can have (program_scale); the pool's size never grows it.
While the step's tiles (from its tile map and tile count) fit the token
programs, program (column group, p) takes tile p (tiles p, p + G, ... in turn
otherwise). In the decode shapes
(ExpandConfig.dynamic) a step of more tiles (many adapters of a few tokens
each) is spread over all programs instead: a work item is a token tile and a
run of column tiles, longer than col_tiles where that keeps every item a
program of its own, so that each program finds its tokens once. The K loop runs
over the adapter's own rank only (in steps of BLOCK_R), so a rank-8 adapter
reads and computes rank 8 whatever max_lora_rank is (a config may load the
pages of an item's first BLOCK_R ranks once for all its column tiles:
hoist_pages; or its pages and its tokens' factors, every rank in one step, and
pipeline its column tiles' loads: col_stages). A column tile that
straddles a slice boundary handles each slice under a mask. The sum is added
into y in place (y may be a column range of a larger tensor); rows of tokens
without a slot are never touched.

With overwrite=True the kernel writes y = product instead, without reading y:
the items then also cover the rows of adapters of rank 0 and of tokens without
a slot (one more group, slot L, the base tokens at the end of the sorted ids),
which get zeros. That fills a LoRA delta with no memset before it. When the
step's metadata gives a layer no adapters' tiles (no adapter of the step has
weights in its page block, lora_meta), every program writes zeros over its own
rows and columns instead, with no per-tile lookups.

The product is rounded to y's dtype before the add: y = round(y + round(product)), what
PEFT's separately computed LoRA output gives, and what adding a rounded delta later gives.
"""
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraserve.kernels.launch import BoundLaunch, CachedLauncher, cdiv, next_power_of_2, pdl_launch
from loraserve.kernels.lora_meta import PAGE_RANK, LoRAMeta
from loraserve.kernels.lora_shrink import check_meta, check_pages, dot_precision, slot_work, token_programs

# Token counts up to this use the decode-shaped expand (16-token tiles, the step's work spread over the grid).
EXPAND_SMALL_TILE_TOKENS = 256
# The most slices (q/k/v: 3) a packed layer may have for the expand with pipelined column tiles (col_stages > 1).
MAX_PIPELINED_SLICES = 3
# The widest factors (max_lora_rank rounded up to pages) the kernels load once per work item and pipeline over
# its column tiles (col_stages; silu_and_mul's factors): one dot over all of them. Wider ones take rank steps
# of block_r within each column tile (their B tiles, times the stages, would not fit registers and shared memory).
MAX_PIPELINED_RANK = 64


def pipelined_shape(col_stages: int, block_r: int, rank_width: int) -> tuple[int, int]:
    """(column-tile stages, BLOCK_R) of a kernel asked for col_stages pipelined column tiles over factors
    rank_width wide (max_lora_rank rounded up to pages): every rank in one step while the width is at most
    MAX_PIPELINED_RANK; otherwise (or col_stages 1) one stage, rank steps of block_r."""
    if col_stages > 1 and rank_width <= MAX_PIPELINED_RANK:
        return col_stages, max(block_r, next_power_of_2(rank_width))
    return 1, block_r


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int  # tokens per tile
    block_n: int  # output columns per tile
    block_r: int  # ranks per inner step
    num_warps: int = 4
    num_stages: int = 2
    col_tiles: int = 1  # column tiles each program handles in turn
    # spread a step's work over the grid at run time (decode shapes); else the token programs take their tiles
    # in turn (prefill shapes: few, large tiles)
    dynamic: bool = False
    # token programs x this (up to one per token tile a step can have), so that a step of many adapters gives
    # each program a shorter run of columns (expand_grid); 1: the shrink's token axis
    program_scale: int = 1
    # load the pages of a work item's first BLOCK_R ranks once for all its column tiles, not once per column
    # tile (each such load is a dependent global load before the tile's B load)
    hoist_pages: bool = False
    # > 1: a work item loads its pages and its tokens' factors (every rank, of each slice) once and pipelines its
    # column tiles' loads this deep (a dot over BLOCK_R >= the rank width, one per tile where the slices' boundaries
    # fall on column tiles, else one per slice of the tile; packed layers of at most MAX_PIPELINED_SLICES slices,
    # rank widths up to MAX_PIPELINED_RANK); 1, or wider factors: rank steps of block_r within each column tile in
    # turn (hoist_pages applies to these only)
    col_stages: int = 1


@functools.lru_cache(maxsize=4096)  # a pure function of an int, called for every launch
def expand_config(num_tokens: int) -> ExpandConfig:
    """The static kernel shape for T tokens.

    Large T: 16-token tiles, each program walking 8 column tiles, which spreads the cost of finding its
    tokens (measured on an H100 at T = 8192 for Llama-3-8B's q/k/v, o and down outputs: 9% faster than
    32-token tiles walking 4; each at 1.12-1.15x the byte floor of its read-modify-write).
    """
    if num_tokens <= EXPAND_SMALL_TILE_TOKENS:
        # Decode steps. 16-token tiles: a step of many adapters has one or two rows per adapter, which 32-token
        # tiles leave mostly empty (measured on an H100, Llama-3-8B's layers at T = 128 / 256 with 64 or 128-256
        # distinct rank-16 adapters: 1.3-2.4x faster; with 8 adapters -3.7 to +1.6 us a launch). One stage: a
        # decode item's rank loop has one or two steps, so a second buys no overlap and its registers cost
        # programs per SM (measured on an H200, Llama-3-8B's layers at T = 32-256 with 8-200 distinct adapters
        # of rank 8 or 16, overwrite: 0-25% faster a layer, 6-16% over the four, than two stages with 2 or 4
        # warps; wider column tiles were slower).
        return ExpandConfig(16, 128, 16, num_warps=4, num_stages=1, dynamic=True)
    if num_tokens >= 1024:
        return ExpandConfig(16, 128, 16, num_warps=4, num_stages=1, col_tiles=8)
    return ExpandConfig(32, 128, 16, num_warps=4)


@functools.lru_cache(maxsize=4096)  # pure, called for every eager launch
def _slices_aligned(slice_offsets: tuple[int, ...], block_n: int) -> bool:
    """Whether every slice boundary of a packed output falls on a column tile (a tile then lies in one slice)."""
    return all(offset % block_n == 0 for offset in slice_offsets[1:-1])


@triton.jit
def _rank_step(acc, page, offs_r, r_ok, inter_rows, b_ptr, tok_ok, cols, col_ok, s, rank_max,
               stride_ir, stride_bp, stride_br, stride_bn, PRECISION: tl.constexpr, PAGE: tl.constexpr):
    """acc + inter[:, s * rank_max + offs_r] . B^T[offs_r, cols] for one slice s and BLOCK_R ranks, B's rank row r
    being row r % PAGE of page `page` (page: [BLOCK_R], for each of offs_r)."""
    b_rows = b_ptr + page.to(tl.int64)[:, None] * stride_bp + (offs_r % PAGE)[:, None] * stride_br
    b = tl.load(b_rows + cols[None, :] * stride_bn,
                mask=r_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
    a = tl.load(inter_rows + (s * rank_max + offs_r)[None, :] * stride_ir,
                mask=tok_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
    return acc + tl.dot(a, b.to(tl.float32), input_precision=PRECISION)


@triton.jit
def _add_slice_products(acc, inter_rows, b_ptr, page_row, first_pages, tok_ok, cols, col0, rank, rank_max,
                        stride_ir, stride_bp, stride_br, stride_bn, SLICE_OFFSETS: tl.constexpr,
                        NUM_SLICES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        PRECISION: tl.constexpr, PAGE: tl.constexpr, HOIST_PAGES: tl.constexpr):
    """acc: [BLOCK_M, BLOCK_N] += inter . B^T over the first `rank` ranks, slice by slice; B's rank row r
    is row r % PAGE of page page_row[r // PAGE]. With HOIST_PAGES the pages of the first BLOCK_R ranks are
    first_pages (loaded once per work item), not loaded again for each column tile."""
    for s in tl.static_range(NUM_SLICES):
        lo = SLICE_OFFSETS[s]
        hi = SLICE_OFFSETS[s + 1]
        if (col0 < hi) & (col0 + BLOCK_N > lo):
            col_ok = (cols >= lo) & (cols < hi)
            first_r = 0
            if HOIST_PAGES:
                offs_r = tl.arange(0, BLOCK_R)
                acc = _rank_step(acc, first_pages, offs_r, offs_r < rank, inter_rows, b_ptr, tok_ok, cols, col_ok,
                                 s, rank_max, stride_ir, stride_bp, stride_br, stride_bn, PRECISION, PAGE)
                first_r = BLOCK_R
            for r0 in range(first_r, rank, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_ok = offs_r < rank
                page = tl.load(page_row + offs_r // PAGE, mask=r_ok, other=0)  # page: [BLOCK_R]
                acc = _rank_step(acc, page, offs_r, r_ok, inter_rows, b_ptr, tok_ok, cols, col_ok, s, rank_max,
                                 stride_ir, stride_bp, stride_br, stride_bn, PRECISION, PAGE)
    return acc


@triton.jit
def _old_tile(y_rows, cols, mask, stride_yn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OVERWRITE: tl.constexpr):
    """y's [BLOCK_M, BLOCK_N] tile at cols (zeros with OVERWRITE: y is not read)."""
    if OVERWRITE:
        old = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_rows.dtype.element_ty)
    else:
        old = tl.load(y_rows + cols[None, :] * stride_yn, mask=mask, other=0.0)
    return old


@triton.jit
def _store_sum(y_rows, cols, mask, stride_yn, old, acc):
    """y's tile at cols = old + the product acc, the product rounded to y's dtype first (as a separately stored
    delta would be)."""
    product = acc.to(old.dtype).to(tl.float32)
    tl.store(y_rows + cols[None, :] * stride_yn, (old.to(tl.float32) + product).to(old.dtype), mask=mask)


@triton.jit
def _expand_col_tile(col0, inter_rows, y_rows, tok_ok, b_ptr, page_row, first_pages, rank, rank_max, n_out,
                     stride_ir, stride_bp, stride_br, stride_bn, stride_yn,
                     SLICE_OFFSETS: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                     OVERWRITE: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr, HOIST_PAGES: tl.constexpr):
    """The columns col0 .. col0 + BLOCK_N of one token tile."""
    cols = col0 + tl.arange(0, BLOCK_N)  # cols: [BLOCK_N]
    # y is read before the products so that its load overlaps theirs
    mask = tok_ok[:, None] & (cols < n_out)[None, :]
    old = _old_tile(y_rows, cols, mask, stride_yn, BLOCK_M, BLOCK_N, OVERWRITE)  # [BM, BN]
    if PDL:  # launched early beside the shrink: wait for its intermediate (y was ready before it)
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _add_slice_products(acc, inter_rows, b_ptr, page_row, first_pages, tok_ok, cols, col0, rank, rank_max,
                              stride_ir, stride_bp, stride_br, stride_bn, SLICE_OFFSETS, NUM_SLICES,
                              BLOCK_N, BLOCK_R, PRECISION, PAGE, HOIST_PAGES)
    _store_sum(y_rows, cols, mask, stride_yn, old, acc)


@triton.jit
def _expand_item_pipelined(first_col_tile, num_col_tiles, inter_rows, y_rows, tok_ok, b_ptr, page_row, rank,
                           rank_max, n_out, stride_ir, stride_bp, stride_br, stride_bn, stride_yn,
                           SLICE_OFFSETS: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                           OVERWRITE: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr, COL_STAGES: tl.constexpr,
                           SLICES_ALIGNED: tl.constexpr):
    """A work item's column tiles with its pages and factors loaded once (BLOCK_R >= rank_max) and the tiles'
    loads pipelined COL_STAGES deep. With SLICES_ALIGNED (every slice boundary a multiple of BLOCK_N) each tile
    lies in one slice and takes one dot with that slice's factors; otherwise it sums one dot per slice over the
    columns of that slice."""
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    pages = tl.load(page_row + offs_r // PAGE, mask=r_ok, other=0)  # [BLOCK_R]
    b_rows = b_ptr + pages.to(tl.int64)[:, None] * stride_bp + (offs_r % PAGE)[:, None] * stride_br
    if PDL:  # launched early beside the shrink: wait for its intermediate
        tl.extra.cuda.gdc_wait()
    a_mask = tok_ok[:, None] & r_ok[None, :]
    a0 = tl.load(inter_rows + offs_r[None, :] * stride_ir, mask=a_mask, other=0.0)  # [BLOCK_M, BLOCK_R] slice 0
    a1 = a0
    a2 = a0
    if NUM_SLICES > 1:
        a1 = tl.load(inter_rows + (rank_max + offs_r)[None, :] * stride_ir, mask=a_mask, other=0.0)
    if NUM_SLICES > 2:
        a2 = tl.load(inter_rows + (2 * rank_max + offs_r)[None, :] * stride_ir, mask=a_mask, other=0.0)
    for j in tl.range(num_col_tiles, num_stages=COL_STAGES):
        col0 = (first_col_tile + j) * BLOCK_N
        cols = col0 + tl.arange(0, BLOCK_N)  # cols: [BLOCK_N]
        col_ok = cols < n_out
        mask = tok_ok[:, None] & col_ok[None, :]
        old = _old_tile(y_rows, cols, mask, stride_yn, BLOCK_M, BLOCK_N, OVERWRITE)  # [BM, BN]
        b = tl.load(b_rows + cols[None, :] * stride_bn, mask=r_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_N]
        if SLICES_ALIGNED:  # the tile's slice: the last whose first column is at most col0
            a = a0  # [BLOCK_M, BLOCK_R]: the factors of the tile's slice
            if NUM_SLICES > 1:
                a = tl.where(col0 >= SLICE_OFFSETS[1], a1, a)
            if NUM_SLICES > 2:
                a = tl.where(col0 >= SLICE_OFFSETS[2], a2, a)
            acc = tl.dot(a, b, input_precision=PRECISION)
        else:
            acc = tl.dot(a0, tl.where((cols < SLICE_OFFSETS[1])[None, :], b, 0.0), input_precision=PRECISION)
            if NUM_SLICES > 1:
                in_slice = (cols >= SLICE_OFFSETS[1]) & (cols < SLICE_OFFSETS[2])
                acc += tl.dot(a1, tl.where(in_slice[None, :], b, 0.0), input_precision=PRECISION)
            if NUM_SLICES > 2:
                acc += tl.dot(a2, tl.where((cols >= SLICE_OFFSETS[2])[None, :], b, 0.0), input_precision=PRECISION)
        _store_sum(y_rows, cols, mask, stride_yn, old, acc)


@triton.jit
def _expand_item(code, first_col_tile, num_col_tiles,
                 inter_ptr, b_ptr, rank_ptr, sorted_ptr, start_ptr, count_ptr, adapter_ptr, page_ptr, y_ptr,
                 num_tokens, n_out, rank_max, stride_it, stride_ir, stride_bp, stride_br, stride_bn, stride_pa,
                 stride_yt, stride_yn,
                 SLICE_OFFSETS: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, OVERWRITE: tl.constexpr,
                 PAGE: tl.constexpr, PDL: tl.constexpr, HOIST_PAGES: tl.constexpr, COL_STAGES: tl.constexpr,
                 SLICES_ALIGNED: tl.constexpr):
    """One work item: num_col_tiles column tiles from first_col_tile of the token tile of map entry `code`."""
    slot, m_tile = code >> 16, code & 0xFFFF
    rank, count, start, adapter = slot_work(slot, rank_ptr, start_ptr, count_ptr, adapter_ptr)
    if OVERWRITE | (rank > 0):  # else an adapter that does not target this layer: rows left as they are
        offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = tl.load(sorted_ptr + start + offs_m, mask=offs_m < count, other=0)  # tok: [BLOCK_M]
        tok_ok = (offs_m < count) & (tok >= 0) & (tok < num_tokens)
        inter_rows = inter_ptr + tok.to(tl.int64)[:, None] * stride_it
        y_rows = y_ptr + tok.to(tl.int64)[:, None] * stride_yt
        page_row = page_ptr + tl.maximum(adapter, 0).to(tl.int64) * stride_pa
        if COL_STAGES > 1:
            _expand_item_pipelined(first_col_tile, num_col_tiles, inter_rows, y_rows, tok_ok, b_ptr, page_row, rank,
                                   rank_max, n_out, stride_ir, stride_bp, stride_br, stride_bn, stride_yn,
                                   SLICE_OFFSETS, NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R, PRECISION, OVERWRITE, PAGE,
                                   PDL, COL_STAGES, SLICES_ALIGNED)
        else:
            if HOIST_PAGES:  # the pages of the first BLOCK_R ranks, once for all the item's column tiles
                first_pages = tl.load(page_row + tl.arange(0, BLOCK_R) // PAGE, mask=tl.arange(0, BLOCK_R) < rank,
                                      other=0)  # [BLOCK_R]
            else:
                first_pages = tl.zeros((BLOCK_R,), dtype=tl.int32)
            for j in range(num_col_tiles):
                _expand_col_tile((first_col_tile + j) * BLOCK_N, inter_rows, y_rows, tok_ok, b_ptr, page_row,
                                 first_pages, rank, rank_max, n_out, stride_ir, stride_bp, stride_br, stride_bn,
                                 stride_yn, SLICE_OFFSETS, NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R, PRECISION,
                                 OVERWRITE, PAGE, PDL, HOIST_PAGES)


@triton.jit
def _zero_rows(y_ptr, num_tokens, n_out, stride_yt, stride_yn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COL_TILES: tl.constexpr):
    """y = 0 over program (column group c, token program p)'s part of y: rows p * BLOCK_M .., column tiles
    c * COL_TILES ..; the grid covers every row and column (expand_grid)."""
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # rows: [BLOCK_M]
    row_ok = rows < num_tokens
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * stride_yt
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty)
    for j in range(COL_TILES):
        cols = (tl.program_id(0) * COL_TILES + j) * BLOCK_N + tl.arange(0, BLOCK_N)  # cols: [BLOCK_N]
        tl.store(y_rows + cols[None, :] * stride_yn, zeros, mask=row_ok[:, None] & (cols < n_out)[None, :])


@triton.jit(do_not_specialize=["num_tokens"])  # one compiled kernel serves every batch size
def _expand_kernel(
    inter_ptr, b_ptr, rank_ptr, sorted_ptr, start_ptr, count_ptr, adapter_ptr, map_ptr, tiles_ptr, page_ptr, y_ptr,
    num_tokens, n_out, rank_max, num_tiles,
    stride_it, stride_ir, stride_bp, stride_br, stride_bn, stride_pa, stride_yt, stride_yn,
    SLICE_OFFSETS: tl.constexpr, NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    COL_TILES: tl.constexpr, PRECISION: tl.constexpr, OVERWRITE: tl.constexpr, PAGE: tl.constexpr,
    DYNAMIC: tl.constexpr, PDL: tl.constexpr, HOIST_PAGES: tl.constexpr, COL_STAGES: tl.constexpr,
    SLICES_ALIGNED: tl.constexpr,
):
    # With PDL, programs without work end before gdc_wait. That is safe: a program with work waits for
    # the whole shrink grid, and the expand has work on every tile where the shrink has some (an
    # adapter's tokens of rank > 0), so whenever the shrink does anything the expand's completion
    # implies the shrink's (what the next shrink, reusing the tile counters, needs).
    # the tiles to cover: the adapters' (the map's first entries), and with overwrite the base tokens' too
    lora_tiles = tl.load(tiles_ptr)
    if OVERWRITE:
        tiles = tl.minimum(tl.load(tiles_ptr + 1), num_tiles)
    else:
        tiles = tl.minimum(lora_tiles, num_tiles)
    code = tl.load(map_ptr + tl.program_id(1))  # the first tile of this token program (loaded beside the count)
    if OVERWRITE and (lora_tiles == 0):
        # no adapter of the step has weights in this layer's page block: zeros, by rows, with no lookups (the
        # shrink, which sees the same count, did nothing: nothing to wait for)
        _zero_rows(y_ptr, num_tokens, n_out, stride_yt, stride_yn, BLOCK_M, BLOCK_N, COL_TILES)
    elif DYNAMIC and (tiles > tl.num_programs(1)):
        # more tiles than token programs: an item is a token tile and a run of column tiles, longer than
        # COL_TILES where that keeps every item a program of its own; items u = pid, pid + programs, ...
        n_col_tiles = tl.cdiv(n_out, BLOCK_N)
        programs = tl.num_programs(0) * tl.num_programs(1)
        run = tl.cdiv(n_col_tiles, tl.maximum(tl.minimum(tl.cdiv(n_col_tiles, COL_TILES), programs // tiles), 1))
        runs = tl.cdiv(n_col_tiles, run)
        u = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        while u < tiles * runs:
            first_col_tile = (u % runs) * run
            _expand_item(tl.load(map_ptr + u // runs), first_col_tile, tl.minimum(run, n_col_tiles - first_col_tile),
                         inter_ptr, b_ptr, rank_ptr, sorted_ptr, start_ptr, count_ptr, adapter_ptr, page_ptr, y_ptr,
                         num_tokens, n_out, rank_max, stride_it, stride_ir, stride_bp, stride_br, stride_bn,
                         stride_pa, stride_yt, stride_yn, SLICE_OFFSETS, NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R,
                         PRECISION, OVERWRITE, PAGE, PDL, HOIST_PAGES, COL_STAGES,
                         SLICES_ALIGNED)
            u += programs
    else:
        # the grid's own items: program (column group, p) takes token tiles p, p + G, ... (G token programs)
        tile = tl.program_id(1)
        while tile < tiles:
            next_code = tl.load(map_ptr + tl.minimum(tile + tl.num_programs(1), num_tiles - 1))  # its load overlaps
            _expand_item(code, tl.program_id(0) * COL_TILES, COL_TILES,
                         inter_ptr, b_ptr, rank_ptr, sorted_ptr, start_ptr, count_ptr, adapter_ptr, page_ptr, y_ptr,
                         num_tokens, n_out, rank_max, stride_it, stride_ir, stride_bp, stride_br, stride_bn,
                         stride_pa, stride_yt, stride_yn, SLICE_OFFSETS, NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R,
                         PRECISION, OVERWRITE, PAGE, PDL, HOIST_PAGES, COL_STAGES,
                         SLICES_ALIGNED)
            tile += tl.num_programs(1)
            code = next_code


_expand_launch = CachedLauncher(_expand_kernel)


def expand_grid(cfg: ExpandConfig, num_tokens: int, n_out: int, num_loras: int, overwrite: bool) -> tuple[int, int]:
    """(column-tile groups, token-tile programs): the shrink's token axis (token_programs) times
    cfg.program_scale, at most one program per tile a step of T tokens over L slots can have (the tile map's
    length), with overwrite one more for the base group's partial tile."""
    programs = token_programs(num_tokens, cfg.block_m, num_loras)
    if cfg.program_scale > 1:
        programs = min(cfg.program_scale * programs,
                       token_programs(num_tokens, cfg.block_m, num_loras, every_tile=True))
    return cdiv(cdiv(n_out, cfg.block_n), cfg.col_tiles), programs + int(overwrite)


def lora_expand(inter: torch.Tensor, lora_b: torch.Tensor, lora_rank: torch.Tensor,
                meta: LoRAMeta, slice_offsets: tuple[int, ...], y: torch.Tensor,
                config: ExpandConfig | None = None, overwrite: bool = False, after_shrink: bool = False,
                bind: bool = False) -> BoundLaunch | None:
    """y: [T, N] += inter: [T, S*R] float32 times each token's adapter's B, from the pool pages
    lora_b: [P, PAGE_RANK, N] (lora_meta), lora_rank: [A] int32 each adapter id's rank in this layer.

    overwrite: y = the product instead (every row written, zeros for tokens without a slot or with a
    rank-0 adapter; y is not read).

    y has B's dtype, or float32. With overwrite, y is a separate LoRA delta that a later kernel adds to
    the base output. The product is rounded to y's dtype before it is added.

    after_shrink: the kernel launched last on this stream is the lora_shrink that wrote inter. On
    Hopper the expand then launches early (programmatic dependent launch): it finds its tokens and
    loads y while the shrink finishes, and waits for it only before reading inter. Leave it False otherwise: the
    ranks and metadata are read before that wait.

    slice_offsets (S+1 host ints, from 0 to N) give each slice's columns.
    Rows of tokens without a slot are untouched. meta must have been built
    from at most T token slots. `config` overrides the static kernel shape
    (tests, tuning).

    bind: return a BoundLaunch that repeats this launch for another token count
    (`bound(expand_grid(cfg, T, N, L, overwrite), T)`) with the same buffers: inter
    and y must then have row strides that do not depend on T (views of static
    scratch), as the bound launch keeps them.
    """
    num_tokens, n_out = y.shape
    _, page_rows, b_cols = lora_b.shape
    offsets = tuple(int(o) for o in slice_offsets)
    num_slices = len(offsets) - 1
    if num_slices < 1 or offsets[0] != 0 or offsets[-1] != n_out or \
            any(a > b for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"slice_offsets {offsets} must rise from 0 to N={n_out}")
    if b_cols != n_out or page_rows != PAGE_RANK:
        raise ValueError(f"lora_b's pages are [{page_rows}, {b_cols}], not [{PAGE_RANK}, N={n_out}]")
    if inter.dim() != 2 or inter.shape[0] != num_tokens or inter.shape[1] % num_slices \
            or inter.dtype != torch.float32:
        raise ValueError(f"inter must be [{num_tokens}, S*R] float32 with S={num_slices}, "
                         f"got {list(inter.shape)} {inter.dtype}")
    if y.dtype not in (lora_b.dtype, torch.float32):
        raise ValueError(f"y is {y.dtype} but lora_b is {lora_b.dtype} (y may also be float32)")
    num_loras = check_meta(meta, lora_rank, num_tokens)
    rank_max = inter.shape[1] // num_slices
    check_pages(meta, rank_max)
    if num_tokens == 0:
        return
    cfg = config or expand_config(num_tokens)
    col_stages, block_r = pipelined_shape(cfg.col_stages, cfg.block_r, rank_max)
    if col_stages > 1 and num_slices > MAX_PIPELINED_SLICES:
        raise ValueError(f"an expand with pipelined column tiles takes at most {MAX_PIPELINED_SLICES} slices, "
                         f"got {num_slices}")
    grid = expand_grid(cfg, num_tokens, n_out, num_loras, overwrite)
    tile_map = meta.tile_map(cfg.block_m)
    launch = functools.partial(_expand_launch.call_and_bind, variable=("num_tokens",)) if bind else _expand_launch
    return launch(grid,
        inter, lora_b, lora_rank, meta.sorted_token_ids, meta.slot_start, meta.slot_count, meta.slot_adapter,
        tile_map, meta.tile_count(cfg.block_m), meta.page_table, y,
        num_tokens, n_out, rank_max, tile_map.shape[0],
        inter.stride(0), inter.stride(1),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), meta.page_table.stride(0), y.stride(0), y.stride(1),
        SLICE_OFFSETS=offsets, NUM_SLICES=num_slices,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=block_r, COL_TILES=cfg.col_tiles,
        PRECISION=dot_precision(lora_b.dtype), OVERWRITE=overwrite, PAGE=PAGE_RANK, DYNAMIC=cfg.dynamic,
        HOIST_PAGES=cfg.hoist_pages, COL_STAGES=col_stages,
        SLICES_ALIGNED=_slices_aligned(offsets, cfg.block_n),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(y, wanted=after_shrink),
    )


@dataclass(frozen=True)
class LoRAFactors:
    """A layer's LoRA product not yet expanded: the op that consumes the layer's output expands it tile by
    tile while it reads that output (kernels/fused.py), so the product never makes a [T, N] round trip
    through memory.

    inter: [T, S*R] float32, the shrink's output (only the ranks of each token's adapter are read);
    lora_b: [P, PAGE_RANK, N], lora_rank: [A] int32, meta and slice_offsets as lora_expand takes them;
    max_rank: at least the rank of every token's adapter in this layer (known on the host from the step's
    adapters), the width of the expanding kernel's dot; None: R.
    """

    inter: torch.Tensor
    lora_b: torch.Tensor
    lora_rank: torch.Tensor
    meta: LoRAMeta
    slice_offsets: tuple[int, ...]
    max_rank: int | None = None

    @property
    def rank_width(self) -> int:
        return self.inter.shape[1] // (len(self.slice_offsets) - 1)

    @property
    def dot_width(self) -> int:
        """The ranks an expanding kernel's dot must cover: R, or max_rank where that is less."""
        width = self.rank_width
        return width if self.max_rank is None else max(1, min(width, self.max_rank))

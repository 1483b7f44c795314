"""LoRA shrink: inter[t, s*R + r] = x[t] . A_s[adapter_t, r] for every slice s of a packed layer.

One launch covers all slices and all adapters of a step. A's rank rows live in
pool pages (lora_meta: PAGE_RANK rows per page, found through the page table),
so each row is gathered from its page. Tokens are grouped by slot (LoRAMeta).
The grid has static sizes only: G = cdiv(T, BLOCK_M) + min(L, T, LOOSE_TILES)
token programs (long prefill shapes: + min(L, T), a program for every tile a
step can have) times the row tiles of the S*R rows times the static split-K
factor (SPLIT_K); the pool's size never grows it. A work item
is (token tile of an adapter, row tile, split), the token tiles read from the
step's tile map (one load each) and their number from its tile count. While
the step's adapter tiles fit the G token programs, program (row tile x split,
p) takes tile p (prefill shapes: tiles p, p + G, ... in turn). In the decode
shapes (ShrinkConfig.dynamic) a step of more tiles (many adapters of a few
tokens each) splits K less instead: the largest split (at most SPLIT_K) that
still gives every item a program of its own, or beyond that programs take items
in turn (p, p + programs, ...); so a step of 200 adapters does not run their
tiles one after another on 24 programs. The rows of an item are the adapter's
own S*rank rows (slice j // rank, rank row j % rank): a row tile wholly beyond
them is skipped at once, and an adapter of rank r costs cdiv(S*r, BLOCK_N) row
tiles whatever max_lora_rank is.

Two static shapes: decode (T <= SHRINK_DECODE_MAX_TOKENS) splits K up to 16
ways so that the few tiles of each adapter still spread its A rows over many
programs; prefill uses larger token and row tiles and splits K at most 4 ways.
The split-K programs of one output tile add up their partial sums in the same
launch: each stores its partial to a scratch slice and counts itself on the
tile's counter (LoRAMeta.tile_counters, acquire-release atomic); the last one
loads the other partials, sums all of them in split order (so the result is
bit-identical whichever program comes last, which the start-up graph-vs-eager
check relies on), writes the tile and puts the counter back to 0 for the next
launch (so the kernel replays in a CUDA graph any number of times). The shape
depends on T alone, so one CUDA graph bucket always runs the same kernel; the
split a decode shape takes depends on the step's tiles, read on the device (the
same metadata gives the same split, in a graph or not).
"""
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraserve.kernels.launch import BoundLaunch, CachedLauncher, cdiv, next_power_of_2, pdl_supported
from loraserve.kernels.lora_meta import COUNTER_ROW_TILES, PAGE_RANK, LoRAMeta

# Programs on the token-tile axis beyond one per BLOCK_M tokens: up to this many adapters' partial tiles run
# side by side at the full split; with more adapters in a step, K is split less (or programs take several
# work items each), so the grid does not grow with max_loras (token_programs; the long-prefill shapes have a
# program for every tile instead).
LOOSE_TILES = 8
# Token counts up to this use the decode-shaped (split-K) shrink. Measured on an
# H200 with 8 adapters: at T = 128..256 the prefill shape leaves too few programs.
SHRINK_DECODE_MAX_TOKENS = 256
# From this many tokens the prefill shrink does not split K (its token tiles are enough programs).
PREFILL_UNSPLIT_TOKENS = 2048


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int  # tokens per tile
    block_n: int  # rows of A (of S*R) per tile
    block_k: int  # hidden features per inner step
    split_k: int  # programs sharing one dot product's K range (partial sums when > 1)
    num_warps: int = 4
    num_stages: int = 3
    # spread a step's work over the grid at run time (decode shapes); else the token programs take their tiles
    # in turn (prefill shapes: few, large tiles)
    dynamic: bool = False
    # one token program per tile a step can have (token_programs), so that no tile waits for another on its
    # program: the GPU starts each as a slot frees up (prefill shapes)
    tile_programs: bool = False


@functools.lru_cache(maxsize=4096)  # a pure function of ints, called for every launch
def shrink_config(num_tokens: int, hidden: int, sr: int) -> ShrinkConfig:
    """The static kernel shape for T tokens, `hidden` input features and S*R rows.

    Row tiles are widened where S*R would need more than COUNTER_ROW_TILES of them.
    """
    min_block_n = max(16, next_power_of_2(cdiv(sr, COUNTER_ROW_TILES)))
    if num_tokens <= SHRINK_DECODE_MAX_TOKENS:
        return ShrinkConfig(16, min_block_n, 128, max(1, min(16, cdiv(hidden, 256))), dynamic=True)
    block_n = max(min_block_n, min(64, next_power_of_2(sr)))
    if num_tokens >= PREFILL_UNSPLIT_TOKENS:
        # Unsplit K, a program per tile the step can have (measured on an H200, Llama-3-8B's four LoRA layers
        # in the steps of lora_kernels.py --prefill-steps, T = 2016-8251, 2-28 prompts, up to 187 decode rows:
        # 0.63-1.06x the former 64-token tiles on 8 warps split 1, 2 or 4 ways on a fixed grid, 0.85x in all;
        # there, once a step's tiles outnumbered the programs, each program ran a second tile after the first:
        # 28 prompts of 288 tokens took 1.6x the time of 8 of 1024). 32-token tiles below 4096 tokens keep
        # enough of them.
        block_m = 64 if num_tokens >= 2 * PREFILL_UNSPLIT_TOKENS else 32
        return ShrinkConfig(block_m, block_n, 128, 1, num_warps=4, num_stages=4, tile_programs=True)
    # Shorter prefill: K in steps of 128, split 4 ways (measured on an H100, Llama-3-8B's four LoRA layers).
    return ShrinkConfig(64, block_n, 128, max(1, min(4, cdiv(hidden, 1024))), num_warps=8, num_stages=4)


@triton.jit
def slot_of_tile(tile, map_ptr, num_tiles):
    """(slot, tile within the slot) of a flat token tile from the step's tile map (num_tiles entries);
    slot < 0 past the last."""
    code = tl.load(map_ptr + tile, mask=tile < num_tiles, other=-1)
    return code >> 16, code & 0xFFFF


@triton.jit
def slot_work(slot, rank_ptr, start_ptr, count_ptr, adapter_ptr):
    """(rank in this layer, token count, start in the sorted ids, adapter id) of a slot (adapter -1: rank 0)."""
    count = tl.load(count_ptr + slot)
    start = tl.load(start_ptr + slot)
    adapter = tl.load(adapter_ptr + slot)
    rank = tl.load(rank_ptr + tl.maximum(adapter, 0))
    return tl.where(adapter >= 0, rank, 0), count, start, adapter


@triton.jit
def shrink_split(programs, lora_tiles, token_programs, row_tiles, hidden, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, DYNAMIC: tl.constexpr):
    """(split-K factor, hidden features per split) of a shrink launch of `programs` programs, token_programs
    of them on the token axis, for a step of lora_tiles adapter token tiles: SPLIT_K (the grid's), or with
    DYNAMIC and more tiles than token programs, the most splits for which every (tile, row tile, split) still
    gets a program of its own, at least 1; every split non-empty. Mirrored on the host by effective_split."""
    split = tl.minimum(SPLIT_K, tl.cdiv(hidden, BLOCK_K))
    if DYNAMIC:
        if lora_tiles > token_programs:
            split = tl.minimum(tl.maximum(programs // (lora_tiles * row_tiles), 1), split)
    k_per_split = tl.cdiv(tl.cdiv(hidden, split), BLOCK_K) * BLOCK_K
    return tl.cdiv(hidden, k_per_split), k_per_split


@triton.jit
def _shrink_rows(
    tile, m_tile, n_tile, split, split_k, k_per_split, rank, count, start, adapter,
    x_ptr, a_ptr, sorted_ptr, page_ptr, part_ptr, out_ptr, counter_ptr,
    num_tokens, hidden, num_slices, rank_max,
    stride_xt, stride_xk, stride_ap, stride_an, stride_ak, stride_pa, stride_ps, stride_pt, stride_pn,
    stride_ot, stride_on, stride_ct,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BN: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr, PAGE: tl.constexpr,
):
    """The first BN <= BLOCK_N rows of row tile n_tile of a work item (token tile m_tile of its slot; `tile` in the
    step's map): the rows of the adapter's own that lie there."""
    # rows j of the adapter's own S*rank rows: slice j // rank, rank row j % rank
    rows = n_tile * BLOCK_N + tl.arange(0, BN)  # rows: [BN]
    row_ok = rows < num_slices * rank
    s = rows // tl.maximum(rank, 1)
    r = rows % tl.maximum(rank, 1)
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = tl.load(sorted_ptr + start + offs_m, mask=offs_m < count, other=0)  # tok: [BLOCK_M]
    tok_ok = (offs_m < count) & (tok >= 0) & (tok < num_tokens)

    # each row of A from its page: [BN] pages, rows s*PAGE + r % PAGE within the page
    page = tl.load(page_ptr + adapter.to(tl.int64) * stride_pa + r // PAGE, mask=row_ok, other=0)
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xt
    a_rows = a_ptr + page.to(tl.int64)[None, :] * stride_ap + (s * PAGE + r % PAGE)[None, :] * stride_an
    acc = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    for kk in range(0, k_per_split, BLOCK_K):
        offs_k = split * k_per_split + kk + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        a = tl.load(a_rows + offs_k[:, None] * stride_ak,
                    mask=k_ok[:, None] & row_ok[None, :], other=0.0)  # a: [BLOCK_K, BN]
        x = tl.load(x_rows + offs_k[None, :] * stride_xk,
                    mask=tok_ok[:, None] & k_ok[None, :], other=0.0)  # x: [BLOCK_M, BLOCK_K]
        acc += tl.dot(x, a, input_precision=PRECISION)

    mask = tok_ok[:, None] & row_ok[None, :]
    cols = s * rank_max + r  # the intermediate's columns s*R + r: [BN]
    dst = out_ptr + tok.to(tl.int64)[:, None] * stride_ot + cols[None, :] * stride_on
    if split_k == 1:
        tl.store(dst, acc, mask=mask)
    else:
        # part: [BLOCK_M, BN] pointers into split 0's slice of the partials
        part = part_ptr + tok.to(tl.int64)[:, None] * stride_pt + cols[None, :] * stride_pn
        tl.store(part + split.to(tl.int64) * stride_ps, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        counter = counter_ptr + tile * stride_ct + n_tile
        if tl.atomic_add(counter, 1, sem="acq_rel") == split_k - 1:  # the last of the split_k
            total = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
            for p in tl.static_range(SPLIT_K):  # in split order, whichever program is last; all loads at once
                # .cg: read from L2, where the other programs' stores landed (never a stale L1 line)
                in_split = tl.full((BLOCK_M, BN), p, tl.int32) < split_k
                total += tl.load(part + p * stride_ps, mask=mask & in_split, other=0.0, cache_modifier=".cg")
            tl.store(dst, total, mask=mask)
            tl.store(counter, 0)


@triton.jit
def _shrink_item(
    code, tile, n_tile, split, split_k, k_per_split,
    x_ptr, a_ptr, rank_ptr, sorted_ptr, start_ptr, count_ptr, adapter_ptr, page_ptr, part_ptr, out_ptr, counter_ptr,
    num_tokens, hidden, num_slices, rank_max,
    stride_xt, stride_xk, stride_ap, stride_an, stride_ak, stride_pa, stride_ps, stride_pt, stride_pn,
    stride_ot, stride_on, stride_ct,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr, PAGE: tl.constexpr,
):
    """One work item: row tile n_tile of token tile `tile` (map entry `code`) over split `split` of K. A row tile
    of which the adapter has at most 16 or 32 rows takes a dot of that width, not of BLOCK_N: a pool whose
    max_lora_rank is larger than an adapter's rank costs it no more than its own rows."""
    slot, m_tile = code >> 16, code & 0xFFFF
    rank, count, start, adapter = slot_work(slot, rank_ptr, start_ptr, count_ptr, adapter_ptr)
    rows_left = num_slices * rank - n_tile * BLOCK_N  # the adapter's rows from this row tile on
    if rows_left > 0:  # else: every row lies beyond the adapter's rank
        # a call site per dot width (a constexpr); `and` after a constexpr False prunes the branch at compile time
        if BLOCK_N > 16 and rows_left <= 16:
            _shrink_rows(
                tile, m_tile, n_tile, split, split_k, k_per_split, rank, count, start, adapter,
                x_ptr, a_ptr, sorted_ptr, page_ptr, part_ptr, out_ptr, counter_ptr, num_tokens, hidden, num_slices,
                rank_max, stride_xt, stride_xk, stride_ap, stride_an, stride_ak, stride_pa, stride_ps, stride_pt,
                stride_pn, stride_ot, stride_on, stride_ct, BLOCK_M, BLOCK_N, 16, BLOCK_K, SPLIT_K, PRECISION,
                PAGE)
        elif BLOCK_N > 32 and rows_left <= 32:
            _shrink_rows(
                tile, m_tile, n_tile, split, split_k, k_per_split, rank, count, start, adapter,
                x_ptr, a_ptr, sorted_ptr, page_ptr, part_ptr, out_ptr, counter_ptr, num_tokens, hidden, num_slices,
                rank_max, stride_xt, stride_xk, stride_ap, stride_an, stride_ak, stride_pa, stride_ps, stride_pt,
                stride_pn, stride_ot, stride_on, stride_ct, BLOCK_M, BLOCK_N, 32, BLOCK_K, SPLIT_K, PRECISION,
                PAGE)
        else:
            _shrink_rows(
                tile, m_tile, n_tile, split, split_k, k_per_split, rank, count, start, adapter,
                x_ptr, a_ptr, sorted_ptr, page_ptr, part_ptr, out_ptr, counter_ptr, num_tokens, hidden, num_slices,
                rank_max, stride_xt, stride_xk, stride_ap, stride_an, stride_ak, stride_pa, stride_ps, stride_pt,
                stride_pn, stride_ot, stride_on, stride_ct, BLOCK_M, BLOCK_N, BLOCK_N, BLOCK_K, SPLIT_K, PRECISION,
                PAGE)


@triton.jit
def _shrink_walk(
    first, lora_tiles, map_ptr, num_tiles, split_k, k_per_split,
    x_ptr, a_ptr, rank_ptr, sorted_ptr, start_ptr, count_ptr, adapter_ptr, page_ptr, part_ptr, out_ptr, counter_ptr,
    num_tokens, hidden, num_slices, rank_max,
    stride_xt, stride_xk, stride_ap, stride_an, stride_ak, stride_pa, stride_ps, stride_pt, stride_pn,
    stride_ot, stride_on, stride_ct,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr, PAGE: tl.constexpr,
):
    """The grid's own items: program (row tile x split, p) takes token tiles p, p + G, ... (G token programs;
    `first`: the map entry of tile p)."""
    n_tile = tl.program_id(0) // SPLIT_K
    split = tl.program_id(0) % SPLIT_K
    tile = tl.program_id(1)
    code = first
    while (tile < lora_tiles) & (split < split_k):
        next_code = tl.load(map_ptr + tl.minimum(tile + tl.num_programs(1), num_tiles - 1))  # its load overlaps
        _shrink_item(
            code, tile, n_tile, split, split_k, k_per_split,
            x_ptr, a_ptr, rank_ptr, sorted_ptr, start_ptr, count_ptr, adapter_ptr, page_ptr, part_ptr, out_ptr,
            counter_ptr, num_tokens, hidden, num_slices, rank_max,
            stride_xt, stride_xk, stride_ap, stride_an, stride_ak, stride_pa, stride_ps, stride_pt, stride_pn,
            stride_ot, stride_on, stride_ct, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, PRECISION, PAGE)
        tile += tl.num_programs(1)
        code = next_code


# one compiled kernel serves every batch size: the token count and the partial sums' split stride (T x S*R)
@triton.jit(do_not_specialize=["num_tokens", "stride_ps"])
def _shrink_kernel(
    x_ptr, a_ptr, rank_ptr, sorted_ptr, start_ptr, count_ptr, adapter_ptr, map_ptr, tiles_ptr, page_ptr, part_ptr,
    out_ptr, counter_ptr, num_tokens, hidden, num_slices, rank_max, num_tiles,
    stride_xt, stride_xk, stride_ap, stride_an, stride_ak, stride_pa, stride_ps, stride_pt, stride_pn,
    stride_ot, stride_on, stride_ct,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr,
    PAGE: tl.constexpr, DYNAMIC: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the expand launched after this may start its prologue now (it waits before reading out)
        tl.extra.cuda.gdc_launch_dependents()
    lora_tiles = tl.minimum(tl.load(tiles_ptr), num_tiles)  # the map's first lora_tiles entries: adapters' tokens
    first = tl.load(map_ptr + tl.program_id(1))  # the first tile of this token program (loaded beside the count)
    row_tiles = tl.cdiv(num_slices * rank_max, BLOCK_N)
    programs = tl.num_programs(0) * tl.num_programs(1)
    split_k, k_per_split = shrink_split(programs, lora_tiles, tl.num_programs(1), row_tiles, hidden, BLOCK_K,
                                        SPLIT_K, DYNAMIC)
    if DYNAMIC and (lora_tiles > tl.num_programs(1)):
        # more tiles than token programs: items (tile, row tile, split) u = pid, pid + programs, ...
        per_tile = row_tiles * split_k
        u = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        while u < lora_tiles * per_tile:
            tile = u // per_tile
            _shrink_item(
                tl.load(map_ptr + tile), tile, (u % per_tile) // split_k, u % split_k, split_k, k_per_split,
                x_ptr, a_ptr, rank_ptr, sorted_ptr, start_ptr, count_ptr, adapter_ptr, page_ptr, part_ptr, out_ptr,
                counter_ptr, num_tokens, hidden, num_slices, rank_max,
                stride_xt, stride_xk, stride_ap, stride_an, stride_ak, stride_pa, stride_ps, stride_pt, stride_pn,
                stride_ot, stride_on, stride_ct, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, PRECISION, PAGE)
            u += programs
    else:  # the grid's own items (every tile has a token program of its own, or a prefill shape)
        _shrink_walk(
            first, lora_tiles, map_ptr, num_tiles, split_k, k_per_split,
            x_ptr, a_ptr, rank_ptr, sorted_ptr, start_ptr, count_ptr, adapter_ptr, page_ptr, part_ptr, out_ptr,
            counter_ptr, num_tokens, hidden, num_slices, rank_max,
            stride_xt, stride_xk, stride_ap, stride_an, stride_ak, stride_pa, stride_ps, stride_pt, stride_pn,
            stride_ot, stride_on, stride_ct, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, PRECISION, PAGE)


_shrink_launch = CachedLauncher(_shrink_kernel)
_SHRINK_VARIABLE = ("x_ptr", "num_tokens", "stride_xt", "stride_xk")  # what a bound shrink takes per call


def token_programs(num_tokens: int, block_m: int, num_loras: int, every_tile: bool = False) -> int:
    """Programs on the token-tile axis: enough for every tile of T tokens over at most LOOSE_TILES adapters
    at once; with more adapters (more, smaller tiles) the kernels spread the tiles over the same programs
    (the shrink splits K less, the expand gives each program more columns; beyond that programs take
    several in turn), so the grid does not grow with max_loras in the decode shapes. every_tile: one
    program per tile a step of T tokens over L slots can have, cdiv(T, BLOCK_M) + min(L, T) (the tile map's
    length less one; it grows with max_loras); those past the step's tiles end after one load."""
    loose = min(num_loras, num_tokens) if every_tile else min(num_loras, num_tokens, LOOSE_TILES)
    return cdiv(num_tokens, block_m) + loose


def shrink_grid(cfg: ShrinkConfig, num_tokens: int, sr: int, num_loras: int) -> tuple[int, int]:
    """(row tiles x split-K programs, token-tile programs): static sizes only; the kernel spreads the step's
    work items over all of them (the module docstring)."""
    return (cdiv(sr, cfg.block_n) * cfg.split_k, token_programs(num_tokens, cfg.block_m, num_loras, cfg.tile_programs))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, lora_rank: torch.Tensor,
                meta: LoRAMeta, num_slices: int, out: torch.Tensor,
                config: ShrinkConfig | None = None, partials: torch.Tensor | None = None,
                bind: bool = False) -> BoundLaunch | None:
    """out: [T, S*R] float32 <- x: [T, in] times each token's adapter's A, from the pool pages
    lora_a: [P, S*PAGE_RANK, in] (lora_meta), lora_rank: [A] int32 each adapter id's rank in this layer.

    A split-K shrink sums its partials in the same launch (meta.tile_counters).

    Defined on return: out[t, s*R + r] for every token t with a slot and
    r < its adapter's rank (what lora_expand reads). Other elements are
    unspecified (zero or untouched). meta must have been built from at most T
    token slots (the grid is sized for T). Launches sharing meta's counters
    must be stream-ordered (never concurrent). `config` overrides the static
    kernel shape (tests, tuning).

    partials: [P, T, S*R] float32 scratch for the split-K partial sums (P =
    shrink_splits(...); allocated here when None; any row stride).
    bind: return a BoundLaunch that repeats this launch for another x
    (`bound(shrink_grid(cfg, T, S*R, L), x, T, x.stride(0), x.stride(1))`) with
    every other buffer the same: out and partials must then have row strides that
    do not depend on T (views of static scratch), as the bound launch keeps them.
    """
    num_tokens, hidden = x.shape
    _, page_rows, a_hidden = lora_a.shape
    if a_hidden != hidden:
        raise ValueError(f"x has {hidden} features but lora_a expects {a_hidden}")
    if num_slices < 1 or page_rows != num_slices * PAGE_RANK:
        raise ValueError(f"lora_a's pages hold {page_rows} rows, not {num_slices} slices of {PAGE_RANK}")
    if x.dtype != lora_a.dtype:
        raise ValueError(f"x is {x.dtype} but lora_a is {lora_a.dtype}")
    sr = out.shape[1] if out.dim() == 2 else -1
    if out.dtype != torch.float32 or out.dim() != 2 or out.shape[0] != num_tokens or sr % num_slices:
        raise ValueError(f"out must be [{num_tokens}, S*R] float32 with S={num_slices}, "
                         f"got {list(out.shape)} {out.dtype}")
    num_loras = check_meta(meta, lora_rank, num_tokens)
    check_pages(meta, sr // num_slices)
    cfg = config or shrink_config(num_tokens, hidden, sr)
    if num_tokens == 0:
        return
    grid = shrink_grid(cfg, num_tokens, sr, num_loras)
    # partial: [split_k, T, S*R]; each split writes its own slice (the last one of a tile sums them into out)
    if cfg.split_k == 1:
        partial = out.unsqueeze(0)  # never written: one split writes out directly
    else:
        check_counters(meta.tile_counters, cdiv(num_tokens, cfg.block_m) + min(num_loras, num_tokens),
                       cdiv(sr, cfg.block_n))
        if partials is None:
            partials = torch.empty(cfg.split_k, num_tokens, sr, dtype=torch.float32, device=x.device)
        elif partials.shape != (cfg.split_k, num_tokens, sr) or partials.dtype != torch.float32:
            raise ValueError(f"partials must be [{cfg.split_k}, {num_tokens}, {sr}] float32, "
                             f"got {list(partials.shape)} {partials.dtype}")
        partial = partials
    tile_map = meta.tile_map(cfg.block_m)
    if grid[1] > tile_map.shape[0]:  # each token program loads its first map entry unmasked
        raise ValueError(f"{grid[1]} token programs for a tile map of {tile_map.shape[0]} entries")
    launch = functools.partial(_shrink_launch.call_and_bind, variable=_SHRINK_VARIABLE) if bind else _shrink_launch
    return launch(grid,
        x, lora_a, lora_rank, meta.sorted_token_ids, meta.slot_start, meta.slot_count, meta.slot_adapter,
        tile_map, meta.tile_count(cfg.block_m), meta.page_table, partial, out, meta.tile_counters,
        num_tokens, hidden, num_slices, sr // num_slices, tile_map.shape[0],
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), meta.page_table.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), out.stride(0), out.stride(1),
        meta.tile_counters.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        PRECISION=dot_precision(x.dtype), PAGE=PAGE_RANK, DYNAMIC=cfg.dynamic, PDL=pdl_supported(x),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def effective_split(cfg: ShrinkConfig, grid: tuple[int, int], lora_tiles: int, hidden: int, sr: int
                    ) -> tuple[int, int]:
    """(split-K factor, hidden features per split) that a shrink launch of this shape and grid takes when the
    step has lora_tiles token tiles of adapters: the kernel's shrink_split on the host (tests, tuning)."""
    split = min(cfg.split_k, cdiv(hidden, cfg.block_k))
    if cfg.dynamic and lora_tiles > grid[1]:
        split = min(max(grid[0] * grid[1] // (lora_tiles * cdiv(sr, cfg.block_n)), 1), split)
    k_per_split = cdiv(cdiv(hidden, split), cfg.block_k) * cfg.block_k
    return cdiv(hidden, k_per_split), k_per_split


def check_counters(counters: torch.Tensor, token_tiles: int, row_tiles: int):
    """Raise ValueError unless the tile counters cover a grid of token_tiles x row_tiles output tiles."""
    if counters.dtype != torch.int32 or counters.dim() != 2 or counters.shape[0] < token_tiles \
            or counters.shape[1] < row_tiles:
        raise ValueError(f"meta.tile_counters {list(counters.shape)} {counters.dtype} do not cover "
                         f"{token_tiles} token tiles x {row_tiles} row tiles (int32): the shrink config's "
                         f"token tiles are too small or its row tiles too many")


def shrink_splits(num_tokens: int, hidden: int, sr: int) -> int:
    """How many split-K partial slices the shrink writes for this static shape."""
    return shrink_config(num_tokens, hidden, sr).split_k


def dot_precision(dtype: torch.dtype) -> str:
    """Full fp32 products for fp32 weights; tensor-core inputs otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_meta(meta: LoRAMeta, lora_rank: torch.Tensor, num_tokens: int) -> int:
    """Raise ValueError unless meta and lora_rank fit T tokens; returns L, the step's slots."""
    num_loras = meta.num_loras
    num_ids = meta.page_table.shape[0]
    if lora_rank.shape != (num_ids,) or lora_rank.dtype != torch.int32:
        raise ValueError(f"lora_rank must be [{num_ids}] int32 (one rank per adapter id of the page table), "
                         f"got {list(lora_rank.shape)} {lora_rank.dtype}")
    if meta.slot_start.shape[0] != num_loras + 1 or meta.slot_adapter.shape[0] != num_loras + 1:
        raise ValueError(f"meta's slot vectors disagree: {meta.slot_start.shape[0]} starts, {num_loras} counts, "
                         f"{meta.slot_adapter.shape[0]} adapters")
    if meta.sorted_token_ids.shape[0] < num_tokens:
        raise ValueError(f"meta holds {meta.sorted_token_ids.shape[0]} tokens, "
                         f"fewer than T={num_tokens}")
    return num_loras


def check_pages(meta: LoRAMeta, rank_max: int) -> None:
    """Raise ValueError unless the page table has one column per PAGE_RANK of the intermediate's rank_max
    ranks per slice (R = max_pages * PAGE_RANK)."""
    table = meta.page_table
    if table.dtype != torch.int32 or table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"meta.page_table must be int32 [A, max_pages] with contiguous rows, "
                         f"got {list(table.shape)} {table.dtype}")
    if meta.rank_width != rank_max:
        raise ValueError(f"the intermediate has {rank_max} ranks per slice but the page table's "
                         f"{table.shape[1]} pages of {PAGE_RANK} hold {meta.rank_width}")

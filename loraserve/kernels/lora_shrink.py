"""LoRA shrink: inter[t, s*R + r] = x[t] . A[slot_t, s*R + r] for every slice s of a packed layer.

One launch covers all slices and all slots. Tokens are grouped by slot
(LoRAMeta); the grid is sized by static maxima only: a token-tile axis of
cdiv(T, BLOCK_M) + min(L, T) entries (enough for any split of T tokens over L
slots) and an axis over row tiles of the S*R rows of A times the split-K
factor. Each program maps its token tile to (slot, tile within the slot) with
a prefix sum over the per-slot tile counts; programs past the last tile, and
row tiles that lie wholly beyond their slot's rank, return at once. Rows of A
beyond the rank are masked, so they are neither read nor counted.

Two static shapes: decode (T <= SHRINK_DECODE_MAX_TOKENS) splits K up to 16
ways so that the few tiles of each adapter still spread its A rows over many
programs; prefill uses larger token and row tiles and splits K at most 4 ways.
The split-K programs of one output tile add up their partial sums in the same
launch: each stores its partial to a scratch slice and counts itself on the
tile's counter (LoRAMeta.tile_counters, acquire-release atomic); the last one
loads the other partials, sums all of them in split order (so the result is
bit-identical whichever program comes last, which the start-up graph-vs-eager
check relies on), writes the tile and puts the counter back to 0 for the next
launch (so the kernel replays in a CUDA graph any number of times). The choice
depends on T alone, so one CUDA graph bucket always runs the same kernel.
"""
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraserve.kernels.launch import BoundLaunch, CachedLauncher, cdiv, next_power_of_2, pdl_supported
from loraserve.kernels.lora_meta import COUNTER_ROW_TILES, LoRAMeta

# Token counts up to this use the decode-shaped (split-K) shrink. Measured on an
# H200 with 8 adapters: at T = 128..256 the prefill shape leaves too few programs.
SHRINK_DECODE_MAX_TOKENS = 256


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int  # tokens per tile
    block_n: int  # rows of A (of S*R) per tile
    block_k: int  # hidden features per inner step
    split_k: int  # programs sharing one dot product's K range (partial sums when > 1)
    num_warps: int = 4
    num_stages: int = 3


@functools.lru_cache(maxsize=4096)  # a pure function of ints, called for every launch
def shrink_config(num_tokens: int, hidden: int, sr: int) -> ShrinkConfig:
    """The static kernel shape for T tokens, `hidden` input features and S*R rows.

    Row tiles are widened where S*R would need more than COUNTER_ROW_TILES of them.
    """
    min_block_n = max(16, next_power_of_2(cdiv(sr, COUNTER_ROW_TILES)))
    if num_tokens <= SHRINK_DECODE_MAX_TOKENS:
        return ShrinkConfig(16, min_block_n, 128, max(1, min(16, cdiv(hidden, 256))))
    block_n = max(min_block_n, min(64, next_power_of_2(sr)))
    return ShrinkConfig(64, block_n, 64, max(1, min(4, cdiv(hidden, 1024))),
                        num_warps=8 if block_n >= 64 else 4, num_stages=4)


@triton.jit
def slot_tile(tile, rank_ptr, start_ptr, count_ptr, num_loras,
              LORAS_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Map a flat token-tile index to (slot, tile within slot, rank, count, start).

    slot >= num_loras if the tile is past the last one. The three per-slot
    vectors are read in one go, so this costs a single memory round trip.
    """
    slots = tl.arange(0, LORAS_P2)
    ok = slots < num_loras
    count = tl.load(count_ptr + slots, mask=ok, other=0)  # count: [LORAS_P2]
    rank = tl.load(rank_ptr + slots, mask=ok, other=0)
    start = tl.load(start_ptr + slots, mask=ok, other=0)
    tiles = tl.where(rank > 0, (count + BLOCK_M - 1) // BLOCK_M, 0)
    ends = tl.cumsum(tiles, 0)
    slot = tl.sum((ends <= tile).to(tl.int32), 0)
    mine = slots == slot
    m_tile = tile - tl.sum(tl.where(mine, ends - tiles, 0), 0)
    return (slot, m_tile, tl.sum(tl.where(mine, rank, 0), 0), tl.sum(tl.where(mine, count, 0), 0),
            tl.sum(tl.where(mine, start, 0), 0))


@triton.jit(do_not_specialize=["num_tokens"])  # one compiled kernel serves every batch size
def _shrink_kernel(
    x_ptr, a_ptr, rank_ptr, sorted_ptr, start_ptr, count_ptr, part_ptr, out_ptr, counter_ptr,
    num_tokens, hidden, sr, rank_max, num_loras, k_per_split,
    stride_xt, stride_xk, stride_al, stride_an, stride_ak, stride_ps, stride_pt, stride_pn,
    stride_ot, stride_on, stride_ct,
    LORAS_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, REDUCE: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # the expand launched after this may start its prologue now (it waits before reading out)
        tl.extra.cuda.gdc_launch_dependents()
    n_tile = tl.program_id(0) // SPLIT_K
    split = tl.program_id(0) % SPLIT_K
    slot, m_tile, rank, count, start = slot_tile(tl.program_id(1), rank_ptr, start_ptr, count_ptr,
                                                 num_loras, LORAS_P2, BLOCK_M)
    if slot >= num_loras:
        return
    rows = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of A: [BLOCK_N]
    row_ok = (rows < sr) & (rows % rank_max < rank)
    if tl.max(row_ok.to(tl.int32), 0) == 0:
        return
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = tl.load(sorted_ptr + start + offs_m, mask=offs_m < count, other=0)  # tok: [BLOCK_M]
    tok_ok = (offs_m < count) & (tok >= 0) & (tok < num_tokens)

    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xt
    a_rows = a_ptr + slot.to(tl.int64) * stride_al + rows[None, :] * stride_an
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, k_per_split, BLOCK_K):
        offs_k = split * k_per_split + kk + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        a = tl.load(a_rows + offs_k[:, None] * stride_ak,
                    mask=k_ok[:, None] & row_ok[None, :], other=0.0)  # a: [BLOCK_K, BLOCK_N]
        x = tl.load(x_rows + offs_k[None, :] * stride_xk,
                    mask=tok_ok[:, None] & k_ok[None, :], other=0.0)  # x: [BLOCK_M, BLOCK_K]
        acc += tl.dot(x, a, input_precision=PRECISION)

    mask = tok_ok[:, None] & (rows < sr)[None, :]
    # part: [BLOCK_M, BLOCK_N] pointers into split 0's slice of the partials
    part = part_ptr + tok.to(tl.int64)[:, None] * stride_pt + rows[None, :] * stride_pn
    tl.store(part + split.to(tl.int64) * stride_ps, acc, mask=mask)
    if REDUCE:
        tl.debug_barrier()  # every thread's partial is stored before the release below
        counter = counter_ptr + tl.program_id(1) * stride_ct + n_tile
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:  # the last of the SPLIT_K
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # fixed order, whichever program is last
                # .cg: read from L2, where the other programs' stores landed (never a stale L1 line)
                total += tl.load(part + s * stride_ps, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + tok.to(tl.int64)[:, None] * stride_ot + rows[None, :] * stride_on,
                     total, mask=mask)
            tl.store(counter, 0)


_shrink_launch = CachedLauncher(_shrink_kernel)
_SHRINK_VARIABLE = ("x_ptr", "num_tokens", "stride_xt", "stride_xk")  # what a bound shrink takes per call


def shrink_grid(cfg: ShrinkConfig, num_tokens: int, sr: int, num_loras: int) -> tuple[int, int]:
    """(row tiles x split-K programs, token tiles): static maxima only (the module docstring)."""
    return (cdiv(sr, cfg.block_n) * cfg.split_k, cdiv(num_tokens, cfg.block_m) + min(num_loras, num_tokens))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slot_rank: torch.Tensor,
                meta: LoRAMeta, num_slices: int, out: torch.Tensor,
                config: ShrinkConfig | None = None, partials: torch.Tensor | None = None,
                bind: bool = False) -> BoundLaunch | None:
    """out: [T, S*R] float32 <- x: [T, in] times each token's slot's A: [L, S*R, in].

    A split-K shrink sums its partials in the same launch (meta.tile_counters).

    Defined on return: out[t, s*R + r] for every token t with a slot and
    r < slot_rank[slot] (what lora_expand reads). Other elements are
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
    num_loras, sr, a_hidden = lora_a.shape
    if a_hidden != hidden:
        raise ValueError(f"x has {hidden} features but lora_a expects {a_hidden}")
    if num_slices < 1 or sr % num_slices:
        raise ValueError(f"lora_a's {sr} rows do not split into {num_slices} slices")
    if x.dtype != lora_a.dtype:
        raise ValueError(f"x is {x.dtype} but lora_a is {lora_a.dtype}")
    cfg = config or shrink_config(num_tokens, hidden, sr)
    if out.dtype != torch.float32 or out.shape != (num_tokens, sr):
        raise ValueError(f"out must be [{num_tokens}, {sr}] float32, got {list(out.shape)} {out.dtype}")
    check_meta(meta, slot_rank, num_tokens, num_loras)
    if num_tokens == 0:
        return
    grid = shrink_grid(cfg, num_tokens, sr, num_loras)
    reduce = cfg.split_k > 1
    # partial: [split_k, T, S*R]; each split writes its own slice (the last one of a tile sums them into out)
    if not reduce:
        partial = out.unsqueeze(0)
    else:
        check_counters(meta.tile_counters, grid[1], grid[0] // cfg.split_k)
        if partials is None:
            partials = torch.empty(cfg.split_k, num_tokens, sr, dtype=torch.float32, device=x.device)
        elif partials.shape != (cfg.split_k, num_tokens, sr) or partials.dtype != torch.float32:
            raise ValueError(f"partials must be [{cfg.split_k}, {num_tokens}, {sr}] float32, "
                             f"got {list(partials.shape)} {partials.dtype}")
        partial = partials
    k_per_split = cdiv(cdiv(hidden, cfg.split_k), cfg.block_k) * cfg.block_k
    launch = functools.partial(_shrink_launch.call_and_bind, variable=_SHRINK_VARIABLE) if bind else _shrink_launch
    return launch(grid,
        x, lora_a, slot_rank, meta.sorted_token_ids, meta.slot_start, meta.slot_count, partial, out,
        meta.tile_counters,
        num_tokens, hidden, sr, sr // num_slices, num_loras, k_per_split,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        partial.stride(0), partial.stride(1), partial.stride(2), out.stride(0), out.stride(1),
        meta.tile_counters.stride(0),
        LORAS_P2=loras_p2(num_loras), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, REDUCE=reduce, PRECISION=dot_precision(x.dtype),
        PDL=pdl_supported(x), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


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


def loras_p2(num_loras: int) -> int:
    """Width of the in-kernel slot vector: one compiled kernel serves every L <= 16."""
    return max(16, next_power_of_2(num_loras))


def dot_precision(dtype: torch.dtype) -> str:
    """Full fp32 products for fp32 weights; tensor-core inputs otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_meta(meta: LoRAMeta, slot_rank: torch.Tensor, num_tokens: int, num_loras: int):
    """Raise ValueError unless meta and slot_rank fit T tokens and L slots."""
    if slot_rank.shape != (num_loras,) or slot_rank.dtype != torch.int32:
        raise ValueError(f"slot_rank must be [{num_loras}] int32, "
                         f"got {list(slot_rank.shape)} {slot_rank.dtype}")
    if meta.slot_start.shape[0] != num_loras or meta.slot_count.shape[0] != num_loras:
        raise ValueError(f"meta is built for {meta.slot_count.shape[0]} slots, "
                         f"the weights have {num_loras}")
    if meta.sorted_token_ids.shape[0] < num_tokens:
        raise ValueError(f"meta holds {meta.sorted_token_ids.shape[0]} tokens, "
                         f"fewer than T={num_tokens}")

"""LoRA shrink/expand kernels (fp32, small sizes) against the torch reference.

On a machine without CUDA the kernels run in Triton's interpreter on CPU
tensors (tests/conftest.py sets TRITON_INTERPRET); with CUDA, on the GPU.

The adapters' weights sit in a paged pool with their pages scattered among
spare ones and adapter ids that differ from their slots. Weights beyond each
adapter's rank, spare pages and the pages that unused page-table entries point
to are NaN, so a kernel that reads them fails; the shrink output is poisoned with NaN and every
element that lora_expand reads is checked; the expand output is random and
every element is checked (rows without an adapter bit for bit). The reference
itself is checked against a per-token float64 loop. The split-K shrink's
in-launch sum is checked bit for bit against its partials added in split
order, across repeated launches that reuse the tile counters (back to zero
after every launch).
"""
import math

import numpy as np
import pytest
import torch

from loraserve.kernels.launch import cdiv
from loraserve.kernels.fused import silu_and_mul
from loraserve.kernels.fused_reference import silu_and_mul_ref
from loraserve.kernels.lora_expand import ExpandConfig, LoRAFactors, expand_config, lora_expand
from loraserve.kernels.lora_meta import COUNTER_ROW_TILES, PAGE_RANK, TILE_BLOCKS
from loraserve.kernels.lora_ops import lora_apply, lora_apply_ref
from loraserve.kernels.lora_reference import lora_expand_ref, lora_shrink_ref
from loraserve.kernels.lora_shrink import (LOOSE_TILES, ShrinkConfig, effective_split, lora_shrink, shrink_config,
                                           shrink_grid)
from loraserve.lora.metadata import LoRAMetaBuilder
from loraserve.lora.side_stream import LoRAScratch, lora_delta

POPULARITY = ("distinct", "uniform", "skewed", "identical")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assign_slots(kind, num_tokens, adapter_slots, base_fraction, gen):
    """Per-token slots: [T] int, adapters drawn by popularity kind, some tokens -1."""
    n = len(adapter_slots)
    if kind == "distinct":
        pick = np.arange(num_tokens) % n
    elif kind == "uniform":
        pick = gen.integers(0, n, num_tokens)
    elif kind == "skewed":
        p = 1.0 / (np.arange(n) + 1.0) ** 2
        pick = gen.choice(n, num_tokens, p=p / p.sum())
    elif kind == "identical":
        pick = np.zeros(num_tokens, dtype=np.int64)
    else:
        raise ValueError(kind)
    slots = np.asarray(adapter_slots, dtype=np.int64)[pick]
    slots[gen.random(num_tokens) < base_fraction] = -1
    return slots


def make_weights(num_loras, slice_sizes, rank_max, hidden, ranks, dtype, device, gen):
    """Adapters 0..L-1 with ranks[l] (NaN beyond it) in a paged pool. Returns a dict:
    a: [P, S*PAGE_RANK, in], b: [P, PAGE_RANK, N] the pool, with spare NaN pages; rank: [A] int32 per id;
    table: [A, max_pages] int32 (unused entries point to a NaN page); ids: [L] adapter l's id (A = L + 2);
    dense_a: [L, S*R, in], dense_b: [L, N, R] the same weights unpaged (for per-token loops)."""
    num_slices, n_out = len(slice_sizes), sum(slice_sizes)
    a = torch.randn(num_loras, num_slices, rank_max, hidden, generator=gen) / math.sqrt(hidden)
    b = torch.randn(num_loras, n_out, rank_max, generator=gen) / math.sqrt(rank_max)
    for slot, rank in enumerate(ranks):
        a[slot, :, rank:] = float("nan")
        b[slot, :, rank:] = float("nan")
    need = [cdiv(r, PAGE_RANK) for r in ranks]
    num_pages = sum(need) + 3
    free = torch.randperm(num_pages, generator=gen).tolist()
    nan_page = free.pop()
    num_ids = num_loras + 2
    ids = torch.randperm(num_ids, generator=gen)[:num_loras].tolist()
    a_pool = torch.full((num_pages, num_slices * PAGE_RANK, hidden), float("nan"))
    b_pool = torch.full((num_pages, PAGE_RANK, n_out), float("nan"))
    table = torch.full((num_ids, cdiv(rank_max, PAGE_RANK)), nan_page, dtype=torch.int32)
    rank = torch.zeros(num_ids, dtype=torch.int32)
    for slot, r in enumerate(ranks):
        rank[ids[slot]] = r
        for p in range(need[slot]):
            page = free.pop()
            table[ids[slot], p] = page
            rows = range(p * PAGE_RANK, min((p + 1) * PAGE_RANK, rank_max))
            for s in range(num_slices):
                a_pool[page, s * PAGE_RANK:s * PAGE_RANK + len(rows)] = a[slot, s, rows.start:rows.stop]
            b_pool[page, :len(rows)] = b[slot, :, rows.start:rows.stop].T
    return dict(a=a_pool.to(device, dtype), b=b_pool.to(device, dtype), rank=rank.to(device),
                table=table.to(device), ids=ids,
                dense_a=a.view(num_loras, num_slices * rank_max, hidden), dense_b=b)


def offsets_of(slice_sizes):
    return tuple(int(v) for v in np.concatenate([[0], np.cumsum(slice_sizes)]))


def meta_of(pool, slots, builder):
    """Build the step's metadata for tokens of adapters `slots` ([T] adapter indices, -1 = none)."""
    ids = np.asarray(pool["ids"] + [-1], dtype=np.int64)[np.asarray(slots, dtype=np.int64)]
    return builder.build(ids)


def make_case(seed, hidden, slice_sizes, rank_max, num_loras, num_tokens, kind, base_fraction,
              dtype=torch.float32, device=DEVICE, max_tokens=None, rank_cap=None):
    """Random weights, ranks (one adapter may have rank 0; none above rank_cap, in a pool rank_max wide),
    inputs and metadata for one test case. "slots" are adapter indices 0..L-1 here (the builder gives them
    slots of its own)."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    top = rank_max if rank_cap is None else rank_cap
    ranks = [int(r) for r in rng.integers(1, top + 1, num_loras)]
    ranks[0] = top
    if num_loras > 2:
        ranks[-1] = 0
    pool = make_weights(num_loras, slice_sizes, rank_max, hidden, ranks, dtype, device, gen)
    adapters = rng.permutation(num_loras)  # may include the rank-0 adapter
    slots = assign_slots(kind, num_tokens, adapters, base_fraction, rng)
    builder = LoRAMetaBuilder(max_tokens or num_tokens + 3, num_loras, pool["table"])
    meta = meta_of(pool, slots, builder)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    return dict(a=pool["a"], b=pool["b"], slot_rank=pool["rank"], ranks=ranks, slots=slots, meta=meta, x=x,
                offsets=offsets_of(slice_sizes), num_slices=len(slice_sizes), gen=gen, pool=pool,
                builder=builder)


def poisoned_inter(case, rank_max):
    """inter: [T, S*R] random where a kernel may read it, NaN everywhere else."""
    t, s = len(case["slots"]), case["num_slices"]
    inter = torch.full((t, s, rank_max), float("nan"))
    for i, slot in enumerate(case["slots"]):
        if slot >= 0:
            r = case["ranks"][slot]
            inter[i, :, :r] = torch.randn(s, r, generator=case["gen"])
    return inter.view(t, s * rank_max).to(case["x"].device)


def check_shrink_result(case, out, ref, rank_max, rtol=1e-5, atol=1e-5):
    """Every element lora_expand reads (a slot's token, r < rank) matches the reference."""
    t, s = len(case["slots"]), case["num_slices"]
    defined = torch.zeros(t, s, rank_max, dtype=torch.bool)
    for i, slot in enumerate(case["slots"]):
        if slot >= 0:
            defined[i, :, :case["ranks"][slot]] = True
    defined = defined.view(t, s * rank_max).to(out.device)
    torch.testing.assert_close(out[defined], ref[defined], rtol=rtol, atol=atol)
    assert not ref[~defined].any()


def check_expand_result(case, y_before, y_kernel, y_ref, rtol=1e-5, atol=1e-5):
    """Rows without an adapter are bit-identical; every element matches the reference.

    The product is rounded to y's dtype before it is added, so a product computed in another order
    can round to a neighbouring value: the tolerance is relative to |y| + |product|, not to |y| alone
    (where y and the product cancel, one rounding step of the product is large against the sum).
    """
    untouched = torch.tensor([s < 0 or case["ranks"][s] == 0 for s in case["slots"]])
    untouched = untouched.to(y_kernel.device, torch.bool)
    assert torch.equal(y_kernel[untouched], y_before[untouched])
    got, want, before = y_kernel.float(), y_ref.float(), y_before.float()
    tol = atol + rtol * (want.abs() + (want - before).abs())  # [T, N]
    bad = (got - want).abs() > tol
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements differ; "
                           f"worst {(got - want).abs().max().item():.3g}")


SPLIT_SHRINK = ShrinkConfig(16, 16, 32, 3)
NARROW_EXPAND = ExpandConfig(16, 16, 16, col_tiles=3)
WIDE_DECODE_EXPAND = ExpandConfig(16, 128, 16, num_warps=4, col_tiles=4)  # several column tiles per program
# the decode shapes spread a step's work at run time (dynamic): small versions of them
DYNAMIC_SHRINK = ShrinkConfig(16, 16, 32, 3, dynamic=True)
TILE_PROGRAMS_SHRINK = ShrinkConfig(32, 32, 32, 1, num_warps=4, num_stages=2, tile_programs=True)
WIDE_SHRINK = ShrinkConfig(16, 64, 32, 1, tile_programs=True)  # row tiles of 64: dots of 16, 32 or 64 rows
WIDE_SPLIT_SHRINK = ShrinkConfig(16, 64, 32, 2, dynamic=True)
DYNAMIC_EXPAND = ExpandConfig(16, 16, 16, col_tiles=3, dynamic=True)
SCALED_EXPAND = ExpandConfig(16, 32, 16, col_tiles=2, dynamic=True, program_scale=4)  # more token programs
# the pages of an item's first BLOCK_R ranks loaded once for its column tiles
HOISTED_EXPAND = ExpandConfig(16, 16, 16, col_tiles=3, dynamic=True, hoist_pages=True)
HOISTED_PREFILL_EXPAND = ExpandConfig(16, 16, 16, col_tiles=3, hoist_pages=True)
# an item's pages and factors loaded once, its column tiles pipelined: in place and writing a delta (dynamic)
PIPELINED_EXPAND = ExpandConfig(16, 16, 16, col_tiles=3, col_stages=2)
PIPELINED_DYNAMIC_EXPAND = ExpandConfig(16, 16, 16, col_tiles=3, dynamic=True, col_stages=3)
PREFILL = "prefill"  # the prefill-shaped config, used at small T
CASES = [
    # hidden, slice sizes, R, L, T, popularity, base fraction, shrink config, expand config
    (64, (64,), 16, 1, 1, "identical", 0.0, None, None),
    (72, (40, 16, 16), 16, 3, 20, "uniform", 0.25, None, None),
    (100, (100, 36), 12, 4, 40, "distinct", 0.1, SPLIT_SHRINK, NARROW_EXPAND),
    (64, (24, 20, 20), 8, 2, 17, "skewed", 0.3, PREFILL, PREFILL),
    (100, (72,), 16, 4, 33, "uniform", 0.5, SPLIT_SHRINK, None),
    (72, (40, 16, 16), 16, 3, 9, "uniform", 1.0, None, None),
    (64, (64, 64, 32), 16, 4, 40, "skewed", 0.0, PREFILL, NARROW_EXPAND),
    (72, (100,), 4, 2, 5, "distinct", 0.0, SPLIT_SHRINK, PREFILL),
    (64, (30, 34), 5, 4, 26, "identical", 0.2, None, NARROW_EXPAND),
    (300, (48, 24, 24), 40, 3, 12, "uniform", 0.1, None, NARROW_EXPAND),  # 3 rank steps; K split 2 ways
    (64, (200, 56), 24, 3, 21, "skewed", 0.1, SPLIT_SHRINK, WIDE_DECODE_EXPAND),
    # more adapters than LOOSE_TILES: the token-axis programs take several tiles each
    (64, (48, 16), 16, 24, 40, "distinct", 0.1, None, None),
    (72, (40,), 8, 20, 100, "uniform", 0.2, PREFILL, PREFILL),
    # a step of many adapters of a few tokens each: the expand gives each program a longer run of
    # column tiles (and past that, programs take several items in turn); the shrink splits K less
    (64, (200,), 8, 30, 40, "distinct", 0.1, DYNAMIC_SHRINK, DYNAMIC_EXPAND),
    (200, (120, 40, 40), 24, 100, 100, "distinct", 0.2, None, DYNAMIC_EXPAND),
    (200, (120, 40, 40), 24, 6, 100, "skewed", 0.2, DYNAMIC_SHRINK, DYNAMIC_EXPAND),  # few: the grid's own items
    # token programs x 4 (up to one per tile a step can have): shorter runs of columns, or one tile each
    (64, (200,), 8, 30, 40, "distinct", 0.1, DYNAMIC_SHRINK, SCALED_EXPAND),
    (200, (120, 40, 40), 24, 100, 100, "uniform", 0.2, None, SCALED_EXPAND),
    (72, (40, 16, 16), 16, 3, 20, "skewed", 0.25, None, SCALED_EXPAND),
    # hoisted pages: ranks within BLOCK_R, past it (40: 3 rank steps, the first from the hoisted pages) and
    # mixed (skewed popularity over ranks drawn up to R)
    (64, (200,), 8, 30, 40, "distinct", 0.1, DYNAMIC_SHRINK, HOISTED_EXPAND),
    (300, (48, 24, 24), 40, 3, 12, "uniform", 0.1, None, HOISTED_PREFILL_EXPAND),
    (200, (120, 40, 40), 24, 6, 100, "skewed", 0.2, DYNAMIC_SHRINK, HOISTED_EXPAND),
    # pipelined column tiles: 1-3 slices, tiles straddling slice boundaries, ranks past 16 (one dot over 32 or 64)
    (72, (40, 16, 16), 16, 3, 20, "skewed", 0.25, None, PIPELINED_EXPAND),
    (300, (48, 24, 24), 40, 3, 12, "uniform", 0.1, None, PIPELINED_EXPAND),
    (100, (100, 36), 12, 4, 40, "distinct", 0.1, SPLIT_SHRINK, PIPELINED_EXPAND),
    (64, (200,), 8, 30, 40, "distinct", 0.1, DYNAMIC_SHRINK, PIPELINED_DYNAMIC_EXPAND),
    (200, (120, 40, 40), 24, 6, 100, "skewed", 0.2, DYNAMIC_SHRINK, PIPELINED_DYNAMIC_EXPAND),
    (64, (40, 16, 16), 72, 3, 20, "uniform", 0.1, None, PIPELINED_EXPAND),  # wider than MAX_PIPELINED_RANK
    # slice boundaries on column tiles (the engine's layers): one dot per tile with its slice's factors
    (72, (48, 16, 16), 16, 3, 20, "skewed", 0.25, None, PIPELINED_EXPAND),
    (100, (96, 96), 12, 4, 40, "distinct", 0.1, SPLIT_SHRINK, PIPELINED_EXPAND),
    (200, (128, 32, 32), 24, 6, 100, "skewed", 0.2, DYNAMIC_SHRINK, PIPELINED_DYNAMIC_EXPAND),
    (64, (32, 16, 16), 40, 3, 12, "uniform", 0.1, None, PIPELINED_EXPAND),  # ranks past 16: one dot over 64
    # a program per tile the step can have: more adapters' tiles than the fixed grid's programs
    (64, (48, 16), 16, 24, 40, "distinct", 0.1, TILE_PROGRAMS_SHRINK, None),
    # row tiles wider than an adapter's rows (S * rank): a dot as wide as the rows it has there, 16 or 32
    (64, (48, 16, 16), 24, 6, 40, "uniform", 0.1, WIDE_SHRINK, None),
    (96, (40, 24), 40, 5, 30, "distinct", 0.1, WIDE_SPLIT_SHRINK, None),
]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_kernels_match_reference(index):
    hidden, sizes, rank_max, num_loras, t, kind, base, s_cfg, e_cfg = CASES[index]
    case = make_case(100 + index, hidden, sizes, rank_max, num_loras, t, kind, base)
    rank_max = case["meta"].rank_width  # the intermediate's rank width: whole pages
    if s_cfg == PREFILL:
        s_cfg = shrink_config(4096, hidden, len(sizes) * rank_max)
    if e_cfg == PREFILL:
        e_cfg = expand_config(4096)

    out = torch.full((t, len(sizes) * rank_max), float("nan"), device=DEVICE)
    lora_shrink(case["x"], case["a"], case["slot_rank"], case["meta"], case["num_slices"], out,
                s_cfg)
    ref = lora_shrink_ref(case["x"], case["a"], case["slot_rank"], case["meta"], case["num_slices"])
    check_shrink_result(case, out, ref, rank_max)

    inter = poisoned_inter(case, rank_max)
    wide = torch.randn(t, sum(sizes) + 9, generator=case["gen"]).to(DEVICE)
    before = wide.clone()
    y = wide[:, 4:4 + sum(sizes)]  # a column range of a wider output
    lora_expand(inter, case["b"], case["slot_rank"], case["meta"], case["offsets"], y, e_cfg)
    y_ref = before[:, 4:4 + sum(sizes)].clone()
    lora_expand_ref(inter, case["b"], case["slot_rank"], case["meta"], case["offsets"], y_ref)
    check_expand_result(case, before[:, 4:4 + sum(sizes)], y, y_ref)
    assert torch.equal(wide[:, :4], before[:, :4]) and torch.equal(wide[:, -5:], before[:, -5:])


def test_long_prefill_shrink_gives_every_tile_a_program():
    """From PREFILL_UNSPLIT_TOKENS the shrink does not split K and its grid has a token program for every tile
    a step can have (one per BLOCK_M tokens, and a partial tile per slot), so no tile waits for another."""
    for num_tokens, block_m in ((8192, 64), (4096, 64), (2048, 32)):
        cfg = shrink_config(num_tokens, 4096, 48)
        assert (cfg.block_m, cfg.split_k, cfg.tile_programs) == (block_m, 1, True)
        assert shrink_grid(cfg, num_tokens, 48, 256) == (1, num_tokens // block_m + 256)
    shorter = shrink_config(1024, 4096, 48)
    assert shorter.split_k == 4 and not shorter.tile_programs
    assert shrink_grid(shorter, 1024, 48, 256)[1] == 1024 // 64 + LOOSE_TILES


def check_silu_and_mul_factors(seed, inter_size, rank_max, num_loras, num_tokens, kind, base, dtype=torch.float32,
                               device=DEVICE, rtol=1e-5, atol=1e-5, rank_cap=None):
    """silu_and_mul with gate/up's LoRA product as factors equals the product expanded into gate/up
    (the reference expand, rounded to gate/up's dtype) followed by the reference silu_and_mul. rank_cap: the
    adapters' ranks at most this, in factors rank_max wide, and the factors told so (LoRAFactors.max_rank)."""
    case = make_case(seed, 16, (inter_size, inter_size), rank_max, num_loras, num_tokens, kind, base,
                     dtype=dtype, device=device, rank_cap=rank_cap)
    inter = poisoned_inter(case, case["meta"].rank_width)
    gate_up = torch.randn(num_tokens, 2 * inter_size + 6, generator=case["gen"]).to(device, dtype)[:, 3:-3]
    merged = gate_up.clone()
    lora_expand_ref(inter, case["b"], case["slot_rank"], case["meta"], case["offsets"], merged)
    want = silu_and_mul_ref(merged).float()
    factors = LoRAFactors(inter, case["b"], case["slot_rank"], case["meta"], case["offsets"], rank_cap)
    got = silu_and_mul(gate_up, factors).float()
    # a product summed in another order may round to a neighbouring value of gate/up's dtype
    bad = (got - want).abs() > atol + rtol * (want.abs() + (merged.float() - gate_up.float()).abs().amax(1, True))
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} differ; worst {(got - want).abs().max().item():.3g}"
    plain = silu_and_mul(gate_up).float()  # rows without a product: bit for bit the plain kernel
    untouched = torch.tensor([s < 0 or case["ranks"][s] == 0 for s in case["slots"]], device=device)
    assert torch.equal(got[untouched], plain[untouched])


@pytest.mark.parametrize("inter_size,rank_max,num_loras,num_tokens,kind,base", [
    (40, 16, 3, 70, "skewed", 0.2),  # tiles of one adapter and tiles of several
    (130, 24, 4, 33, "distinct", 0.1),  # every row its own adapter; ranks past one BLOCK_R step
    (16, 8, 2, 5, "uniform", 1.0),  # no adapter at all
    (300, 16, 12, 60, "distinct", 0.1),  # more adapters' tiles than cdiv(T, 16) + LOOSE_TILES; 5 column tiles
    (48, 72, 3, 30, "skewed", 0.2),  # factors wider than MAX_PIPELINED_RANK: rank steps in each column tile
    (70, 64, 6, 40, "distinct", 0.1),  # ranks 1-64 in factors 64 wide: dots 16, 32 and 64 ranks wide
])
def test_silu_and_mul_expands_lora_factors(inter_size, rank_max, num_loras, num_tokens, kind, base):
    check_silu_and_mul_factors(11, inter_size, rank_max, num_loras, num_tokens, kind, base)


@pytest.mark.parametrize("rank_max,rank_cap", [(64, 16), (64, 30), (72, 24)])
def test_silu_and_mul_takes_dots_as_wide_as_the_steps_largest_rank(rank_max, rank_cap):
    """Factors wider than every adapter's rank, and told so: the dot covers the ranks the adapters have (a
    16-wide one; 16 or 32 wide; the pipelined path where the pool's width alone would take rank steps)."""
    check_silu_and_mul_factors(12, 70, rank_max, 6, 40, "distinct", 0.1, rank_cap=rank_cap)


def naive_lora(x, a, b, ranks, slots, offsets):
    """Per-token float64 loop: delta[t] = sum over slices of B_s[:, :r] A_s[:r] x[t]."""
    rank_max = b.shape[2]
    delta = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        r = ranks[slot]
        for s in range(len(offsets) - 1):
            lo, hi = offsets[s], offsets[s + 1]
            h = a[slot, s * rank_max:s * rank_max + r].double() @ x[t].double()
            delta[t, lo:hi] = b[slot, lo:hi, :r].double() @ h
    return delta


@pytest.mark.parametrize("kind,hidden", [(kind, 72) for kind in POPULARITY] + [("skewed", 600)])
def test_lora_apply_and_reference(kind, hidden, monkeypatch):
    """hidden 600 splits the shrink's K three ways (the shrink adds its partials in the launch)."""
    case = make_case(7, hidden, (40, 16, 16), 16, 4, 24, kind, 0.2, max_tokens=64)
    y0 = torch.randn(24, 72, generator=case["gen"]).to(DEVICE)
    args = (case["a"], case["b"], case["slot_rank"], case["meta"], case["offsets"])
    a_clean = torch.nan_to_num(case["pool"]["dense_a"])
    b_clean = torch.nan_to_num(case["pool"]["dense_b"])
    expected = y0.cpu().double() + naive_lora(case["x"].cpu(), a_clean, b_clean, case["ranks"],
                                              case["slots"], case["offsets"])

    y_ref = y0.clone()
    lora_apply_ref(case["x"], y_ref, *args)
    torch.testing.assert_close(y_ref.cpu().double(), expected, rtol=1e-5, atol=1e-5)

    y_kernel = y0.clone()
    lora_apply(case["x"], y_kernel, *args)
    check_expand_result(case, y0, y_kernel, y_ref)

    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # the engine's CPU path: the reference
        y_cpu = y0.clone()
        lora_apply(case["x"], y_cpu, *args)
        assert torch.equal(y_cpu, y_ref)


@pytest.mark.parametrize("config", [None, SCALED_EXPAND, HOISTED_EXPAND, PIPELINED_DYNAMIC_EXPAND])
@pytest.mark.parametrize("num_tokens,num_loras", [(1, 4), (24, 4), (70, 4), (90, 60)])
def test_lora_apply_into_a_float32_delta_writes_every_row(num_tokens, num_loras, config):
    """overwrite=True: a float32 y poisoned with NaN ends as exactly the LoRA product, zeros on base rows
    and on rows of a slot whose adapter has rank 0 in this layer (decode and prefill expand shapes, and a
    step of more adapters' tiles than the grid has programs; and with more token programs)."""
    case = make_case(8, 72, (40, 16, 16), 16, num_loras, num_tokens, "uniform", 0.3, max_tokens=100)
    slot_rank = case["slot_rank"].clone()
    off = int(np.max(case["slots"]))
    slot_rank[case["pool"]["ids"][off]] = 0  # an adapter that does not target this layer
    args = (case["a"], case["b"], slot_rank, case["meta"], case["offsets"])
    delta = torch.full((num_tokens, 72), float("nan"), device=DEVICE)
    inter = torch.empty(num_tokens, 3 * 16, device=DEVICE)
    lora_shrink(case["x"], case["a"], slot_rank, case["meta"], 3, inter)
    lora_expand(inter, case["b"], slot_rank, case["meta"], case["offsets"], delta, config, overwrite=True,
                after_shrink=True)
    want = torch.zeros(num_tokens, 72, device=DEVICE)
    lora_apply_ref(case["x"], want, *args)
    torch.testing.assert_close(delta, want, rtol=1e-5, atol=1e-5)
    zero_rows = [i for i, s in enumerate(np.asarray(case["slots"]).tolist()) if s < 0 or s == off
                 or case["ranks"][s] == 0]
    assert torch.equal(delta[zero_rows], torch.zeros_like(delta[zero_rows]))


@pytest.mark.parametrize("num_tokens,config", [(24, None), (90, None), (280, None), (24, NARROW_EXPAND),
                                               (90, DYNAMIC_EXPAND)])
def test_a_page_block_no_adapter_of_the_step_targets_is_skipped(num_tokens, config):
    """A meta whose page block no adapter of the step has weights in (block_targets) gets no adapters' tiles: the
    shrink and an in-place expand leave their outputs as they were, an overwriting expand writes zeros on every
    row of a NaN-poisoned delta (the fast path: it must skip even adapters the layer gives ranks); the other
    block's meta, on the same step, still gives the reference (decode, dynamic and prefill expand shapes)."""
    case = make_case(9, 72, (40, 16, 16), 16, 5, num_tokens, "uniform", 0.3, max_tokens=300)
    pool = case["pool"]
    targets = np.zeros((len(pool["rank"]), 2), dtype=bool)
    targets[:, 0] = True  # every adapter has weights in block 0, none in block 1
    builder = LoRAMetaBuilder(300, 5, (pool["table"], pool["table"]), targets)
    on, off = (meta_of(pool, case["slots"], builder), builder.metas[1])
    assert on is builder.metas[0] and int(off.tile_count(16)[0]) == 0 < int(on.tile_count(16)[0])
    assert torch.equal(off.tile_count(16)[1], on.tile_count(16)[1])  # the same tiles in all
    poison = torch.full((num_tokens, 3 * 16), float("nan"), device=DEVICE)
    inter = poison.clone()
    lora_shrink(case["x"], case["a"], case["slot_rank"], off, 3, inter)
    assert torch.equal(inter.isnan(), poison.isnan())  # nothing written
    delta = torch.full((num_tokens, 72), float("nan"), device=DEVICE)
    lora_expand(inter, case["b"], case["slot_rank"], off, case["offsets"], delta, config, overwrite=True)
    assert torch.equal(delta, torch.zeros_like(delta))
    y = torch.randn(num_tokens, 72, generator=case["gen"]).to(DEVICE)
    y_before = y.clone()
    lora_expand(inter, case["b"], case["slot_rank"], off, case["offsets"], y, config)
    assert torch.equal(y, y_before)
    lora_shrink(case["x"], case["a"], case["slot_rank"], on, 3, inter)
    lora_expand(inter, case["b"], case["slot_rank"], on, case["offsets"], delta, config, overwrite=True)
    want = torch.zeros(num_tokens, 72, device=DEVICE)
    lora_apply_ref(case["x"], want, case["a"], case["b"], case["slot_rank"], on, case["offsets"])
    torch.testing.assert_close(delta, want, rtol=1e-5, atol=1e-5)


def defined_mask(case, rank_max):
    """[T, S*R] bool: the shrink outputs lora_expand reads (a slot's token, r < rank)."""
    t, s = len(case["slots"]), case["num_slices"]
    defined = torch.zeros(t, s, rank_max, dtype=torch.bool)
    for i, slot in enumerate(case["slots"]):
        if slot >= 0:
            defined[i, :, :case["ranks"][slot]] = True
    return defined.view(t, s * rank_max).to(case["x"].device)


def shrink_partials(x, a, slot_rank, meta, num_slices, cfg: ShrinkConfig) -> torch.Tensor:
    """[P, T, S*R]: what each of a split-K shrink's P programs computes over its own K range, by the same
    kernel (same tiles, one split) launched on that range of x and A alone: bit for bit the partial. P is
    the split the launch takes for this step's tiles (effective_split)."""
    num_tokens, hidden = x.shape
    sr = num_slices * meta.rank_width
    grid = shrink_grid(cfg, num_tokens, sr, meta.num_loras)
    lora_tiles = int(meta.tile_count(cfg.block_m)[0])
    split, k_per_split = effective_split(cfg, grid, lora_tiles, hidden, sr)
    one_split = ShrinkConfig(cfg.block_m, cfg.block_n, cfg.block_k, 1, cfg.num_warps, cfg.num_stages)
    parts = torch.full((split, num_tokens, sr), float("nan"), device=x.device)
    for p in range(split):
        k = slice(p * k_per_split, min((p + 1) * k_per_split, hidden))
        lora_shrink(x[:, k], a[:, :, k], slot_rank, meta, num_slices, parts[p], one_split)
    return parts


@pytest.mark.parametrize("num_tokens,hidden,num_loras,kind,want_split", [
    (24, 600, 4, "uniform", 3),  # few adapters: the static split (decode shape)
    (300, 1030, 4, "uniform", 2),  # the prefill shape
    (40, 1030, 20, "distinct", 3),  # 18 adapters' tiles on the programs of 8: K split less
    (40, 1030, 40, "distinct", 2),
    (100, 1030, 100, "distinct", 1),  # more items than programs even unsplit: programs take several in turn
])
def test_split_k_shrink_sums_its_partials_in_split_order(num_tokens, hidden, num_loras, kind, want_split):
    """The in-launch sum equals the [P, T, S*R] partials added in split order, bit for bit,
    launch after launch (the counters go back to zero each time); the split is the one the step's tiles
    leave room for."""
    case = make_case(11, hidden, (40, 16, 16), 16, num_loras, num_tokens, kind, 0.2, max_tokens=320)
    sr = 3 * 16
    cfg = shrink_config(num_tokens, hidden, sr)
    assert cfg.split_k > 1  # decode (T=24, 40) and prefill (T=300) shapes both split K here
    meta, counters = case["meta"], case["meta"].tile_counters
    args = (case["x"], case["a"], case["slot_rank"], meta, 3)
    parts = shrink_partials(*args, cfg)
    assert parts.shape[0] == want_split
    defined = defined_mask(case, 16)
    expected = torch.zeros(num_tokens, sr, device=DEVICE)
    for p in parts:  # split 0, 1, ... in turn
        expected = expected + torch.where(defined, p, 0.0)

    first = None
    for _ in range(2):
        out = torch.full((num_tokens, sr), float("nan"), device=DEVICE)
        lora_shrink(*args, out)
        assert not counters.any()
        assert torch.equal(out[defined], expected[defined])
        first = out if first is None else first
        assert torch.equal(out[defined], first[defined])
    ref = lora_shrink_ref(case["x"], case["a"], case["slot_rank"], meta, 3)
    check_shrink_result(case, first, ref, 16)


def test_effective_split_spreads_the_work_items_over_the_grid():
    """The split a launch of a dynamic shape takes: the static one while every item has a program, less as
    the step's tiles grow, never an empty split, never below 1; a shape that is not dynamic keeps its split."""
    assert effective_split(ShrinkConfig(16, 16, 128, 16), (48, 10), 200, 4096, 48) == (16, 256)
    cfg = ShrinkConfig(16, 16, 128, 16, dynamic=True)
    grid = (3 * 16, 2 + 8)  # 3 row tiles x 16 splits, 10 token-tile programs: 480 programs
    assert effective_split(cfg, grid, 8, 4096, 48) == (16, 256)
    assert effective_split(cfg, grid, 20, 4096, 48) == (8, 512)  # 480 // 60
    assert effective_split(cfg, grid, 30, 4096, 48) == (5, 896)  # 480 // 90 = 5: splits of 7 K steps
    assert effective_split(cfg, grid, 200, 4096, 48) == (1, 4096)
    assert effective_split(cfg, grid, 0, 4096, 48) == (16, 256)
    assert effective_split(cfg, grid, 8, 600, 48) == (5, 128)  # 5 K steps: at most 5 splits
    assert effective_split(cfg, grid, 40, 600, 48) == (3, 256)  # room for 4, but 4 splits of 2 steps leave one empty


def test_lora_apply_reuses_the_counters_across_sizes():
    """Launches of different T (decode and prefill shapes, K split 5 and 2 ways) on one builder
    leave the counters at zero and each matches the reference."""
    rng = np.random.default_rng(4)
    gen = torch.Generator().manual_seed(4)
    pool = make_weights(4, (40, 32), 16, 1030, [16, 5, 0, 8], torch.float32, DEVICE, gen)
    a, b, slot_rank = pool["a"], pool["b"], pool["rank"]
    builder = LoRAMetaBuilder(max_tokens=80, max_loras=4, page_table=pool["table"])
    assert builder.meta.tile_counters.shape == (5 + 4, COUNTER_ROW_TILES)
    offsets = offsets_of((40, 32))
    for num_tokens in (1, 70, 24, 70, 3):
        slots = rng.integers(-1, 4, num_tokens)
        meta = meta_of(pool, slots, builder)
        x = torch.randn(num_tokens, 1030, generator=gen).to(DEVICE)
        y0 = torch.randn(num_tokens, 72, generator=gen).to(DEVICE)
        y_kernel, y_ref = y0.clone(), y0.clone()
        lora_apply(x, y_kernel, a, b, slot_rank, meta, offsets)
        lora_apply_ref(x, y_ref, a, b, slot_rank, meta, offsets)
        assert not meta.tile_counters.any()
        info = dict(slots=slots, ranks=[16, 5, 0, 8])
        check_expand_result(info, y0, y_kernel, y_ref)


def test_bound_lora_delta_serves_later_steps_of_its_shape():
    """lora_delta launches into the static scratch and binds; the bound launches serve later steps of
    the same kernel shapes (other T, other x), and refuse other shapes and another metadata buffer.
    Every delta is checked against the reference, with the scratch poisoned before each step."""
    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(5)
    ranks = [16, 5, 0, 8]
    pool = make_weights(4, (40, 32), 16, 1030, ranks, torch.float32, DEVICE, gen)
    a, b, slot_rank = pool["a"], pool["b"], pool["rank"]
    builder = LoRAMetaBuilder(max_tokens=300, max_loras=4, page_table=pool["table"])
    offsets = offsets_of((40, 32))
    splits = max(shrink_config(t, 1030, 32).split_k for t in (1, 300))
    scratch = LoRAScratch.allocate(300, 72, 32, splits, torch.float32, DEVICE)
    bound_list = []
    for num_tokens, expect_bound in ((24, False), (5, True), (280, False), (24, True), (280, True), (1, True)):
        meta = meta_of(pool, rng.integers(-1, 4, num_tokens), builder)
        x = torch.randn(num_tokens, 1030, generator=gen).to(DEVICE)
        scratch.delta.fill_(float("nan"))
        bound = next((bd for bd in bound_list if bd.fits(x, meta, scratch)), None)
        assert (bound is not None) == expect_bound, num_tokens
        if bound is None:
            delta, bound = lora_delta(x, scratch, a, b, slot_rank, meta, offsets)
            bound_list.append(bound)
        else:
            bound(x)
            delta = scratch.delta_view(num_tokens, 72)
        want = torch.zeros(num_tokens, 72, device=DEVICE)
        lora_apply_ref(x, want, a, b, slot_rank, meta, offsets)
        torch.testing.assert_close(delta, want, rtol=1e-5, atol=1e-5)
        assert not meta.tile_counters.any()
    other = meta_of(pool, np.zeros(5, dtype=np.int64), LoRAMetaBuilder(300, 4, pool["table"]))
    x = torch.randn(5, 1030, generator=gen).to(DEVICE)
    assert not any(bd.fits(x, other, scratch) for bd in bound_list)
    assert not any(bd.fits(x, builder.meta, LoRAScratch.allocate(300, 72, 32, splits, torch.float32, DEVICE))
                   for bd in bound_list)
    with pytest.raises(ValueError, match="scratch holds 1..300"):
        lora_delta(torch.zeros(301, 1030, device=DEVICE), scratch, a, b, slot_rank, builder.meta, offsets)


def test_meta_builder_groups_tokens_by_adapter():
    """Distinct adapter ids take slots in increasing id order; tokens are grouped by slot in stable order."""
    builder = LoRAMetaBuilder(max_tokens=50, max_loras=6, page_table=torch.zeros(40, 2, dtype=torch.int32))
    rng = np.random.default_rng(3)
    for t in (0, 1, 13, 50):
        pick = rng.choice(40, 6, replace=False)
        ids = np.where(rng.random(t) < 0.2, -1, pick[rng.integers(0, 6, t)])
        meta = builder.build(ids)
        distinct = sorted(set(ids.tolist()) - {-1})
        assert meta.slot_adapter.tolist() == distinct + [-1] * (7 - len(distinct))  # slot 6: the base tokens
        slots = meta.token_slots[:t].tolist()
        assert [distinct[s] if s >= 0 else -1 for s in slots] == ids.tolist()
        assert (meta.token_slots[t:] == -1).all()
        sorted_ids = meta.sorted_token_ids.tolist()
        for slot in range(7):
            expected = [i for i in range(t) if (slots[i] if slots[i] >= 0 else 6) == slot]  # stable order
            start, count = int(meta.slot_start[slot]), int(meta.slot_count[slot])
            assert count == len(expected)
            assert sorted_ids[start:start + count] == expected
        assert sorted(sorted_ids[:t]) == list(range(t))
        assert sorted_ids[t:] == [-1] * (50 - t)
        assert meta.tile_counters.shape == (4 + 6, COUNTER_ROW_TILES) and not meta.tile_counters.any()
        counts = meta.slot_count.tolist()
        for bm in TILE_BLOCKS:  # every non-empty tile once, slots in order, then -1
            want = [(slot << 16) | i for slot in range(7) for i in range(-(-counts[slot] // bm))]
            codes = meta.tile_map(bm).tolist()
            assert codes[:len(want)] == want and set(codes[len(want):]) <= {-1}


def test_meta_builder_counts_adapters_tiles_per_page_block():
    """With block_targets each page block's meta has its own tile counts: the adapters' tiles where an adapter of
    the step has weights in the block, else 0; read at every build (loads change it); a wrong shape is refused."""
    targets = np.zeros((40, 3), dtype=bool)
    targets[:10, 0] = True  # ids 0..9: block 0 only; ids 10..19: blocks 0 and 1; 20..39: none
    targets[10:20, :2] = True
    tables = tuple(torch.zeros(40, 2, dtype=torch.int32) for _ in range(3))
    builder = LoRAMetaBuilder(max_tokens=50, max_loras=6, page_table=tables, block_targets=targets)
    plain = LoRAMetaBuilder(max_tokens=50, max_loras=6, page_table=tables)

    def adapters_tiles(ids):
        builder.build(np.asarray(ids))
        want = plain.build(np.asarray(ids))
        for meta in builder.metas:
            assert torch.equal(meta.tile_counts[:, 1], want.tile_counts[:, 1])  # every tile, whatever the block
        return [[int(meta.tile_count(bm)[0]) for bm in TILE_BLOCKS] for meta in builder.metas], \
            [int(want.tile_count(bm)[0]) for bm in TILE_BLOCKS]

    got, full = adapters_tiles([3] * 20 + [-1] * 5 + [4] * 17)
    assert got == [full, [0] * 3, [0] * 3] and full == [4, 2, 2]
    got, full = adapters_tiles([3, 12, -1, 12])
    assert got == [full, full, [0] * 3] and full == [2, 2, 2]
    got, _ = adapters_tiles([25, 25, -1])  # an adapter with weights nowhere
    assert got == [[0] * 3] * 3
    targets[25, 2] = True  # loaded again, now with weights in block 2
    got, full = adapters_tiles([25, 25, -1])
    assert got == [[0] * 3, [0] * 3, full] and full == [1, 1, 1]
    with pytest.raises(ValueError, match="block_targets"):
        LoRAMetaBuilder(50, 6, tables, targets[:, :2])


@pytest.mark.parametrize("bad, message", [
    (np.array([0, 40]), "lie in"),
    (np.array([-2, 0]), "lie in"),
    (np.zeros(51, dtype=np.int64), "exceed max_tokens"),
    (np.arange(7), "exceed max_loras"),
    (np.zeros((2, 2), dtype=np.int64), "1-D"),
    (np.array([0.5]), "integers"),
])
def test_meta_builder_rejects_bad_ids(bad, message):
    with pytest.raises(ValueError, match=message):
        LoRAMetaBuilder(max_tokens=50, max_loras=6, page_table=torch.zeros(40, 2, dtype=torch.int32)).build(bad)


def test_kernels_reject_bad_input():
    case = make_case(1, 64, (32, 32), 8, 2, 4, "uniform", 0.0)
    out = torch.empty(4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        lora_shrink(case["x"], case["a"], case["slot_rank"], case["meta"], 2, out.double())
    with pytest.raises(ValueError, match="slices"):
        lora_shrink(case["x"], case["a"], case["slot_rank"], case["meta"], 3, out)
    with pytest.raises(ValueError, match="int32"):
        lora_shrink(case["x"], case["a"], case["slot_rank"].long(), case["meta"], 2, out)
    y = torch.zeros(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="rise"):
        lora_expand(out, case["b"], case["slot_rank"], case["meta"], (0, 40, 30, 64), y)
    with pytest.raises(ValueError, match="lora_b"):
        lora_expand(out, case["b"], case["slot_rank"], case["meta"], (0, 32, 64), y.half())
    wide = make_case(2, 300, (400, 400), 400, 2, 4, "uniform", 0.0)  # S*R = 800: 50 row tiles of 16
    with pytest.raises(ValueError, match="tile_counters"):
        lora_shrink(wide["x"], wide["a"], wide["slot_rank"], wide["meta"], 2,
                    torch.empty(4, 800, device=DEVICE), ShrinkConfig(16, 16, 128, 2))

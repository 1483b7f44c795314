"""LoRA kernels on the GPU: fp32/bf16/fp16 correctness matrix and CUDA-graph capture/replay.

Same oracle and poisoning as test_lora_kernels.py (adapters in scattered pool
pages, NaN beyond each rank, in spare pages and behind unused page-table
entries, NaN-poisoned shrink output, random expand output, the elements
checked as there), at real sizes: hidden up to 14336 and non-multiples of the
tiles, ranks 1..64 mixed, 1..16 adapters, T from 1 to 4096. CUDA graphs
captured once follow adapters that move to other pages, change rank and
weights between replays. The split-K shrink's
in-launch sum (whichever program arrives last) is bit-identical launch after
launch and graph replay after replay, and leaves its tile counters at zero.
"""
import dataclasses

import numpy as np
import pytest
import torch

from loraserve.kernels.lora_expand import expand_config, lora_expand
from loraserve.kernels.lora_ops import lora_apply, lora_apply_ref
from loraserve.kernels.lora_reference import lora_expand_ref, lora_shrink_ref
from loraserve.kernels.lora_shrink import lora_shrink, shrink_config
from loraserve.lora.metadata import LoRAMetaBuilder
from test_lora_kernels import (POPULARITY, assign_slots, check_expand_result, check_shrink_result,
                               check_silu_and_mul_factors, defined_mask, make_case, make_weights, meta_of, offsets_of,
                               poisoned_inter, shrink_partials)

pytestmark = pytest.mark.gpu

# (shrink rtol/atol, expand rtol/atol) per dtype: fp32 runs full-precision dots;
# bf16/fp16 outputs are rounded to their own precision.
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-3, 2e-2), torch.float16: (1e-3, 3e-3)}
CASES = [
    # hidden, slice sizes, R, L, T, popularity, base fraction
    (4096, (4096, 1024, 1024), 16, 8, 1, "distinct", 0.0),
    (4096, (4096, 1024, 1024), 16, 8, 64, "uniform", 0.2),
    (8192, (8192,), 64, 16, 37, "skewed", 0.1),
    (4100, (1000, 300, 300), 12, 5, 65, "distinct", 0.3),
    (64, (64,), 1, 1, 4096, "identical", 0.0),
    (4096, (2000, 2000), 16, 16, 300, "uniform", 0.5),
    (8192, (4096,), 32, 16, 4096, "skewed", 0.05),
    (4096, (4096, 1024, 1024), 16, 4, 17, "uniform", 1.0),
    (100, (72, 36), 8, 3, 2000, "distinct", 0.25),
    (5000, (14336,), 64, 9, 129, "identical", 0.4),
    (4096, (14336, 14336), 16, 8, 64, "uniform", 0.1),  # the wide decode expand
    (14336, (4096,), 64, 16, 256, "skewed", 0.1),  # decode shrink at its largest T, 16-way split
    # many adapters in one step: the token-axis programs take several tiles each
    (4096, (4096, 1024, 1024), 16, 200, 256, "distinct", 0.1),
    (4096, (14336, 14336), 16, 64, 1000, "uniform", 0.1),
    (4096, (4096,), 64, 256, 256, "uniform", 0.1),  # ranks up to 64, ~160 adapters in a decode step
    (4100, (4096, 1024, 1024), 32, 8, 8192, "skewed", 0.05),  # the largest prefill step
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("index", range(len(CASES)))
def test_kernels_match_reference_gpu(index, dtype):
    hidden, sizes, rank_max, num_loras, t, kind, base = CASES[index]
    case = make_case(200 + index, hidden, sizes, rank_max, num_loras, t, kind, base,
                     dtype=dtype, device="cuda")
    s_tol, e_tol = TOL[dtype]
    rank_max = case["meta"].rank_width

    out = torch.full((t, len(sizes) * rank_max), float("nan"), device="cuda")
    lora_shrink(case["x"], case["a"], case["slot_rank"], case["meta"], case["num_slices"], out)
    ref = lora_shrink_ref(case["x"], case["a"], case["slot_rank"], case["meta"], case["num_slices"])
    check_shrink_result(case, out, ref, rank_max, rtol=s_tol, atol=s_tol)

    inter = poisoned_inter(case, rank_max)
    y0 = torch.randn(t, sum(sizes), generator=case["gen"]).to("cuda", dtype)
    y_kernel, y_ref = y0.clone(), y0.clone()
    lora_expand(inter, case["b"], case["slot_rank"], case["meta"], case["offsets"], y_kernel)
    lora_expand_ref(inter, case["b"], case["slot_rank"], case["meta"], case["offsets"], y_ref)
    check_expand_result(case, y0, y_kernel, y_ref, rtol=e_tol, atol=e_tol)

    args = (case["a"], case["b"], case["slot_rank"], case["meta"], case["offsets"])
    y_kernel, y_ref = y0.clone(), y0.clone()
    lora_apply(case["x"], y_kernel, *args)
    lora_apply_ref(case["x"], y_ref, *args)
    check_expand_result(case, y0, y_kernel, y_ref, rtol=e_tol, atol=e_tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("inter_size,rank_max,num_loras,num_tokens,kind,base", [
    (14336, 16, 8, 4096, "skewed", 0.05),  # a Llama-3-8B prefill step
    (1000, 64, 64, 700, "distinct", 0.1),  # 64 adapters, ranks up to 64, sizes off the tiles
    (14336, 16, 4, 300, "uniform", 0.3),
    (2000, 128, 8, 300, "skewed", 0.1),  # factors wider than MAX_PIPELINED_RANK
])
def test_silu_and_mul_expands_lora_factors_gpu(inter_size, rank_max, num_loras, num_tokens, kind, base, dtype):
    tol = TOL[dtype][1]
    check_silu_and_mul_factors(21, inter_size, rank_max, num_loras, num_tokens, kind, base, dtype=dtype,
                               device="cuda", rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("hidden,sizes,rank_max,num_loras,num_tokens,kind", [
    (4096, (4096, 1024, 1024), 16, 200, 256, "distinct"),  # a decode step of many adapters (dynamic items)
    (4096, (4096,), 64, 40, 100, "uniform"),  # ranks up to 64 in one dot
    (4100, (1000, 300, 300), 12, 5, 2050, "skewed"),  # a prefill shape, tiles straddling slices
    (4096, (4096, 1024, 1024), 128, 8, 300, "uniform"),  # wider than MAX_PIPELINED_RANK: rank steps instead
])
def test_pipelined_expand_matches_reference_gpu(hidden, sizes, rank_max, num_loras, num_tokens, kind, overwrite,
                                                dtype):
    """ExpandConfig.col_stages: the engine's shape for T with its pages and factors loaded once per item and its
    column tiles pipelined gives the reference product, in place and into a delta."""
    case = make_case(31, hidden, sizes, rank_max, num_loras, num_tokens, kind, 0.1, dtype=dtype, device="cuda")
    rank_max = case["meta"].rank_width
    inter = poisoned_inter(case, rank_max)
    tol = TOL[dtype][1]
    config = dataclasses.replace(expand_config(num_tokens), col_stages=3)
    y0 = torch.randn(num_tokens, sum(sizes), generator=case["gen"]).to("cuda", dtype)
    y_kernel, y_ref = (y0.clone(), y0.clone()) if not overwrite else (torch.full_like(y0, float("nan")),
                                                                      torch.zeros_like(y0))
    lora_expand(inter, case["b"], case["slot_rank"], case["meta"], case["offsets"], y_kernel, config,
                overwrite=overwrite)
    lora_expand_ref(inter, case["b"], case["slot_rank"], case["meta"], case["offsets"], y_ref)
    check_expand_result(case, y0 if not overwrite else torch.zeros_like(y0), y_kernel, y_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("num_tokens", [8, 300])
def test_cuda_graph_replay_follows_adapters_through_the_pool(num_tokens):
    """Capture shrink, expand and lora_apply once; then change everything they read: which adapters a step
    has, their pages (scattered anew), ranks, weights and ids, between replays.

    hidden 2048 splits the shrink's K (8 ways at T=8, 2 at T=300): every replay reuses the tile
    counters, and a replay on unchanged inputs gives bit-identical results."""
    num_loras, rank_max, hidden, sizes = 6, 16, 2048, (256, 64, 64)
    dtype, offsets, n_out = torch.bfloat16, offsets_of(sizes), sum(sizes)
    gen, rng = torch.Generator().manual_seed(5), np.random.default_rng(5)
    first = make_weights(num_loras, sizes, rank_max, hidden, [rank_max] * num_loras, dtype, "cuda", gen)
    # the static pool: room for every adapter at max rank and the spare pages
    a = torch.full((first["a"].shape[0] + 8, *first["a"].shape[1:]), float("nan"), dtype=dtype, device="cuda")
    b = torch.full((first["b"].shape[0] + 8, *first["b"].shape[1:]), float("nan"), dtype=dtype, device="cuda")
    table, slot_rank = first["table"].clone(), first["rank"].clone()
    builder = LoRAMetaBuilder(num_tokens, num_loras, table)
    meta = builder.meta
    x = torch.empty(num_tokens, hidden, dtype=dtype, device="cuda")
    y = torch.empty(num_tokens, n_out, dtype=dtype, device="cuda")
    width = meta.rank_width
    inter = torch.empty(num_tokens, len(sizes) * width, device="cuda")

    def refill(step):
        """New ranks (some 0), pages, weights, inputs and tokens' adapters."""
        ranks = [int(r) for r in rng.integers(0, rank_max + 1, num_loras)]
        ranks[step % num_loras] = rank_max
        pool = make_weights(num_loras, sizes, rank_max, hidden, ranks, dtype, "cuda", gen)
        pages = pool["a"].shape[0]
        a.fill_(float("nan"))
        b.fill_(float("nan"))
        a[:pages].copy_(pool["a"])
        b[:pages].copy_(pool["b"])
        table.copy_(pool["table"])
        slot_rank.copy_(pool["rank"])
        x.copy_(torch.randn(num_tokens, hidden, generator=gen))
        active = rng.permutation(num_loras)[:1 + step % num_loras]
        base = 1.0 if step == 3 else 0.2
        slots = assign_slots(POPULARITY[step % 4], num_tokens, active, base, rng)
        meta_of(pool, slots, builder)
        return dict(ranks=ranks, slots=slots, num_slices=len(sizes))

    refill(0)
    y.copy_(torch.randn(num_tokens, n_out, generator=gen))
    lora_shrink(x, a, slot_rank, meta, len(sizes), inter)  # compile before capture
    lora_expand(inter, b, slot_rank, meta, offsets, y)
    lora_apply(x, y, a, b, slot_rank, meta, offsets)
    torch.cuda.synchronize()
    graphs = [torch.cuda.CUDAGraph() for _ in range(3)]
    with torch.cuda.graph(graphs[0]):
        lora_shrink(x, a, slot_rank, meta, len(sizes), inter)
    with torch.cuda.graph(graphs[1]):
        lora_expand(inter, b, slot_rank, meta, offsets, y)
    with torch.cuda.graph(graphs[2]):
        lora_apply(x, y, a, b, slot_rank, meta, offsets)

    for step in range(5):
        info = refill(step)
        inter.fill_(float("nan"))
        graphs[0].replay()
        ref = lora_shrink_ref(x, a, slot_rank, meta, len(sizes))
        check_shrink_result(info, inter, ref, width, rtol=1e-3, atol=1e-3)
        first = inter.clone()
        inter.fill_(float("nan"))
        graphs[0].replay()
        defined = defined_mask(dict(info, x=x), width)
        assert torch.equal(inter[defined], first[defined])
        assert not meta.tile_counters.any()

        y0 = torch.randn(num_tokens, n_out, generator=gen).to("cuda", dtype)
        y.copy_(y0)
        graphs[1].replay()
        y_ref = y0.clone()
        lora_expand_ref(ref, b, slot_rank, meta, offsets, y_ref)
        check_expand_result(info, y0, y, y_ref, rtol=2e-2, atol=2e-2)

        y.copy_(y0)
        graphs[2].replay()
        y_ref = y0.clone()
        lora_apply_ref(x, y_ref, a, b, slot_rank, meta, offsets)
        check_expand_result(info, y0, y, y_ref, rtol=2e-2, atol=2e-2)
        assert not meta.tile_counters.any()


@pytest.mark.parametrize("num_tokens,hidden,sizes", [(64, 4096, (14336, 14336)), (8, 14336, (4096,)),
                                                     (1024, 4096, (4096, 1024, 1024))])
def test_split_k_shrink_is_bit_identical_run_to_run(num_tokens, hidden, sizes):
    """Whichever program of a tile arrives last, the sum is the partials added in split order."""
    case = make_case(17, hidden, sizes, 16, 8, num_tokens, "uniform", 0.1, dtype=torch.bfloat16,
                     device="cuda")
    sr = len(sizes) * case["meta"].rank_width
    cfg = shrink_config(num_tokens, hidden, sr)
    assert cfg.split_k > 1
    args = (case["x"], case["a"], case["slot_rank"], case["meta"], len(sizes))
    parts = shrink_partials(*args, cfg)
    defined = defined_mask(case, 16)
    expected = torch.zeros(num_tokens, sr, device="cuda")
    for p in parts:  # split 0, 1, ... in turn
        expected = expected + torch.where(defined, p, 0.0)
    for _ in range(50):
        out = torch.full((num_tokens, sr), float("nan"), device="cuda")
        lora_shrink(*args, out)
        assert torch.equal(out[defined], expected[defined])
    assert not case["meta"].tile_counters.any()


def test_meta_builder_back_to_back_builds():
    """Builds issued without a host sync each land intact (staging reuse waits for its copy)."""
    builder = LoRAMetaBuilder(max_tokens=4096, max_loras=16, page_table=torch.zeros(64, 8, dtype=torch.int32,
                                                                                    device="cuda"))
    rng = np.random.default_rng(9)
    history, expected = [], []
    for _ in range(8):
        pick = rng.choice(64, 16, replace=False)
        ids = np.where(rng.random(int(rng.integers(0, 4097))) < 0.1, -1, 0)
        ids[ids == 0] = pick[rng.integers(0, 16, int((ids == 0).sum()))]
        meta = builder.build(ids)
        history.append([v.clone() for v in (meta.token_slots, meta.sorted_token_ids,
                                            meta.slot_start, meta.slot_count, meta.slot_adapter)])
        distinct = np.unique(ids[ids >= 0])
        slots = np.where(ids < 0, -1, np.searchsorted(distinct, ids))
        keys = np.where(slots < 0, 16, slots)
        counts = np.bincount(keys, minlength=17)  # slot 16: the base tokens
        order = np.argsort(keys, kind="stable")
        adapters = np.full(17, -1)
        adapters[:distinct.size] = distinct
        expected.append((slots, order, np.cumsum(counts) - counts, counts, adapters))
    torch.cuda.synchronize()
    for (ts, ids, start, count, adapter), (slots, order, want_start, want_count, want_adapter) in zip(history,
                                                                                                   expected):
        t = len(slots)
        assert ts[:t].tolist() == slots.tolist() and (ts[t:] == -1).all()
        assert ids[:t].tolist() == order.tolist()
        assert start.tolist() == want_start.tolist() and count.tolist() == want_count.tolist()
        assert adapter.tolist() == want_adapter.tolist()

"""Can a Triton decode GEMM (y[T, N] = x[T, K] @ W[N, K]^T, bf16, T <= 256) match cuBLAS on Llama-3-8B's four
LoRA-layer shapes, and what does the LoRA expand cost in its epilogue (one kernel per LoRA layer, no side
stream)? Split-K partial sums are reduced by the last program of each output tile (a counter per tile, a fixed
order), which then adds the expand of its rows (each row's adapter pages gathered, rank by rank).

    python benchmarks/gemm_epilogue_probe.py --tokens 1,32,128,256   # a config sweep per shape and T (GPU)
    python benchmarks/gemm_epilogue_probe.py --interpret             # CPU check at small sizes (TRITON_INTERPRET=1)
"""
import argparse
import itertools
import os
import sys

if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl


@triton.jit
def _expand_epilogue(acc, rows, cols, row_ok, col_ok, inter_ptr, tok_ad_ptr, rank_ptr, page_ptr, b_ptr,
                     stride_it, stride_pa, stride_bp, stride_br,
                     R: tl.constexpr, SLICES: tl.constexpr, NUM_SLICES: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """delta[t, n] = sum_r inter[t, s(n)*R + r] * B^T[adapter_t][r, n] over r < rank_t: rows of different
    adapters, gathered row by row from the pool's pages (page = page_table[adapter, r // PAGE], row r % PAGE)."""
    adapter = tl.load(tok_ad_ptr + rows, mask=row_ok, other=-1)  # [BM]
    rank = tl.where(adapter >= 0, tl.load(rank_ptr + tl.maximum(adapter, 0), mask=row_ok, other=0), 0)
    s_col = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for s in tl.static_range(1, NUM_SLICES):
        s_col += (cols >= SLICES[s]).to(tl.int32)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    page_row = page_ptr + tl.maximum(adapter, 0).to(tl.int64) * stride_pa
    inter_rows = inter_ptr + rows.to(tl.int64)[:, None] * stride_it
    for r in range(0, tl.max(rank, axis=0)):
        ok = row_ok & (r < rank)  # [BM]
        page = tl.load(page_row + r // PAGE, mask=ok, other=0)  # [BM]
        m = ok[:, None] & col_ok[None, :]
        b = tl.load(b_ptr + page.to(tl.int64)[:, None] * stride_bp + (r % PAGE) * stride_br + cols[None, :],
                    mask=m, other=0.0)
        a = tl.load(inter_rows + (s_col * R + r)[None, :], mask=m, other=0.0)
        delta += a * b.to(tl.float32)
    return delta


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, part_ptr, y_ptr, cnt_ptr, T, N, K, k_per_split,
                 stride_xt, stride_wn, stride_ps, stride_pt, stride_yt,
                 inter_ptr, tok_ad_ptr, rank_ptr, page_ptr, b_ptr, stride_it, stride_pa, stride_bp, stride_br,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                 LORA: tl.constexpr = False, R: tl.constexpr = 16, SLICES: tl.constexpr = (0,),
                 NUM_SLICES: tl.constexpr = 1, PAGE: tl.constexpr = 8):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < T, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k0 = split * k_per_split
    for kk in range(0, k_per_split, BLOCK_K):
        ks = k0 + kk + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xt + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(x, w)
    mask = row_ok[:, None] & col_ok[None, :]
    out = y_ptr + rows[:, None] * stride_yt + cols[None, :]
    if SPLIT == 1:
        y = acc.to(y_ptr.dtype.element_ty)
        if LORA:
            delta = _expand_epilogue(acc, rows, cols, row_ok, col_ok, inter_ptr, tok_ad_ptr, rank_ptr, page_ptr,
                                     b_ptr, stride_it, stride_pa, stride_bp, stride_br, R, SLICES, NUM_SLICES,
                                     PAGE, BLOCK_M, BLOCK_N)
            y = (y.to(tl.float32) + delta.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(out, y, mask=mask)
    else:
        part = part_ptr + rows[:, None] * stride_pt + cols[None, :]
        tl.store(part + split * stride_ps, acc, mask=mask)
        tl.debug_barrier()
        cnt = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(cnt, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for p in tl.static_range(SPLIT):
                total += tl.load(part + p * stride_ps, mask=mask, other=0.0, cache_modifier=".cg")
            y = total.to(y_ptr.dtype.element_ty)
            if LORA:
                delta = _expand_epilogue(total, rows, cols, row_ok, col_ok, inter_ptr, tok_ad_ptr, rank_ptr,
                                         page_ptr, b_ptr, stride_it, stride_pa, stride_bp, stride_br, R, SLICES,
                                         NUM_SLICES, PAGE, BLOCK_M, BLOCK_N)
                y = (y.to(tl.float32) + delta.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty)
            tl.store(out, y, mask=mask)
            tl.store(cnt, 0)


def gemm(x, w, cfg, part, cnt, y, lora=None):
    """y = x @ w.T (+ with `lora` = (inter [T, S*R] f32, token_adapter [T] i32, rank [A] i32, page_table [A, R/8]
    i32, lora_b [P, 8, N], slice offsets): the LoRA expand of each row's adapter, added rounded)."""
    bm, bn, bk, split, warps, stages = cfg
    T, K = x.shape
    N = w.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    grid = (triton.cdiv(N, bn), triton.cdiv(T, bm), split)
    if lora is None:
        extra, kw = (x, x, x, x, x, 0, 0, 0, 0), {}
    else:
        inter, tok_ad, rank, table, lora_b, slices = lora
        extra = (inter, tok_ad, rank, table, lora_b, inter.stride(0), table.stride(0), lora_b.stride(0),
                 lora_b.stride(1))
        kw = dict(LORA=True, R=table.shape[1] * 8, SLICES=tuple(slices), NUM_SLICES=len(slices) - 1)
    _gemm_kernel[grid](x, w, part, y, cnt, T, N, K, k_per_split, x.stride(0), w.stride(0),
                       part.stride(0), part.stride(1), y.stride(0), *extra,
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, num_warps=warps, num_stages=stages, **kw)


def make_lora(T, N, slices, num_adapters, rank_max, ranks, dtype, device, seed=0):
    """Random pool pages for num_adapters adapters (ranks cycling through `ranks`), token -> adapter (some -1),
    inter, and the torch reference of the expand."""
    g = torch.Generator().manual_seed(seed)
    pages_per = rank_max // 8
    P = num_adapters * pages_per + 3
    lora_b = (torch.randn(P, 8, N, generator=g) * 0.05).to(dtype)
    perm = torch.randperm(P, generator=g)[:num_adapters * pages_per].view(num_adapters, pages_per).to(torch.int32)
    rank = torch.tensor([ranks[i % len(ranks)] for i in range(num_adapters)], dtype=torch.int32)
    tok = torch.randint(-1, num_adapters, (T,), generator=g, dtype=torch.int32)
    S = len(slices) - 1
    inter = torch.randn(T, S * rank_max, generator=g)
    to = lambda t: t.to(device)  # noqa: E731
    inter, tok, rank, perm, lora_b = map(to, (inter, tok, rank, perm, lora_b))
    # the reference, vectorized: rows[t, r, :] = B^T row r of token t's adapter
    a = tok.clamp(min=0).long()
    r_idx = torch.arange(rank_max, device=device)
    pages = perm[a][:, r_idx // 8].long()  # [T, R]
    rows = lora_b[pages, (r_idx % 8)[None, :].expand(T, -1)].float()  # [T, R, N]
    use = (r_idx[None, :] < rank[a][:, None]) & (tok[:, None] >= 0)  # [T, R]
    s_col = torch.bucketize(torch.arange(N, device=device), torch.tensor(slices[1:-1], device=device), right=True)
    inter_cols = inter.view(T, S, rank_max)[:, s_col, :].permute(0, 2, 1)  # [T, R, N]
    ref = (inter_cols * rows * use[:, :, None]).sum(1)  # [T, N]
    return (inter, tok, rank, perm, lora_b, tuple(slices)), ref


def bench_graph(fn, reps=50):
    """Median us of fn replayed in a CUDA graph of 20 calls (W read from HBM each call: shapes exceed L2)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 20)
    times.sort()
    return times[len(times) // 2]


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SLICES = {"qkv": (0, 4096, 5120, 6144), "o": (0, 4096), "gate_up": (0, 14336, 28672), "down": (0, 4096)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--tokens", default="1,32,64,128,256")
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    if args.interpret:
        torch.manual_seed(0)
        for (T, N, K), cfg in itertools.product([(5, 40, 96), (17, 70, 300)],
                                               [(16, 32, 32, 1, 4, 1), (16, 32, 32, 3, 4, 1)]):
            x, w = torch.randn(T, K), torch.randn(N, K)
            y = torch.empty(T, N)
            part = torch.empty(cfg[3], T, N)
            cnt = torch.zeros(64, dtype=torch.int32)
            gemm(x, w, cfg, part, cnt, y)
            err = (y - x @ w.T).abs().max().item()
            print(f"T={T} N={N} K={K} cfg={cfg}: max err {err:.2e}, counters back to 0: {int(cnt.abs().sum()) == 0}")
            lora, delta = make_lora(T, N, (0, 24, 40, N), 4, 16, (8, 16, 5), torch.float32, "cpu", seed=T)
            gemm(x, w, cfg, part, cnt, y, lora)
            err = (y - (x @ w.T + delta)).abs().max().item()
            print(f"    with the LoRA epilogue: max err {err:.2e}")
        return
    dev = "cuda"
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    def configs(T):
        bm = min(64, max(16, triton.next_power_of_2(T)))
        return [(bm, bn, bk, sp, 4, st) for bn in (64, 128) for bk in (128, 256) for sp in (1, 4, 8)
                for st in (3, 4)]
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        for T in map(int, args.tokens.split(",")):
            x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
            ref = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
            t_cublas = bench_graph(lambda: torch.mm(x, w.T, out=ref))
            best = None
            y = torch.empty(T, N, device=dev, dtype=torch.bfloat16)
            cnt = torch.zeros(4096, dtype=torch.int32, device=dev)
            for cfg in configs(T):
                part = torch.empty(cfg[3], T, N, device=dev, dtype=torch.float32)
                try:
                    gemm(x, w, cfg, part, cnt, y)
                    torch.cuda.synchronize()
                    if not torch.allclose(y.float(), ref.float(), atol=2e-2, rtol=2e-2):
                        print(f"  {name} T={T} {cfg}: WRONG")
                        continue
                    t = bench_graph(lambda: gemm(x, w, cfg, part, cnt, y))
                except Exception as exc:  # noqa: BLE001
                    print(f"  {name} T={T} {cfg}: {type(exc).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            floor = (N * K * 2 + T * K * 2 + T * N * 2) / 4.8e12 * 1e6
            print(f"{name:7s} T={T:3d}: cuBLAS {t_cublas:7.2f} us, Triton best {best[0]:7.2f} us {best[1]} "
                  f"({best[0] / t_cublas:.3f}x cuBLAS), bytes floor at 4.8 TB/s {floor:.2f} us", flush=True)
            part = torch.empty(best[1][3], T, N, device=dev, dtype=torch.float32)
            for n_ad in sorted({min(T, 8), min(T, 128)}):
                lora, delta = make_lora(T, N, SLICES[name], n_ad, 16, (16,), torch.bfloat16, dev, seed=T)
                gemm(x, w, best[1], part, cnt, y, lora)
                want = (ref.float() + delta.to(torch.bfloat16).float()).to(torch.bfloat16).float()
                err = (y.float() - want).abs().max().item()
                t_l = bench_graph(lambda: gemm(x, w, best[1], part, cnt, y, lora))
                print(f"          + LoRA expand epilogue, {n_ad:3d} rank-16 adapters: {t_l:7.2f} us "
                      f"({t_l / t_cublas:.3f}x cuBLAS alone), max err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()

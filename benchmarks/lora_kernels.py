"""Benchmark of the LoRA shrink + expand kernels at Llama-3-8B shapes, against their floors.

For each packed layer (qkv, o, gate_up, down), token count, number of active
adapters (16 adapters at max rank in a paged pool, pages scattered), popularity and rank set it times lora_apply
(shrink + expand) inside a CUDA graph, over enough weight/input sets
that the bytes do not stay in L2, and prints the time next to the bytes and
FLOPs it must move and do, the floor (max of bytes / measured copy bandwidth
and FLOPs / measured bf16 GEMM rate), the percentage of the floor, and the
torch reference's time. Bytes: x rows and y rows (read + write) of tokens with
an adapter, and the A and B rows of each used slot up to its rank.
Writes lora_kernels.json and lora_kernels.png to --out. --sweep first times
candidate kernel shapes (each candidate in a shrink + expand pair, the other
launch in its default shape, in its own graph) at decode and prefill points,
and prints the fastest of each.

--decode-grid instead times the decode-step pair as the engine runs it (the shrink, then the expand writing a
separate delta) for every layer at T = 32, 128, 256 tokens with 8, 64 or 256 distinct adapters (rank 16, a
pool of 1024 adapters' pages, each timed launch reading other adapters than the one before) against its byte
floor: x, the distinct adapters' A and B, the delta written. --prefill times the shrink and the in-place
expand of every layer at T = 8192 with 8 adapters of rank 16 or of ranks 8/16/32/64, against their floors.
--prefill-steps times the shrink, the in-place expand and gate/up's silu_and_mul with the product's factors
(against the plain one) in steps that prefill for many adapters (STEP_MIXES: up to 28 prompts of 288 tokens
and 187 decode rows of 80 more adapters), each in the engine's shape for the step's T. All three use only the
kernels' public launch functions, so the same script measures another build of the package (PYTHONPATH) for
a before/after table in one run.

    python benchmarks/lora_kernels.py [--quick | --full] [--sweep] [--out DIR]
    python benchmarks/lora_kernels.py --decode-grid --prefill --prefill-steps --out DIR
    python benchmarks/lora_kernels.py --plot DIR/lora_kernels.json
"""
import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics

import numpy as np
import torch
import triton
import triton.language as tl

from loraserve.kernels.fused import silu_and_mul
from loraserve.kernels.lora_expand import ExpandConfig, LoRAFactors, expand_config, lora_expand
from loraserve.kernels.lora_meta import PAGE_RANK
from loraserve.kernels.lora_ops import lora_apply, lora_apply_ref
from loraserve.kernels.lora_shrink import ShrinkConfig, lora_shrink, shrink_config
from loraserve.lora.metadata import LoRAMetaBuilder

LAYERS = {  # name: (in features, packed slice sizes)
    "qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,)),
}
TOKENS = (1, 8, 32, 64, 128, 256, 4096)
ADAPTERS = (1, 4, 8, 16)
POPULARITY = ("distinct", "uniform", "skewed", "identical")
RANK_SETS = {"8": (8,), "16": (16,), "64": (64,), "mixed": (8, 16, 32, 64)}
MAX_LORAS, DTYPE = 16, torch.bfloat16
BASE = dict(n=8, pop="uniform", ranks="16")  # the point the one-factor sweep varies around


def slots_for(pop, num_tokens, n, rng):
    """Per-token slot among slots 0..n-1 by popularity kind."""
    if pop == "distinct":
        return np.arange(num_tokens) % n
    if pop == "uniform":
        return rng.integers(0, n, num_tokens)
    if pop == "skewed":
        p = 1.0 / (np.arange(n) + 1.0) ** 2
        return rng.choice(n, num_tokens, p=p / p.sum())
    return np.zeros(num_tokens, dtype=np.int64)


def event_ms(fn, reps, warmup=3):
    """Median milliseconds of fn() between CUDA events."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def graph_us(ops, reps=20):
    """Median microseconds per op of a CUDA graph that runs every op once in turn."""
    ops[0]()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for op in ops:
            op()
    return 1e3 * event_ms(graph.replay, reps, warmup=2) / len(ops)


def ceilings():
    """Measured copy bandwidth (bytes/s, read + write) and bf16 GEMM rate (FLOP/s)."""
    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 4 / (1e-3 * event_ms(lambda: dst.copy_(src), 20))
    del src, dst
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=DTYPE) for _ in range(2))
    rate = 2 * 8192**3 / (1e-3 * event_ms(lambda: a @ b, 20))
    return bw, rate


class Layer:
    """Static slot storage of one packed layer and rotating weight sets."""

    def __init__(self, name, rank_max, l2_bytes, mem_cap):
        self.name, self.rank_max = name, rank_max
        self.hidden, sizes = LAYERS[name]
        self.offsets = tuple(int(o) for o in np.concatenate([[0], np.cumsum(sizes)]))
        self.n_out, self.num_slices = self.offsets[-1], len(sizes)
        set_bytes = 2 * MAX_LORAS * rank_max * (self.num_slices * self.hidden + self.n_out)
        self.l2_bytes = l2_bytes
        count = max(1, min(64, mem_cap // set_bytes))
        pages = MAX_LORAS * -(-rank_max // PAGE_RANK)
        # pool pages: A [P, S*PAGE_RANK, in], B^T [P, PAGE_RANK, N]; adapter i's pages scattered by the table
        self.weights = [(
            torch.randn(pages, self.num_slices * PAGE_RANK, self.hidden, device="cuda",
                        dtype=DTYPE) / math.sqrt(self.hidden),
            torch.randn(pages, PAGE_RANK, self.n_out, device="cuda", dtype=DTYPE) * 0.1,
        ) for _ in range(count)]
        gen = torch.Generator().manual_seed(0)
        self.page_table = torch.randperm(pages, generator=gen).view(MAX_LORAS, -1).to("cuda", torch.int32)


def run_case(layer, num_tokens, n, pop, rank_key, rng, reps, only_rank=None):
    """Time one case; only_rank keeps the slots of that rank active (the others empty)."""
    ranks = [RANK_SETS[rank_key][i % len(RANK_SETS[rank_key])] for i in range(n)]
    ranks += [0] * (MAX_LORAS - n)
    if only_rank is not None:
        ranks = [r if r == only_rank else 0 for r in ranks]
    slot_rank = torch.tensor(ranks, dtype=torch.int32, device="cuda")
    slots = slots_for(pop, num_tokens, n, rng)
    meta = LoRAMetaBuilder(num_tokens, MAX_LORAS, layer.page_table).build(slots)

    tok_rank = np.array(ranks)[slots]
    used = sorted({int(s) for s in slots if ranks[s] > 0})
    rank_sum = sum(ranks[s] for s in used)
    n_tok = int((tok_rank > 0).sum())
    e = DTYPE.itemsize
    nbytes = e * (n_tok * (layer.hidden + 2 * layer.n_out)
                  + rank_sum * (layer.num_slices * layer.hidden + layer.n_out))
    flops = 2 * int(tok_rank.sum()) * (layer.num_slices * layer.hidden + layer.n_out)

    sets = max(1, min(len(layer.weights), math.ceil(3 * layer.l2_bytes / max(1, nbytes))))
    sr = layer.num_slices * layer.rank_max
    xs = [torch.randn(num_tokens, layer.hidden, device="cuda", dtype=DTYPE) for _ in range(sets)]
    ys = [torch.randn(num_tokens, layer.n_out, device="cuda", dtype=DTYPE) for _ in range(sets)]
    inters = [torch.empty(num_tokens, sr, device="cuda") for _ in range(sets)]
    idx = [i % sets for i in range(max(sets, 16))]

    def op(kind, i, cfg=None):
        """One launch (or pair) on weight/input set i; cfg: a ShrinkConfig or ExpandConfig."""
        a, b = layer.weights[i]
        if kind == "apply":
            return lambda: lora_apply(xs[i], ys[i], a, b, slot_rank, meta, layer.offsets)
        if kind == "shrink":
            return lambda: lora_shrink(xs[i], a, slot_rank, meta, layer.num_slices, inters[i], cfg)
        if kind == "expand":
            return lambda: lora_expand(inters[i], b, slot_rank, meta, layer.offsets, ys[i], cfg)
        if kind in ("pair shrink", "pair expand"):  # both launches, one of them in the candidate shape

            def pair():
                lora_shrink(xs[i], a, slot_rank, meta, layer.num_slices, inters[i],
                            cfg if kind == "pair shrink" else None)
                lora_expand(inters[i], b, slot_rank, meta, layer.offsets, ys[i],
                            cfg if kind == "pair expand" else None, after_shrink=True)
            return pair
        raise ValueError(f"unknown kind {kind!r}")

    result = dict(layer=layer.name, T=num_tokens, n=n, pop=pop, ranks=rank_key,
                  only_rank=only_rank, bytes=nbytes, flops=flops, sets=sets)
    result["us"] = graph_us([op("apply", i) for i in idx], reps)
    result["shrink_us"] = graph_us([op("shrink", i) for i in idx], reps)
    result["expand_us"] = graph_us([op("expand", i) for i in idx], reps)
    a, b = layer.weights[0]
    result["ref_us"] = 1e3 * event_ms(
        lambda: lora_apply_ref(xs[0], ys[0], a, b, slot_rank, meta, layer.offsets), 5, 1)
    return result, op, idx


def plan(mode):
    """(layer, T, n, pop, rank set) cases: one factor at a time around BASE, or all."""
    layers, tokens = list(LAYERS), TOKENS
    if mode == "quick":
        layers, tokens = ["qkv", "gate_up"], (1, 64, 4096)
    if mode == "full":
        return [(lay, t, n, p, r) for lay in layers for r in RANK_SETS for t in tokens
                for n in ADAPTERS for p in POPULARITY]
    variants = [BASE] + [dict(BASE, n=n) for n in ADAPTERS if n != BASE["n"]]
    variants += [dict(BASE, pop=p) for p in POPULARITY if p != BASE["pop"]]
    variants += [dict(BASE, ranks=r) for r in RANK_SETS if r != BASE["ranks"]]
    if mode == "quick":
        variants = [BASE, dict(BASE, pop="identical"), dict(BASE, ranks="mixed")]
    cases = [(lay, t, v["n"], v["pop"], v["ranks"]) for lay in layers for t in tokens
             for v in variants]
    return sorted(cases, key=lambda c: (c[0], max(RANK_SETS[c[4]])))


SHRINK_SWEEP = {  # (block_m, block_n, block_k, split_k, num_warps, num_stages); first = today's default
    "decode": [ShrinkConfig(bm, bn, bk, sk, nw, ns) for bm, bn, bk, sk, nw, ns in [
        (16, 16, 128, 16, 4, 3), (16, 16, 256, 16, 4, 2), (16, 16, 64, 16, 4, 4), (16, 16, 128, 16, 8, 3),
        (16, 16, 128, 8, 4, 3), (16, 16, 256, 8, 4, 3), (16, 16, 128, 4, 4, 3), (16, 32, 128, 16, 4, 3)]],
    "prefill": [ShrinkConfig(bm, bn, bk, sk, nw, ns) for bm, bn, bk, sk, nw, ns in [
        (64, 64, 64, 4, 8, 4), (64, 32, 64, 4, 4, 4), (64, 16, 64, 4, 4, 4), (128, 32, 64, 4, 4, 3),
        (64, 64, 64, 2, 8, 4), (64, 64, 64, 1, 8, 4), (128, 64, 64, 4, 8, 3)]],
}
EXPAND_SWEEP = {  # (block_m, block_n, block_r, num_warps, num_stages, col_tiles); first = narrow default
    "decode": [ExpandConfig(16, bn, 16, nw, 2, ct) for bn, nw, ct in [
        (128, 2, 1), (128, 4, 2), (128, 4, 1), (128, 2, 2), (128, 4, 4), (64, 2, 1), (64, 2, 2),
        (256, 4, 1), (256, 4, 2), (256, 8, 1), (256, 8, 2), (512, 8, 1)]],
    "prefill": [ExpandConfig(bm, bn, 16, nw, 2, ct) for bm, bn, nw, ct in [
        (32, 128, 4, 4), (32, 128, 4, 1), (32, 128, 4, 2), (64, 128, 4, 4), (32, 64, 4, 4),
        (32, 256, 4, 2), (16, 128, 4, 4), (64, 64, 4, 2), (64, 128, 8, 4), (32, 256, 8, 4)]],
}
SWEEP_POINTS = [("qkv", 1), ("qkv", 64), ("o", 64), ("gate_up", 8), ("gate_up", 32), ("gate_up", 64),
                ("down", 64), ("qkv", 4096), ("gate_up", 4096)]


@triton.jit
def _empty_kernel(out_ptr):
    """The launch floor: one program that stores one value."""
    tl.store(out_ptr, 1.0)


def sweep(layers, rng, reps):
    """Time alternative kernel shapes at the BASE point (8 adapters, r=16, uniform) of SWEEP_POINTS.

    Per point: lora_apply with its default shapes ("apply"), then every shrink and expand candidate as
    part of a shrink + expand pair (the other
    launch in its default shape; the expand launched after its shrink, as lora_apply does, so on
    Hopper it overlaps the shrink's end), and the fastest candidate of each.
    """
    rows = []
    out = torch.empty(64, 48, device="cuda")
    rows.append(dict(kind="memset", us=graph_us([out.zero_] * 32, reps)))
    rows.append(dict(kind="empty kernel", us=graph_us([lambda: _empty_kernel[(1,)](out)] * 32,
                                                      reps)))
    print(f"sweep memset of inter {rows[0]['us']:.2f} us, "
          f"empty Triton kernel {rows[1]['us']:.2f} us")
    for name, num_tokens in SWEEP_POINTS:
        _, op, idx = run_case(layers(name, 16), num_tokens, BASE["n"], BASE["pop"], BASE["ranks"],
                              rng, reps)
        us = graph_us([op("apply", i) for i in idx], reps)
        rows.append(dict(layer=name, T=num_tokens, kind="apply", config="default", us=us))
        print(f"sweep {name:8s} T={num_tokens:5d} {'apply':14s} {us:9.2f} us  default shapes")
        shape = "decode" if num_tokens <= 64 else "prefill"
        for kind, table in (("pair shrink", SHRINK_SWEEP), ("pair expand", EXPAND_SWEEP)):
            timed = []
            for cfg in table[shape]:
                us = graph_us([op(kind, i, cfg) for i in idx], reps)
                timed.append((us, cfg))
                rows.append(dict(layer=name, T=num_tokens, kind=kind, config=repr(cfg), us=us))
                print(f"sweep {name:8s} T={num_tokens:5d} {kind:14s} {us:9.2f} us  {cfg}")
            us, cfg = min(timed, key=lambda t: t[0])
            print(f"sweep {name:8s} T={num_tokens:5d} {kind:14s} best {us:.2f} us  {cfg}")
    return rows


def mixed_vs_alone(layers, names, tokens, rng, reps):
    """Mixed ranks {8,16,32,64} in one launch vs the sum of each rank's slots alone."""
    rows = []
    for name in names:
        for num_tokens in tokens:
            layer = layers(name, 64)
            seed = int(rng.integers(1 << 30))
            mixed, _, _ = run_case(layer, num_tokens, 8, "uniform", "mixed",
                                   np.random.default_rng(seed), reps)
            alone = [run_case(layer, num_tokens, 8, "uniform", "mixed",
                              np.random.default_rng(seed), reps, only_rank=r)[0]["us"]
                     for r in RANK_SETS["mixed"]]
            rows.append(dict(layer=name, T=num_tokens, mixed_us=mixed["us"], alone_us=alone,
                             ratio=mixed["us"] / sum(alone)))
            print(f"mixed {name:8s} T={num_tokens:5d} mixed {mixed['us']:8.2f} us  alone "
                  f"{' + '.join(f'{u:.2f}' for u in alone)} = {sum(alone):8.2f} us  "
                  f"ratio {rows[-1]['ratio']:.2f}")
    return rows


def add_floor(row, bw, rate):
    row["byte_floor_us"] = 1e6 * row["bytes"] / bw
    row["flop_floor_us"] = 1e6 * row["flops"] / rate
    row["floor_us"] = max(row["byte_floor_us"], row["flop_floor_us"])
    row["pct_floor"] = 100 * row["floor_us"] / row["us"]
    row["speedup"] = row["ref_us"] / row["us"]
    return row


def print_row(r):
    print(f"{r['layer']:8s} {r['T']:5d} {r['n']:3d} {r['pop']:9s} {r['ranks']:5s} "
          f"{r['us']:9.2f} {r['shrink_us']:8.2f} {r['expand_us']:8.2f} {r['bytes'] / 1e6:9.3f} "
          f"{r['flops'] / 1e6:9.1f} {r['floor_us']:8.2f} {r['pct_floor']:6.1f} "
          f"{r['ref_us']:9.1f} {r['speedup']:7.1f}")


HEADER = (f"{'layer':8s} {'T':>5s} {'n':>3s} {'pop':9s} {'ranks':5s} {'us':>9s} {'shrink':>8s} "
          f"{'expand':>8s} {'MB':>9s} {'MFLOP':>9s} {'floor':>8s} {'%floor':>6s} "
          f"{'ref_us':>9s} {'speedup':>7s}")


def targets(rows, mixed):
    """Lines that compare the measurements with the kernels' goals (information, not engine targets):
    decode within 2x the floor or under 6 us a launch, prefill within 2x the floor, mixed ranks within
    1.1x the ranks alone, at least 3x the torch reference at T <= 64."""
    base = [r for r in rows if (r["n"], r["pop"], r["ranks"]) == tuple(BASE.values())]
    out = []
    for r in base:
        if r["T"] <= 64:
            ok = r["us"] <= 2 * r["floor_us"] or r["us"] / 2 < 6
            out.append(f"decode  {r['layer']:8s} T={r['T']:4d}: {r['us']:.2f} us, floor "
                       f"{r['floor_us']:.2f} us ({r['us'] / r['floor_us']:.1f}x), "
                       f"{r['us'] / 2:.2f} us/launch -> {'met' if ok else 'MISSED'}")
        if r["T"] == 4096:
            ok = r["us"] <= 2 * r["floor_us"]
            out.append(f"prefill {r['layer']:8s}: {r['us']:.1f} us vs floor {r['floor_us']:.1f} us "
                       f"({r['us'] / r['floor_us']:.2f}x) -> {'met' if ok else 'MISSED'}")
    for m in mixed:
        out.append(f"mixed   {m['layer']:8s} T={m['T']:4d}: {m['ratio']:.2f}x the sum alone -> "
                   f"{'met' if m['ratio'] <= 1.1 else 'MISSED'}")
    small = [r for r in rows if r["T"] <= 64]
    if small:
        worst = min(small, key=lambda r: r["speedup"])
        out.append(f"speedup over the torch reference, T <= 64: min {worst['speedup']:.1f}x "
                   f"({worst['layer']} T={worst['T']} n={worst['n']} {worst['pop']}) -> "
                   f"{'met' if worst['speedup'] >= 3 else 'MISSED'}")
    return out


def plot(data, path):
    """Time and share of the floor against T, per layer, at the BASE point."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=(13, 5))
    for i, name in enumerate(LAYERS):
        rows = sorted((r for r in data["cases"] if r["layer"] == name and
                       (r["n"], r["pop"], r["ranks"]) == tuple(BASE.values())),
                      key=lambda r: r["T"])
        if not rows:
            continue
        t = [r["T"] for r in rows]
        color = f"C{i}"
        ax_t.plot(t, [r["us"] for r in rows], "o-", color=color, label=f"{name} kernels")
        ax_t.plot(t, [r["floor_us"] for r in rows], "--", color=color, label=f"{name} floor")
        ax_t.plot(t, [r["ref_us"] for r in rows], ":", color=color, label=f"{name} torch ref")
        ax_p.plot(t, [r["pct_floor"] for r in rows], "o-", color=color, label=name)
    for ax in (ax_t, ax_p):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T")
        ax.grid(alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("us per shrink + expand")
    ax_t.legend(fontsize=6, ncol=2)
    ax_p.set_ylabel("% of floor")
    ax_p.legend(fontsize=8)
    fig.suptitle(f"LoRA kernels, 8 adapters r=16 uniform, bf16 — {data['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


GRID_TOKENS, GRID_ADAPTERS, GRID_POOL = (32, 128, 256), (8, 64, 256), 1024
GRID_RANK, GRID_OPS = 16, 16
DEV = "cuda"  # the device of the grid and prefill timings


class PoolLayer:
    """One packed layer's pool views for `adapters` adapters of rank_max (pages scattered), as the engine's
    pool holds them: A [P, S*PAGE_RANK, in], B [P, PAGE_RANK, N], the page table and each adapter's rank; on
    `device` (default DEV)."""

    def __init__(self, name, adapters, rank_max, ranks, gen, device=None):
        device = DEV if device is None else device
        self.name = name
        self.hidden, sizes = LAYERS[name]
        self.offsets = tuple(int(o) for o in np.concatenate([[0], np.cumsum(sizes)]))
        self.n_out, self.num_slices = self.offsets[-1], len(sizes)
        per = -(-rank_max // PAGE_RANK)
        pages = adapters * per
        self.a = torch.randn(pages, self.num_slices * PAGE_RANK, self.hidden, device=device, dtype=DTYPE) / 64
        self.b = torch.randn(pages, PAGE_RANK, self.n_out, device=device, dtype=DTYPE) / 4
        self.table = torch.randperm(pages, generator=gen).view(adapters, per).to(device, torch.int32)
        self.ranks = [ranks[i % len(ranks)] for i in range(adapters)]
        self.rank = torch.tensor(self.ranks, dtype=torch.int32, device=device)
        self.rank_max = rank_max

    def adapter_bytes(self, ids):
        e = DTYPE.itemsize
        return sum(e * self.ranks[i] * (self.num_slices * self.hidden + self.n_out) for i in ids)


def time_pair(layer, num_tokens, distinct, rng, reps, overwrite, ops=GRID_OPS, expand_cfg=None, shrink_cfg=None):
    """Median us of the shrink, the expand and the pair in a CUDA graph over `ops` launches, each with its own
    step metadata naming other adapters (so that the adapters' bytes come from memory, not L2); and the bytes
    one launch must move."""
    sr = layer.num_slices * layer.rank_max
    adapters = layer.table.shape[0]
    metas, xs, ys, inters, moved = [], [], [], [], []
    for i in range(ops):
        ids = rng.permutation(adapters)[:distinct]
        token_ids = ids[rng.permutation(num_tokens) % distinct]  # every adapter gets tokens (distinct <= T)
        metas.append(LoRAMetaBuilder(num_tokens, distinct, layer.table).build(token_ids))
        xs.append(torch.randn(num_tokens, layer.hidden, device=DEV, dtype=DTYPE))
        ys.append(torch.randn(num_tokens, layer.n_out, device=DEV, dtype=DTYPE))
        inters.append(torch.empty(num_tokens, sr, device=DEV))
        e = DTYPE.itemsize
        moved.append(e * num_tokens * layer.hidden + layer.adapter_bytes(set(token_ids.tolist()))
                     + e * num_tokens * layer.n_out * (1 if overwrite else 2))

    def shrink(i):
        return lambda: lora_shrink(xs[i], layer.a, layer.rank, metas[i], layer.num_slices, inters[i], shrink_cfg)

    def expand(i):
        return lambda: lora_expand(inters[i], layer.b, layer.rank, metas[i], layer.offsets, ys[i], expand_cfg,
                                   overwrite=overwrite)

    def pair(i):
        def run():
            lora_shrink(xs[i], layer.a, layer.rank, metas[i], layer.num_slices, inters[i], shrink_cfg)
            lora_expand(inters[i], layer.b, layer.rank, metas[i], layer.offsets, ys[i], expand_cfg,
                        overwrite=overwrite, after_shrink=True)
        return run

    return dict(shrink_us=graph_us([shrink(i) for i in range(ops)], reps),
                expand_us=graph_us([expand(i) for i in range(ops)], reps),
                us=graph_us([pair(i) for i in range(ops)], reps), bytes=float(np.mean(moved)))


# --grid-variants: other decode expand shapes timed beside the default one, (name, config, smallest T it applies to)
GRID_EXPAND_VARIANTS = (
    ("32-token tiles", ExpandConfig(32, 128, 16, num_warps=4), 65),
    ("two stages", ExpandConfig(16, 128, 16, num_warps=4, num_stages=2, dynamic=True), 1),
    ("512 columns", ExpandConfig(16, 512, 16, num_warps=4, num_stages=1, dynamic=True), 1),
    ("4x programs", ExpandConfig(16, 128, 16, num_warps=4, num_stages=1, dynamic=True, program_scale=4), 1),
    ("2x programs, 256 columns",
     ExpandConfig(16, 256, 16, num_warps=4, num_stages=1, dynamic=True, program_scale=2), 1),
    ("4x programs, 512 columns",
     ExpandConfig(16, 512, 16, num_warps=4, num_stages=1, dynamic=True, program_scale=4), 1),
    ("hoisted pages", ExpandConfig(16, 128, 16, num_warps=4, num_stages=1, dynamic=True, hoist_pages=True), 1),
    ("hoisted pages, 4x programs",
     ExpandConfig(16, 128, 16, num_warps=4, num_stages=1, dynamic=True, program_scale=4, hoist_pages=True), 1),
    ("pipelined column tiles, 2 stages", ExpandConfig(16, 128, 16, num_warps=4, num_stages=1, dynamic=True,
                                                      col_stages=2), 1),
    ("pipelined column tiles, 3 stages", ExpandConfig(16, 128, 16, num_warps=4, num_stages=1, dynamic=True,
                                                      col_stages=3), 1),
)


# --grid-variants: decode shrink shapes timed beside the default one, (name, changes to the default config)
GRID_SHRINK_VARIANTS = (
    ("4 stages", dict(num_stages=4)),
    ("2 warps, 4 stages, 64-wide K steps", dict(num_warps=2, num_stages=4, block_k=64)),
)


def decode_grid(bw, reps, variants=False):
    """The decode pair (shrink, expand into a delta) per layer, T and distinct adapters, against its byte floor;
    with `variants`, the expand also in each GRID_EXPAND_VARIANTS shape and the shrink in each
    GRID_SHRINK_VARIANTS one."""
    rows = []
    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    print(f"\ndecode pair (shrink + expand into a delta), rank {GRID_RANK}, us (x byte floor)")
    print(f"{'layer':8s} " + " ".join(f"{f'T={t} n={n}':>22s}" for t in GRID_TOKENS for n in GRID_ADAPTERS))
    for name in LAYERS:
        layer = PoolLayer(name, GRID_POOL, GRID_RANK, [GRID_RANK], gen)
        cells = []
        for t in GRID_TOKENS:
            for n in GRID_ADAPTERS:
                row = dict(layer=name, T=t, adapters=n, distinct=min(n, t))
                row.update(time_pair(layer, t, min(n, t), rng, reps, overwrite=True))
                row["floor_us"] = 1e6 * row["bytes"] / bw
                for label, cfg, min_tokens in GRID_EXPAND_VARIANTS if variants else ():
                    if t >= min_tokens:
                        other = time_pair(layer, t, min(n, t), rng, reps, overwrite=True, expand_cfg=cfg)
                        row[f"expand_us ({label})"] = other["expand_us"]
                        print(f"  {name} T={t} n={n}: expand {row['expand_us']:.2f} us, with {label} "
                              f"{other['expand_us']:.2f} us (pair {row['us']:.2f} / {other['us']:.2f})")
                for label, change in GRID_SHRINK_VARIANTS if variants else ():
                    cfg = dataclasses.replace(shrink_config(t, layer.hidden, layer.num_slices * layer.rank_max),
                                              **change)
                    other = time_pair(layer, t, min(n, t), rng, reps, overwrite=True, shrink_cfg=cfg)
                    row[f"shrink_us ({label})"] = other["shrink_us"]
                    print(f"  {name} T={t} n={n}: shrink {row['shrink_us']:.2f} us, with {label} "
                          f"{other['shrink_us']:.2f} us (pair {row['us']:.2f} / {other['us']:.2f})")
                rows.append(row)
                cells.append(f"{row['us']:8.2f} ({row['us'] / row['floor_us']:4.2f}x)")
        print(f"{name:8s} " + " ".join(f"{c:>22s}" for c in cells))
        del layer
        torch.cuda.empty_cache()
    return rows


def prefill_kernels(bw, reps, num_tokens=8192):
    """The prefill shrink and in-place expand of every layer at T tokens, 8 adapters of rank 16 or of mixed
    ranks, against their byte floors (x read; y read and written; the adapters)."""
    rows = []
    gen, rng = torch.Generator().manual_seed(1), np.random.default_rng(1)
    print(f"\nprefill, T={num_tokens}, 8 adapters: us (x byte floor)")
    for key, ranks in (("16", (16,)), ("mixed", (8, 16, 32, 64))):
        for name in LAYERS:
            layer = PoolLayer(name, 64, max(ranks), ranks, gen)
            row = dict(layer=name, T=num_tokens, ranks=key)
            row.update(time_pair(layer, num_tokens, 8, rng, reps, overwrite=False, ops=4))
            e = DTYPE.itemsize
            shrink_bytes = e * num_tokens * layer.hidden
            row["shrink_floor_us"] = 1e6 * shrink_bytes / bw
            row["expand_floor_us"] = 1e6 * (row["bytes"] - shrink_bytes) / bw
            rows.append(row)
            print(f"{name:8s} ranks {key:5s} shrink {row['shrink_us']:7.1f} "
                  f"({row['shrink_us'] / row['shrink_floor_us']:.2f}x)  expand {row['expand_us']:7.1f} "
                  f"({row['expand_us'] / row['expand_floor_us']:.2f}x)  pair {row['us']:7.1f} us")
            del layer
            torch.cuda.empty_cache()
    return rows


# --prefill-steps: the tokens of a step that prefills, as (prompts, tokens per prompt, decode rows, adapters of the
# decode rows beside the prompts'; 0: the prompts' adapters): few long prompts, and prompts of 288 tokens (the
# many-adapters trace's steps) alone or beside decode rows, at T = 8,192, 4,096 and 2,048 (about)
STEP_MIXES = {"8 x 1024": (8, 1024, 0, 0), "8 x 1000 + 192 rows": (8, 1000, 192, 0),
              "28 x 288": (28, 288, 0, 0), "28 x 288 + 187 rows": (28, 288, 187, 80),
              "2 x 2048": (2, 2048, 0, 0), "14 x 288": (14, 288, 0, 0), "14 x 288 + 64 rows": (14, 288, 64, 40),
              "2 x 1024": (2, 1024, 0, 0), "7 x 288": (7, 288, 0, 0), "7 x 288 + 32 rows": (7, 288, 32, 20)}
STEP_POOL = 512  # rank-16 adapters in the pool the steps' adapters are drawn from
# --prefill-steps: the pools' rank widths (max_lora_rank): the adapters' own, and the engine's default
STEP_RANK_WIDTHS = (16, 64)
# --prefill-steps: the in-place expand also timed in these shapes, (name, changes to the engine's shape for T)
STEP_EXPAND_VARIANTS = (("pipelined column tiles, 2 stages", dict(col_stages=2)),
                        ("pipelined column tiles, 3 stages", dict(col_stages=3)))
# --prefill-steps: the shrink also timed in these shapes, (name, changes to the engine's shape for T): more programs an
# SM (kernel_resources.py: the engine's q/k/v shrink of 8,192 tokens fits one program of 4 warps an SM, its 64-token
# tiles about one program per SM)
STEP_SHRINK_VARIANTS = (("32-token tiles", dict(block_m=32)),
                        ("32-token tiles, 3 stages", dict(block_m=32, num_stages=3)), ("8 warps", dict(num_warps=8)))


def step_adapters(mix, rng):
    """[T] adapter ids of a step of STEP_MIXES[mix], prompts' tokens first, each prompt its own adapter, the decode
    rows spread over their own adapters (every one of them used), or over the prompts' ones."""
    prompts, length, rows, others = STEP_MIXES[mix]
    ids = rng.permutation(STEP_POOL)
    tokens = [np.repeat(ids[:prompts], length)]
    if rows and others:
        decode = ids[prompts:prompts + others][rng.integers(0, others, rows)]
        decode[:others] = ids[prompts:prompts + others]
        tokens.append(decode)
    elif rows:
        tokens.append(ids[:prompts][rng.integers(0, prompts, rows)])
    return np.concatenate(tokens)


def prefill_steps(reps, ops=3):
    """Per layer, pool rank width (STEP_RANK_WIDTHS) and STEP_MIXES step, us in a CUDA graph (ops launches, each
    step's own adapters and tensors): the shrink (also in each STEP_SHRINK_VARIANTS shape), the in-place expand
    (q/k/v, o, down; also in each STEP_EXPAND_VARIANTS shape), and for gate/up silu_and_mul expanding the product
    from its factors against the plain silu_and_mul, each in the engine's shape for the step's T."""
    rows = []
    gen, rng = torch.Generator().manual_seed(2), np.random.default_rng(2)
    print(f"\nsteps that prefill, rank-16 adapters drawn from {STEP_POOL}: us per launch")
    for name in LAYERS:
        for width in STEP_RANK_WIDTHS:
            layer = PoolLayer(name, STEP_POOL, width, [GRID_RANK], gen)
            for mix in STEP_MIXES:
                rows.append(prefill_step_row(layer, width, mix, rng, reps, ops))
            del layer
            torch.cuda.empty_cache()
    return rows


def prefill_step_row(layer, width, mix, rng, reps, ops):
    """prefill_steps' timings of one layer's pool at one step."""
    steps = [step_adapters(mix, rng) for _ in range(ops)]
    t = len(steps[0])
    builders = [LoRAMetaBuilder(t, 256, layer.table) for _ in range(ops)]
    metas = [b.build(ids) for b, ids in zip(builders, steps)]
    xs = [torch.randn(t, layer.hidden, device=DEV, dtype=DTYPE) for _ in range(ops)]
    ys = [torch.randn(t, layer.n_out, device=DEV, dtype=DTYPE) for _ in range(ops)]
    inters = [torch.randn(t, layer.num_slices * width, device=DEV) for _ in range(ops)]
    row = dict(layer=layer.name, rank_width=width, step=mix, T=t, adapters=len(set(steps[0].tolist())))
    row["shrink_us"] = graph_us([lambda i=i: lora_shrink(xs[i], layer.a, layer.rank, metas[i], layer.num_slices,
                                                         inters[i]) for i in range(ops)], reps)
    shrink_more = ""
    for label, change in STEP_SHRINK_VARIANTS:
        cfg = dataclasses.replace(shrink_config(t, layer.hidden, inters[0].shape[1]), **change)
        row[f"shrink_us ({label})"] = graph_us([lambda i=i: lora_shrink(
            xs[i], layer.a, layer.rank, metas[i], layer.num_slices, inters[i], cfg) for i in range(ops)], reps)
        shrink_more += f", {label} {row[f'shrink_us ({label})']:7.1f}"
    if layer.name == "gate_up":
        # the engine tells the factors its step's largest rank (LoRAFactors.max_rank, where the build has it)
        bound = {"max_rank": GRID_RANK} if "max_rank" in {f.name for f in dataclasses.fields(LoRAFactors)} else {}
        factors = [LoRAFactors(inters[i], layer.b, layer.rank, metas[i], layer.offsets, **bound) for i in range(ops)]
        row["silu_and_mul_us"] = graph_us([lambda i=i: silu_and_mul(ys[i]) for i in range(ops)], reps)
        row["silu_and_mul_lora_us"] = graph_us([lambda i=i: silu_and_mul(ys[i], factors[i]) for i in range(ops)],
                                               reps)
        more = (f"silu_and_mul {row['silu_and_mul_lora_us']:7.1f} "
                f"({row['silu_and_mul_lora_us'] / row['silu_and_mul_us']:.2f}x the plain one)")
        if bound and width > GRID_RANK:  # the same factors as wide as the pool: a dot per rank class on the device
            unbound = [dataclasses.replace(f, max_rank=None) for f in factors]
            row["silu_and_mul_lora_us (pool width)"] = graph_us(
                [lambda i=i: silu_and_mul(ys[i], unbound[i]) for i in range(ops)], reps)
            more += f", told only the pool's width {row['silu_and_mul_lora_us (pool width)']:7.1f}"
    else:
        row["expand_us"] = graph_us([lambda i=i: lora_expand(inters[i], layer.b, layer.rank, metas[i], layer.offsets,
                                                             ys[i]) for i in range(ops)], reps)
        more = f"expand {row['expand_us']:7.1f}"
        for label, change in STEP_EXPAND_VARIANTS:
            cfg = dataclasses.replace(expand_config(t), **change)
            row[f"expand_us ({label})"] = graph_us([lambda i=i: lora_expand(
                inters[i], layer.b, layer.rank, metas[i], layer.offsets, ys[i], cfg) for i in range(ops)], reps)
            more += f", {label} {row[f'expand_us ({label})']:7.1f}"
    print(f"{layer.name:8s} width {width:3d} {mix:20s} T={t:5d} {row['adapters']:4d} adapters  "
          f"shrink {row['shrink_us']:7.1f}{shrink_more}  " + more)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a short run: 2 layers, 3 token counts")
    size.add_argument("--full", action="store_true", help="every combination (long)")
    parser.add_argument("--sweep", action="store_true", help="also time alternative kernel shapes")
    parser.add_argument("--decode-grid", action="store_true",
                        help="only the decode pair at T = 32/128/256 and 8/64/256 adapters (and what follows)")
    parser.add_argument("--grid-variants", action="store_true",
                        help="--decode-grid: also other expand and shrink shapes (GRID_EXPAND_VARIANTS, "
                             "GRID_SHRINK_VARIANTS)")
    parser.add_argument("--prefill", action="store_true", help="the prefill shrink and expand at T = 8192")
    parser.add_argument("--prefill-steps", action="store_true",
                        help="the shrink, expand and gate/up's silu_and_mul in steps that prefill for many adapters "
                             "(STEP_MIXES)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/")
    parser.add_argument("--plot", metavar="JSON", help="only redraw the PNG from a JSON result")
    args = parser.parse_args()
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), os.path.splitext(args.plot)[0] + ".png")
        return
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    props = torch.cuda.get_device_properties(0)
    pool = {}

    def layers(name, rank_max):
        if (name, rank_max) not in pool:
            pool.clear()
            torch.cuda.empty_cache()
            pool[(name, rank_max)] = Layer(name, rank_max, props.L2_cache_size, 6 << 30)
        return pool[(name, rank_max)]

    bw, rate = ceilings()
    print(f"{props.name}: copy {bw / 1e12:.2f} TB/s (read + write), bf16 GEMM "
          f"{rate / 1e12:.0f} TFLOP/s, L2 {props.L2_cache_size >> 20} MiB")
    data = dict(device=props.name, date=datetime.date.today().isoformat(),
                torch=torch.__version__, triton=triton.__version__, bandwidth=bw, matmul=rate,
                max_loras=MAX_LORAS, dtype=str(DTYPE), cases=[], mixed=[], sweep=[])
    if args.decode_grid or args.prefill or args.prefill_steps:
        data["decode_grid"] = decode_grid(bw, args.reps, args.grid_variants) if args.decode_grid else []
        data["prefill"] = prefill_kernels(bw, args.reps) if args.prefill else []
        data["prefill_steps"] = prefill_steps(args.reps) if args.prefill_steps else []
        with open(os.path.join(args.out, "lora_kernels_grid.json"), "w") as f:
            json.dump(data, f, indent=1)
        return
    if args.sweep:
        data["sweep"] = sweep(layers, rng, args.reps)
    print(HEADER)
    mode = "quick" if args.quick else "full" if args.full else "default"
    for layer, t, n, pop, ranks in plan(mode):
        row = add_floor(run_case(layers(layer, max(RANK_SETS[ranks])), t, n, pop, ranks, rng,
                                 args.reps)[0], bw, rate)
        data["cases"].append(row)
        print_row(row)
    names = ["qkv"] if args.quick else list(LAYERS)
    data["mixed"] = mixed_vs_alone(layers, names, (64, 4096), rng, args.reps)
    data["targets"] = targets(data["cases"], data["mixed"])
    print("\n".join(data["targets"]))
    path = os.path.join(args.out, "lora_kernels.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    try:
        plot(data, os.path.join(args.out, "lora_kernels.png"))
    except ImportError:
        print("matplotlib is missing: redraw later with --plot", path)


if __name__ == "__main__":
    main()

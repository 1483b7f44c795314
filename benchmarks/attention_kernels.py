"""Micro-benchmark of the paged attention kernels (Llama-3-8B shapes: 32 heads, 8 KV heads, D=128, bf16).

Decode is timed as the engine runs it: inside a CUDA graph, one call per
"layer" over enough separate layer caches that the KV bytes do not stay in L2.
It prints time per call next to its KV byte floor (KV bytes / measured copy
bandwidth). Prefill prints TFLOP/s of the causal attention next to torch SDPA.
`--sweep` also times alternative launch configurations.

    python benchmarks/attention_kernels.py [--sweep]
"""
import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F

from loraserve.kernels.attention import (
    DecodeConfig,
    PrefillConfig,
    decode_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
MAX_MODEL_LEN = 4096  # block-table width of the captured graphs
L2_BUSTING_BYTES = 512 * 2**20


def median_ms(fn, reps=30):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth():
    """Measured device-to-device copy bandwidth in bytes/s, read + write counted."""
    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def decode_case(batch, ctx, config):
    """Seconds per decode call, measured over a graph of calls on distinct layer caches."""
    max_blocks = MAX_MODEL_LEN // BLOCK_SIZE
    used = batch * (ctx // BLOCK_SIZE)
    layer_bytes = 2 * used * BLOCK_SIZE * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    layers = min(1024, max(4, -(-L2_BUSTING_BYTES // layer_bytes)))
    shape = (layers, used + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_caches = torch.randn(shape, device="cuda", dtype=DTYPE)
    v_caches = torch.randn(shape, device="cuda", dtype=DTYPE)
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device="cuda")
    tables[:, : ctx // BLOCK_SIZE] = (torch.randperm(used, device="cuda") + 1).view(batch, -1)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)

    def all_layers():
        for layer in range(layers):
            paged_decode_attention(q, k_caches[layer], v_caches[layer], tables, seq_lens,
                                   HEAD_DIM**-0.5, out, config)

    all_layers()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        all_layers()
    ms = median_ms(graph.replay, reps=20)
    return ms * 1e-3 / layers, layer_bytes


def prefill_case(ctx, q_len, config):
    """Seconds of one prefill call of q_len queries ending a ctx-token context, and its FLOPs."""
    blocks = ctx // BLOCK_SIZE
    shape = (blocks + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
    tables = (torch.randperm(blocks, device="cuda") + 1).to(torch.int32).view(1, -1)
    seq_lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    q = torch.randn(q_len, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    ms = median_ms(lambda: paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, qsl,
                                                   q_len, HEAD_DIM**-0.5, out, config))
    visible = sum(ctx - q_len + i + 1 for i in range(q_len))
    return ms * 1e-3, 4 * HEADS * HEAD_DIM * visible


def sdpa_seconds(n):
    """Dense causal SDPA of an n-token prompt (no paging), for scale."""
    q = torch.randn(1, HEADS, n, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(1, HEADS, n, HEAD_DIM, device="cuda", dtype=DTYPE)
    return median_ms(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True)) * 1e-3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other launch configs")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    bandwidth = copy_bandwidth()
    print(f"{props.name}, {props.multi_processor_count} SMs, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("decode  batch   ctx  splits      us  floor_us  %floor   GB/s")
    for batch, ctx in itertools.product([1, 64], [128, 1024, 4096]):
        seconds, kv_bytes = decode_case(batch, ctx, DecodeConfig())
        floor = kv_bytes / bandwidth
        splits = decode_num_splits(batch, KV_HEADS, MAX_MODEL_LEN // BLOCK_SIZE, BLOCK_SIZE,
                                   DecodeConfig().block_n, torch.device("cuda"))
        print(f"decode {batch:6d} {ctx:5d} {splits:7d} {seconds * 1e6:7.1f} {floor * 1e6:9.1f} "
              f"{100 * floor / seconds:6.1f}% {kv_bytes / seconds / 1e9:6.0f}")
    print("prefill   ctx  q_len      ms  TFLOP/s  (sdpa dense causal ms)")
    for ctx, q_len in [(4096, 4096), (4096, 512), (1024, 1024)]:
        seconds, flops = prefill_case(ctx, q_len, PrefillConfig())
        dense = f"{sdpa_seconds(q_len) * 1e3:.3f}" if ctx == q_len else "-"
        print(f"prefill {ctx:5d} {q_len:6d} {seconds * 1e3:7.3f} {flops / seconds / 1e12:8.1f}  ({dense})")
    if args.sweep:
        sweep()


def sweep():
    print("sweep decode: block_n warps stages | us per (batch, ctx) = (1,4096) (64,1024) (64,4096)")
    for block_n, warps, stages in itertools.product([32, 64, 128], [4, 8], [2, 3]):
        config = DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages)
        times = [decode_case(b, c, config)[0] * 1e6 for b, c in [(1, 4096), (64, 1024), (64, 4096)]]
        print(f"sweep decode {block_n:4d} {warps:2d} {stages:2d} | "
              + " ".join(f"{t:8.1f}" for t in times))
    print("sweep decode splits | us per (batch, ctx) = (1,4096) (1,1024) (8,4096)")
    for splits in [4, 8, 16, 32, 64]:
        config = DecodeConfig(num_splits=splits)
        times = [decode_case(b, c, config)[0] * 1e6 for b, c in [(1, 4096), (1, 1024), (8, 4096)]]
        print(f"sweep splits {splits:3d} | " + " ".join(f"{t:8.1f}" for t in times))
    print("sweep prefill: block_m block_n warps stages | ms (4096,4096) (4096,512)")
    for block_m, block_n, warps, stages in [(64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 4, 3),
                                            (64, 64, 8, 2), (64, 128, 4, 2), (64, 128, 8, 2),
                                            (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)]:
        config = PrefillConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        times = [prefill_case(c, m, config)[0] * 1e3 for c, m in [(4096, 4096), (4096, 512)]]
        print(f"sweep prefill {block_m:4d} {block_n:4d} {warps:2d} {stages:2d} | "
              + " ".join(f"{t:8.3f}" for t in times))


if __name__ == "__main__":
    main()

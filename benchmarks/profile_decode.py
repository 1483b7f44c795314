"""Where a decode step's time goes: GPU kernels (torch profiler) vs. host work between them.

Builds one engine, starts B sequences in the decode state (bench_common.start_decode_batch), times
`engine.step()`, the graph replay alone (CUDA events, inputs already written), and prints the
profiler's kernel table for a few steps.

    python benchmarks/profile_decode.py --model synthetic:llama-3-8b --batch 1 --context 128
    python benchmarks/profile_decode.py --batch 256 --context 512 --adapters 200 --lora-rank 8 \
        --targets q_proj,k_proj,v_proj,o_proj
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(__file__)]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_common import fill_kv_random, start_decode_batch  # noqa: E402
from loraserve.config import EngineArgs  # noqa: E402
from loraserve.engine.engine import LLMEngine  # noqa: E402
from loraserve.lora.synthetic import random_adapter  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:llama-3-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--adapters", type=int, default=0, help="distinct adapters (0: no LoRA engine)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--targets", default="", help="comma-separated PEFT module names (default: every module)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    lora = {}
    if args.adapters:
        lora = dict(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.lora_rank)
    engine = LLMEngine.from_args(EngineArgs(args.model, max_model_len=args.context + 256,
                                            max_num_seqs=max(args.batch, 1), gpu_memory_utilization=0.85, **lora))
    names = []
    targets = tuple(args.targets.split(",")) if args.targets else None
    for i in range(args.adapters):
        adapter = random_adapter(engine.lora_manager.runtime.spec, f"a{i}", args.lora_rank, targets, seed=i)
        engine.lora_manager.register_adapter(f"a{i}", adapter)
        names.append(f"a{i}")
    fill_kv_random(engine)
    start_decode_batch(engine, args.batch, args.context, args.steps + 40, names or [None])
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    gr = engine.runner.graph_runner
    bucket = gr.bucket_for(args.batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = []
    for _ in range(args.steps):
        start.record()
        gr.graphs[bucket].replay()
        end.record()
        end.synchronize()
        replays.append(start.elapsed_time(end) / 1e3)
    print(f"{args.model} B={args.batch} ctx={args.context} adapters={args.adapters} rank={args.lora_rank}: "
          f"step {np.median(walls) * 1e3:.3f} ms, graph replay alone {np.median(replays) * 1e3:.3f} ms, "
          f"outside the graph {(np.median(walls) - np.median(replays)) * 1e3:.3f} ms")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()

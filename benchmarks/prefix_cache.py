"""Prefix-caching benchmark: requests that share a system prompt, with the prefix cache off and on, over
0, 8 and 64 adapters.

N requests (default 256), each the same --system-len-token system prompt (default 1,024 random ids)
followed by a user turn of --turn-len tokens (default 32-256, random), --output-len tokens out (ignore_eos,
greedy), all at t=0 or by a Poisson process with --request-rate. The trace runs on a base engine
(0 adapters) and on a LoRA engine whose requests name one of 8 or 64 adapters (uniform; rank --lora-rank
on all 7 projections; every name its own adapter to the engine, the weights repeating every 8 names), each
engine built once with prefix caching off and once with it on. The system prompt is the same for every
adapter, so its blocks are cached once per adapter, never shared across adapters. Before each timed run a
few short requests warm the engine up (and load the adapters, when the pool holds them all) and the prefix
cache is emptied.

Per run: TTFT p50/p99, prompt tokens computed (prompt positions the model ran, counted from the scheduled
steps, recompute after preemption included), output tok/s, prefix cache hits, preemptions. Per adapter
count, caching on against off: the share of the shared part (N x system prompt tokens) no longer computed,
the TTFT p50 speed-up and the output tok/s ratio. Checks (0 and 8 adapters): >= 90 % of the shared part not
computed, TTFT p50 >= 3x faster. --quick: 24 requests, a 64-token system prompt, turns of 8-32 tokens,
8 output tokens (the CPU tiny model: `--model synthetic:tiny --device cpu`). Writes prefix_cache.json to
--out.

    python benchmarks/prefix_cache.py --out DIR            (synthetic Llama-3-8B on the GPU)
    loraserve bench prefix-cache --adapters 0,8 --request-rate 20
    python benchmarks/prefix_cache.py --model synthetic:tiny --device cpu --quick --out /tmp/pc
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402
import throughput  # noqa: E402
from loraserve.config import EngineArgs  # noqa: E402
from loraserve.engine.engine import LLMEngine  # noqa: E402
from loraserve.sequence import SchedulerOutput  # noqa: E402

SAVED_TARGET = 0.9  # share of the shared prompt part no longer computed, with caching on
TTFT_TARGET = 3.0  # TTFT p50 off / on
CHECKED_ADAPTER_COUNTS = (0, 8)
WARMUP_REQUESTS, WARMUP_TOKENS = 4, 8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, "synthetic:llama-3-8b")
    p.add_argument("--adapters", type=str, default="0,8,64", help="adapter counts to run, e.g. 0,8,64 (0: base)")
    p.add_argument("--num-requests", type=int, default=None, help="default 256 (24 with --quick)")
    p.add_argument("--system-len", type=int, default=None, help="shared system prompt tokens (default 1024; 64)")
    p.add_argument("--turn-len", type=throughput.length_range, default=None,
                   help="MIN,MAX user turn tokens (default 32,256; 8,32 with --quick)")
    p.add_argument("--output-len", type=throughput.length_range, default=None,
                   help="MIN,MAX output tokens (default 64,64; 8,8 with --quick)")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all at t=0)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=None, help="distinct adapters in one step (default: the engine's)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = p.parse_args(argv)
    try:
        args.adapters = sorted({int(v) for v in args.adapters.split(",") if v.strip()})
    except ValueError:
        p.error(f"--adapters takes comma-separated counts, got {args.adapters!r}")
    if not args.adapters or min(args.adapters) < 0:
        p.error("--adapters takes counts >= 0")
    args.num_requests = args.num_requests or (24 if args.quick else 256)
    args.system_len = args.system_len or (64 if args.quick else 1024)
    args.turn_len = args.turn_len or ((8, 32) if args.quick else (32, 256))
    args.output_len = args.output_len or ((8, 8) if args.quick else (64, 64))
    if args.request_rate is not None and args.request_rate <= 0:
        p.error("--request-rate must be positive")
    return args


@contextlib.contextmanager
def count_prompt_tokens(engine) -> Iterator[list[int]]:
    """Wrap engine.scheduler.schedule (an instance attribute over the method, removed on exit) to count the
    prompt positions each step computes; yields a one-element list holding the running total."""
    total = [0]
    schedule = engine.scheduler.schedule

    def counted() -> SchedulerOutput:
        out = schedule()
        for item in out.scheduled:
            start, prompt_len = item.seq.num_computed_tokens, len(item.seq.prompt_token_ids)
            total[0] += max(0, min(start + item.num_new_tokens, prompt_len) - start)
        return out

    engine.scheduler.schedule = counted
    try:
        yield total
    finally:
        del engine.scheduler.schedule


def make_trace(args, rng, vocab: int) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """(prompts, output lengths, arrival times): the shared system prompt + a random user turn each."""
    n = args.num_requests
    system = rng.integers(0, vocab, args.system_len).tolist()
    turns = rng.integers(args.turn_len[0], args.turn_len[1] + 1, n)
    prompts = [system + rng.integers(0, vocab, k).tolist() for k in turns]
    out_lens = rng.integers(args.output_len[0], args.output_len[1] + 1, n)
    arrivals = np.zeros(n) if args.request_rate is None else bc.poisson_arrivals(rng, args.request_rate, n)
    return prompts, out_lens, arrivals


def build_engine(args, device, lora: bool, caching: bool) -> tuple[LLMEngine, dict]:
    needed = args.system_len + args.turn_len[1] + args.output_len[1] + 1
    lora_options = dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.lora_rank) if lora else {}
    t0 = time.perf_counter()
    engine = LLMEngine.from_args(EngineArgs(
        args.model, device=device, dtype=args.dtype, max_model_len=needed, max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager, seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=caching, **lora_options))
    info = bc.engine_info(engine, time.perf_counter() - t0)
    if lora:
        bc.register_adapters(engine, max(args.adapters), [args.lora_rank])
    return engine, info


def warm_up(engine, args, num_adapters: int, rng) -> int:
    """Short random requests (kernel compilation), one per adapter too when the pool holds them all (the run
    then serves resident adapters); then the prefix cache is emptied. Returns the adapters loaded."""
    names = bc.resident_adapters(engine, num_adapters, [args.lora_rank]) if num_adapters else []
    vocab = engine.hf_config.vocab_size
    warm = [None] * WARMUP_REQUESTS + names
    throughput.run_loop(engine, [rng.integers(0, vocab, args.turn_len[0]).tolist() for _ in warm],
                        np.full(len(warm), WARMUP_TOKENS), np.zeros(len(warm)), warm, prefix=f"warmup-{num_adapters}")
    engine.block_manager.reset_prefix_cache()
    return len(names)


def run(engine, args, trace, num_adapters: int, rng) -> dict:
    """Replay the trace on `engine`, requests over `num_adapters` adapters (uniform; 0: base model)."""
    prompts, out_lens, arrivals = trace
    loaded = warm_up(engine, args, num_adapters, rng)
    names = [None] * len(prompts)
    if num_adapters:
        names = [f"lora-{i}" for i in rng.integers(0, num_adapters, len(prompts))]
    before, preempted = engine.stats(), engine.scheduler.num_preemptions
    with count_prompt_tokens(engine) as computed:
        elapsed, times, steps = throughput.run_loop(engine, prompts, out_lens, arrivals, names,
                                                    prefix=f"run-{num_adapters}")
    after = engine.stats()
    short = [rid for (rid, t), n in zip(times.items(), out_lens) if len(t) != n]
    if short:
        raise RuntimeError(f"{len(short)} requests got a different number of tokens than asked, e.g. {short[0]}")
    ttft = [t[0] - a for t, a in zip(times.values(), arrivals)]
    out_tokens = int(out_lens.sum())
    return {"adapters": num_adapters, "prefix_caching": engine.config.cache.enable_prefix_caching,
            "adapters_loaded_before": loaded, "requests": len(prompts), "elapsed_s": elapsed, "engine_steps": steps,
            "prompt_tokens": sum(len(p) for p in prompts), "shared_tokens": len(prompts) * args.system_len,
            "prompt_tokens_computed": computed[0], "output_tokens": out_tokens, "output_tok_s": out_tokens / elapsed,
            "ttft_s": bc.percentiles(ttft, (50, 99)),
            "prefix_cache_queries": after.prefix_cache_queries - before.prefix_cache_queries,
            "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
            "preemptions": engine.scheduler.num_preemptions - preempted}


def compare(off: dict, on: dict) -> dict:
    """Caching on against off for one adapter count."""
    return {"shared_part_saved": (off["prompt_tokens_computed"] - on["prompt_tokens_computed"]) / on["shared_tokens"],
            "prompt_tokens_computed_ratio": on["prompt_tokens_computed"] / off["prompt_tokens_computed"],
            "ttft_p50_speedup": off["ttft_s"]["p50"] / on["ttft_s"]["p50"],
            "ttft_p99_speedup": off["ttft_s"]["p99"] / on["ttft_s"]["p99"],
            "output_tok_s_ratio": on["output_tok_s"] / off["output_tok_s"]}


def make_checks(comparisons: dict[int, dict]) -> list[bc.Check]:
    checks = []
    for n in CHECKED_ADAPTER_COUNTS:
        c = comparisons.get(n)
        if c is None:
            continue
        checks.append(bc.Check(f"{n} adapters: shared prompt part not computed with caching",
                               f"{c['shared_part_saved']:.1%}", f">= {SAVED_TARGET:.0%}",
                               c["shared_part_saved"] >= SAVED_TARGET))
        checks.append(bc.Check(f"{n} adapters: TTFT p50 off / on", f"{c['ttft_p50_speedup']:.2f}x",
                               f">= {TTFT_TARGET:g}x", c["ttft_p50_speedup"] >= TTFT_TARGET))
    return checks


def print_results(runs: list[dict], comparisons: dict[int, dict], args, device) -> None:
    arrivals = "all at t=0" if args.request_rate is None else f"Poisson {args.request_rate:g}/s"
    print(f"\n{args.model} on {device}: {args.num_requests} requests, a {args.system_len}-token system prompt + "
          f"{args.turn_len[0]}-{args.turn_len[1]}-token turns, {args.output_len[0]}-{args.output_len[1]} output "
          f"tokens, {arrivals}")
    headers = ["adapters", "caching", "TTFT p50 ms", "p99 ms", "prompt tok computed", "of all", "output tok/s",
               "hits", "preempt", "s"]
    rows = [[r["adapters"], "on" if r["prefix_caching"] else "off", 1e3 * r["ttft_s"]["p50"], 1e3 * r["ttft_s"]["p99"],
             r["prompt_tokens_computed"], f"{r['prompt_tokens_computed'] / r['prompt_tokens']:.1%}",
             r["output_tok_s"], r["prefix_cache_hits"], r["preemptions"], r["elapsed_s"]] for r in runs]
    bc.print_table(headers, rows)
    for n, c in comparisons.items():
        print(f"  {n} adapters, on / off: {c['shared_part_saved']:.1%} of the shared part not computed, TTFT p50 "
              f"{c['ttft_p50_speedup']:.2f}x and p99 {c['ttft_p99_speedup']:.2f}x faster, output tok/s "
              f"x{c['output_tok_s_ratio']:.3f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = bc.bench_device(args.device)
    needed = args.system_len + args.turn_len[1] + args.output_len[1] + 1
    limit = bc.model_max_len(args.model)
    if limit is not None and needed > limit:
        raise SystemExit(f"system prompt + turn + output lengths need {needed} positions; {args.model} has {limit}")
    rng = np.random.default_rng(args.seed)
    trace = make_trace(args, rng, bc.model_vocab_size(args.model))
    runs: list[dict] = []
    engines: dict[str, dict] = {}
    report = {"benchmark": "prefix_cache", "args": vars(args), "env": bc.environment(device), "engines": engines,
              "runs": runs}
    for lora in (False, True):
        counts = [n for n in args.adapters if (n > 0) == lora]
        if not counts:
            continue
        for caching in (False, True):
            engine, engines[f"{'lora' if lora else 'base'}-{'on' if caching else 'off'}"] = \
                build_engine(args, device, lora, caching)
            for n in counts:
                runs.append(run(engine, args, trace, n, np.random.default_rng([args.seed, n])))
                bc.write_json(args.out, "prefix_cache.json", report)  # partial
            del engine
            bc.release_memory()
    comparisons = {n: compare(*sorted((r for r in runs if r["adapters"] == n), key=lambda r: r["prefix_caching"]))
                   for n in args.adapters}
    report["comparisons"] = comparisons
    print_results(runs, comparisons, args, device)
    report["checks"] = checks = make_checks(comparisons)
    bc.print_checks(checks)
    bc.print_engines(engines, with_kv_blocks=True)
    bc.write_json(args.out, "prefix_cache.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

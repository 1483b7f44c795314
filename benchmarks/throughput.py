"""Throughput benchmark: many requests through the engine loop, real prefill and decode.

N requests with random prompt ids of random lengths and random output lengths
(ignore_eos, greedy) all arrive at t=0, or by a Poisson process with
--request-rate. The loop adds arrived requests and calls `engine.step()`; every
output token gets a timestamp when its step returns. Reports output tokens/s,
requests/s, and p50/p90/p99 of time to first token (TTFT, from arrival),
inter-token latency (ITL, gaps between a request's tokens) and end-to-end
latency. A few short requests run first as a warm-up (kernel compilation).
Writes throughput.json to --out.

    python benchmarks/throughput.py [--num-requests 256] [--request-rate 20] [--out DIR]
    python benchmarks/throughput.py --model synthetic:tiny --device cpu --quick --out /tmp/b
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402
from loraserve import SamplingParams  # noqa: E402
from loraserve.config import EngineArgs  # noqa: E402
from loraserve.engine.engine import LLMEngine  # noqa: E402


def length_range(text: str) -> tuple[int, int]:
    """'128,1024' -> (128, 1024), inclusive."""
    values = bc.int_list(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX, got {text!r}")
    return values[0], values[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, "synthetic:llama-3-8b")
    p.add_argument("--num-requests", type=int, default=None, help="default 256 (8 with --quick)")
    p.add_argument("--prompt-len", type=length_range, default=None, help="MIN,MAX prompt tokens (default 128,1024)")
    p.add_argument("--output-len", type=length_range, default=None, help="MIN,MAX output tokens (default 128,512)")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all at t=0)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch the next step before reading the current one's tokens")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = p.parse_args(argv)
    args.num_requests = args.num_requests or (8 if args.quick else 256)
    args.prompt_len = args.prompt_len or ((16, 64) if args.quick else (128, 1024))
    args.output_len = args.output_len or ((8, 32) if args.quick else (128, 512))
    if args.request_rate is not None and args.request_rate <= 0:
        p.error("--request-rate must be positive")
    return args


def warm_up(engine, vocab: int, prompt_len: int, rng) -> None:
    """A few short requests, so kernel compilation and first-use costs fall outside the timing."""
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    for i in range(4):
        engine.add_request(f"warmup-{i}", rng.integers(0, vocab, prompt_len).tolist(), params)
    while engine.has_unfinished_requests():
        engine.step()


def run_loop(engine, prompts: list[list[int]], out_lens: np.ndarray, arrivals: np.ndarray) -> tuple[float, dict]:
    """Submit requests at their arrival times and step until all finish; returns (seconds, token times)."""
    times: dict[str, list[float]] = {f"req-{i}": [] for i in range(len(prompts))}
    nxt = 0
    start = time.perf_counter()
    while nxt < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while nxt < len(prompts) and arrivals[nxt] <= now:
            params = SamplingParams(max_tokens=int(out_lens[nxt]), ignore_eos=True, temperature=0.0)
            engine.add_request(f"req-{nxt}", prompts[nxt], params)
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        outputs = engine.step()
        stamp = time.perf_counter() - start
        for out in outputs:
            got = times[out.request_id]
            got.extend([stamp] * (len(out.outputs[0].token_ids) - len(got)))
    return time.perf_counter() - start, times


def main(argv=None) -> int:
    args = parse_args(argv)
    device = bc.bench_device(args.device)
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    prompt_lens = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, n)
    out_lens = rng.integers(args.output_len[0], args.output_len[1] + 1, n)
    if args.request_rate is None:
        arrivals = np.zeros(n)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / args.request_rate, n))
    needed = args.prompt_len[1] + args.output_len[1] + 1
    limit = bc.model_max_len(args.model)
    if limit is not None and needed > limit:
        raise SystemExit(f"prompt + output lengths need {needed} positions; {args.model} has {limit}")
    t0 = time.perf_counter()
    engine = LLMEngine.from_args(EngineArgs(
        args.model, device=device, dtype=args.dtype, max_model_len=needed, max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager, seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization,
        async_scheduling=args.async_scheduling))
    info = bc.engine_info(engine, time.perf_counter() - t0)
    vocab = engine.hf_config.vocab_size
    prompts = [rng.integers(0, vocab, k).tolist() for k in prompt_lens]
    warm_up(engine, vocab, args.prompt_len[0], rng)
    print(f"{n} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, outputs "
          f"{args.output_len[0]}-{args.output_len[1]} tokens, "
          + ("all at t=0" if args.request_rate is None else f"Poisson {args.request_rate}/s"))
    preempted_before = engine.scheduler.num_preemptions
    elapsed, times = run_loop(engine, prompts, out_lens, arrivals)
    short = [rid for i, (rid, t) in enumerate(times.items()) if len(t) != out_lens[i]]
    if short:
        raise RuntimeError(f"{len(short)} requests got a different number of tokens than asked, e.g. {short[0]}")
    stamps = list(times.values())
    ttft = [t[0] - a for t, a in zip(stamps, arrivals)]
    e2e = [t[-1] - a for t, a in zip(stamps, arrivals)]
    itl = [float(d) for t in stamps for d in np.diff(t)]
    total_out = int(out_lens.sum())
    result = {"elapsed_s": elapsed, "output_tokens": total_out, "prompt_tokens": int(prompt_lens.sum()),
              "output_tok_s": total_out / elapsed, "total_tok_s": (total_out + int(prompt_lens.sum())) / elapsed,
              "requests_per_s": n / elapsed, "preemptions": engine.scheduler.num_preemptions - preempted_before,
              "ttft_s": bc.percentiles(ttft), "itl_s": bc.percentiles(itl), "e2e_s": bc.percentiles(e2e)}
    mode = "eager" if args.enforce_eager or info["num_graphs"] == 0 else f"{info['num_graphs']} CUDA graphs"
    print(f"{args.model} on {device} ({mode}): {elapsed:.1f} s, {result['output_tok_s']:.0f} output tok/s, "
          f"{result['total_tok_s']:.0f} total tok/s, {result['requests_per_s']:.2f} req/s, "
          f"{result['preemptions']} preemptions")
    bc.print_table(["ms", "p50", "p90", "p99"],
                   [[name] + [1e3 * v if v is not None else None for v in result[key].values()]
                    for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))])
    bc.write_json(args.out, "throughput.json", {"benchmark": "throughput", "args": vars(args),
                                                "env": bc.environment(device), "engine": info, "result": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())

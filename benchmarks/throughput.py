"""Throughput benchmark: many requests through the engine loop, real prefill and decode.

N requests with random prompt ids of random lengths and random output lengths
(ignore_eos, greedy) all arrive at t=0, or by a Poisson process with
--request-rate. The loop adds arrived requests and calls `engine.step()`; every
output token gets a timestamp when its step returns. Reports output tokens/s,
requests/s, and p50/p90/p99 of time to first token (TTFT, from arrival),
inter-token latency (ITL, gaps between a request's tokens) and end-to-end
latency. A few short requests run first as a warm-up (kernel compilation);
on a LoRA engine whose pool holds every adapter, one for each adapter too, so
the trace runs over resident adapters (else their loads are part of it). The
trace is replayed --replays times on each engine (default 2) and the last
replay is reported; every replay's time is printed. The last replay's schedule calls are timed and split by
the kind of step (decode rows only; with prompt tokens; nothing to run): their count, seconds and median
period (with async scheduling a step's period ends at the next schedule call), and with adapters the LoRA /
base ratio of each kind's seconds.
With --adapters N the same trace runs on the base engine and then on a LoRA
engine (default pool and limits, or --max-loras / --lora-gpu-memory) whose requests each name one of N random
adapters of rank --lora-rank (or ranks in turn) on all 7 projections, drawn uniformly or with
Zipf popularity (adapter i with probability proportional to 1/(i+1)); every
name is its own adapter to the engine (its own cache entry and slot writes),
though the weights repeat every 8 names. Both runs are printed with the ratio
of output tokens/s and of engine steps. --prefill-only gives every request one
output token (prompt tokens/s). Prefix caching is on, as in the engine, and the prefix cache is emptied
before each replay (the prompts share nothing else); --prefix-caching off turns it off, both runs every
engine with it off and then on and prints the ratio of output tokens/s. Writes throughput.json to --out.

    python benchmarks/throughput.py [--num-requests 256] [--request-rate 20] [--out DIR]
    python benchmarks/throughput.py --num-requests 512 --prompt-len 64,512 --output-len 128,128 --adapters 64
    python benchmarks/throughput.py --prefix-caching both --out DIR
    python benchmarks/throughput.py --model synthetic:tiny --device cpu --quick --out /tmp/b
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402
from loraserve import SamplingParams  # noqa: E402
from loraserve.config import EngineArgs  # noqa: E402
from loraserve.engine.engine import LLMEngine  # noqa: E402
from loraserve.lora.request import LoRARequest  # noqa: E402
from loraserve.sequence import SchedulerOutput  # noqa: E402


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
    p.add_argument("--adapters", type=int, default=0, help="run a LoRA engine too, requests over N adapters")
    p.add_argument("--adapter-dist", choices=("uniform", "zipf"), default="uniform")
    p.add_argument("--lora-rank", type=bc.int_list, default=[16],
                   help="rank of the adapters, or ranks cycled over them (e.g. 8,16,32,64)")
    p.add_argument("--max-loras", type=int, default=None,
                   help="distinct adapters in one step of the LoRA engine (default: the engine's)")
    p.add_argument("--lora-gpu-memory", type=float, default=None,
                   help="GiB of the LoRA engine's adapter pool (default: the engine's)")
    p.add_argument("--prefill-only", action="store_true", help="one output token per request (prompt tok/s)")
    p.add_argument("--prefix-caching", choices=("on", "off", "both"), default="on",
                   help="the engines' prefix caching; both: each engine off, then on (default on)")
    p.add_argument("--replays", type=int, default=2,
                   help="replay the trace this many times on each engine and report the last (default 2)")
    args = p.parse_args(argv)
    if args.prefill_only:
        args.output_len = (1, 1)
    args.num_requests = args.num_requests or (8 if args.quick else 256)
    args.prompt_len = args.prompt_len or ((16, 64) if args.quick else (128, 1024))
    args.output_len = args.output_len or ((8, 32) if args.quick else (128, 512))
    if args.replays < 1:
        p.error("--replays must be at least 1")
    if args.request_rate is not None and args.request_rate <= 0:
        p.error("--request-rate must be positive")
    return args


def warm_up(engine, vocab: int, prompt_len: int, rng, adapters: list[str]) -> None:
    """A few short requests, and one for each of `adapters`, so kernel compilation and first-use costs
    (adapter loads included) fall outside the timing."""
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    for i, name in enumerate([None] * 4 + adapters):
        engine.add_request(f"warmup-{i}", rng.integers(0, vocab, prompt_len).tolist(), params,
                           LoRARequest(name) if name is not None else None)
    while engine.has_unfinished_requests():
        engine.step()


class StepRecord(NamedTuple):
    """One launched step, as scheduled."""

    num_seqs: int
    num_decode: int  # sequences past their prompt (one new token each)
    prefill_tokens: int  # tokens of the other sequences (prompt chunks, recompute after preemption)
    context_tokens: int  # sum over sequences of the tokens attention reads (computed + new)
    adapters: frozenset[str]  # distinct adapters of the step
    pool_bytes_used: int  # the adapter pool's use when the step was scheduled (0: no LoRA)


STEP_KINDS = ("decode", "prompt", "idle")  # decode rows only; with prompt tokens; nothing to run (schedule empty)
STEP_LABELS = {"decode": "decode-only steps", "prompt": "steps with prompt tokens", "idle": "empty schedules"}


@dataclass
class StepLog:
    """The recorded steps, and per schedule call its time and kind (STEP_KINDS)."""

    steps: list[StepRecord]
    marks: list[tuple[float, str]]  # (perf_counter at the call, kind)

    def _periods(self, end: float) -> list[tuple[str, float]]:
        """Per schedule call: its kind and the seconds to the next call (the last one's to `end`): the engine's
        period for that kind of step (with async scheduling a step's time ends at the next schedule)."""
        calls = [t for t, _ in self.marks] + [end]
        return [(kind, later - t) for (t, kind), later in zip(self.marks, calls[1:])]

    def seconds_by_kind(self, end: float) -> dict[str, dict]:
        """Per kind: schedule calls, their periods' seconds and the median period (with async scheduling a
        decode-only period after a prompt step also carries that step's GPU time: the median is the typical
        decode step, the sum is where the wall time went)."""
        periods = {kind: [] for kind in STEP_KINDS}
        for kind, seconds in self._periods(end):
            periods[kind].append(seconds)
        return {kind: {"calls": len(p), "seconds": float(sum(p)), "p50_s": float(np.median(p)) if p else None}
                for kind, p in periods.items()}

    def trace(self, end: float) -> list[list]:
        """Per recorded step, in order: [its period's seconds, prompt tokens, decode rows, distinct adapters] (the
        JSON's step_trace: where a run's time goes, step by step)."""
        busy = [seconds for kind, seconds in self._periods(end) if kind != "idle"]
        return [[round(seconds, 6), s.prefill_tokens, s.num_decode, len(s.adapters)]
                for seconds, s in zip(busy, self.steps)]


@contextlib.contextmanager
def record_steps(engine) -> Iterator[StepLog]:
    """Wrap engine.scheduler.schedule (an instance attribute over the method, removed on exit) so that each
    non-empty step it makes is recorded, before the engine advances its sequences, and every call is timed."""
    log = StepLog([], [])
    schedule = engine.scheduler.schedule
    manager = engine.lora_manager

    def recorded() -> SchedulerOutput:
        pool_used = manager.pool_bytes_used if manager is not None else 0
        called = time.perf_counter()
        out = schedule()
        if out.is_empty:
            log.marks.append((called, "idle"))
        else:
            decode = [s for s in out.scheduled if s.seq.num_computed_tokens >= len(s.seq.prompt_token_ids)]
            prefill_tokens = out.num_tokens - len(decode)
            log.steps.append(StepRecord(
                len(out.scheduled), len(decode), prefill_tokens,
                sum(s.seq.num_computed_tokens + s.num_new_tokens for s in out.scheduled),
                frozenset(s.seq.lora_name for s in out.scheduled if s.seq.lora_name is not None), pool_used))
            log.marks.append((called, "prompt" if prefill_tokens else "decode"))
        return out

    engine.scheduler.schedule = recorded
    try:
        yield log
    finally:
        del engine.scheduler.schedule


def run_loop(engine, prompts: list[list[int]], out_lens: np.ndarray, arrivals: np.ndarray,
             adapters: list[str | None], prefix: str = "req") -> tuple[float, dict, int]:
    """Submit requests (ids prefix-0, prefix-1, ...) at their arrival times and step until all finish;
    returns (seconds, token times, engine steps)."""
    times: dict[str, list[float]] = {f"{prefix}-{i}": [] for i in range(len(prompts))}
    nxt, steps = 0, 0
    start = time.perf_counter()
    while nxt < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while nxt < len(prompts) and arrivals[nxt] <= now:
            params = SamplingParams(max_tokens=int(out_lens[nxt]), ignore_eos=True, temperature=0.0)
            lora = LoRARequest(adapters[nxt]) if adapters[nxt] is not None else None
            engine.add_request(f"{prefix}-{nxt}", prompts[nxt], params, lora)
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        outputs = engine.step()
        steps += 1
        stamp = time.perf_counter() - start
        for out in outputs:
            got = times[out.request_id]
            got.extend([stamp] * (len(out.outputs[0].token_ids) - len(got)))
    return time.perf_counter() - start, times, steps


def request_adapters(args, rng, n: int) -> list[str]:
    """The adapter of each request: one of args.adapters names, uniform or Zipf."""
    weights = np.ones(args.adapters) if args.adapter_dist == "uniform" else 1.0 / np.arange(1, args.adapters + 1)
    picks = rng.choice(args.adapters, size=n, p=weights / weights.sum())
    return [f"lora-{i}" for i in picks]


def run_engine(args, device, lora: bool, prompts, out_lens, arrivals, adapters, rng, caching: bool = True) -> dict:
    """Build one engine, warm it up, replay the trace; the engine is freed on return."""
    needed = args.prompt_len[1] + args.output_len[1] + 1
    lora_options = dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=max(args.lora_rank),
                        lora_gpu_memory=args.lora_gpu_memory) if lora else {}
    t0 = time.perf_counter()
    engine = LLMEngine.from_args(EngineArgs(
        args.model, device=device, dtype=args.dtype, max_model_len=needed, max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager, seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization,
        async_scheduling=args.async_scheduling, enable_prefix_caching=caching, **lora_options))
    info = bc.engine_info(engine, time.perf_counter() - t0)
    warmed: list[str] = []
    if lora:
        bc.register_adapters(engine, args.adapters, args.lora_rank)
        warmed = bc.resident_adapters(engine, args.adapters, args.lora_rank)
    warm_up(engine, engine.hf_config.vocab_size, args.prompt_len[0], rng, warmed)
    replays = []
    for replay in range(args.replays):  # the last one counts; the earlier ones warm the engine up
        engine.block_manager.reset_prefix_cache()  # no replay reuses the prompts of the one before
        preempted_before = engine.scheduler.num_preemptions
        last = replay == args.replays - 1  # only its steps are recorded: the others run as they did before
        with record_steps(engine) if last else contextlib.nullcontext() as log:
            elapsed, times, steps = run_loop(engine, prompts, out_lens, arrivals,
                                             adapters if lora else [None] * len(prompts), prefix=f"r{replay}")
            end = time.perf_counter()
        replays.append(elapsed)
    short = [rid for i, (rid, t) in enumerate(times.items()) if len(t) != out_lens[i]]
    if short:
        raise RuntimeError(f"{len(short)} requests got a different number of tokens than asked, e.g. {short[0]}")
    stamps = list(times.values())
    ttft = [t[0] - a for t, a in zip(stamps, arrivals)]
    e2e = [t[-1] - a for t, a in zip(stamps, arrivals)]
    itl = [float(d) for t in stamps for d in np.diff(t)]
    total_out, total_in, n = int(out_lens.sum()), sum(len(p) for p in prompts), len(prompts)
    result = {"engine": info, "elapsed_s": elapsed, "output_tokens": total_out, "prompt_tokens": total_in,
              "output_tok_s": total_out / elapsed, "total_tok_s": (total_out + total_in) / elapsed,
              "requests_per_s": n / elapsed, "engine_steps": steps,
              "preemptions": engine.scheduler.num_preemptions - preempted_before, "adapters_resident": len(warmed),
              "replay_seconds": replays, "step_seconds": log.seconds_by_kind(end),
              "ttft_s": bc.percentiles(ttft), "itl_s": bc.percentiles(itl), "e2e_s": bc.percentiles(e2e)}
    del engine
    bc.release_memory()
    return result


def print_result(name: str, result: dict, device) -> None:
    info = result["engine"]
    mode = "eager" if info["num_graphs"] == 0 else f"{info['num_graphs']} CUDA graphs"
    print(f"{name} on {device} ({mode}): {result['elapsed_s']:.1f} s, {result['output_tok_s']:.0f} output tok/s, "
          f"{result['prompt_tokens'] / result['elapsed_s']:.0f} prompt tok/s, "
          f"{result['total_tok_s']:.0f} total tok/s, {result['requests_per_s']:.2f} req/s, "
          f"{result['engine_steps']} engine steps, {result['preemptions']} preemptions"
          + (f", {result['adapters_resident']} adapters loaded before timing" if result["adapters_resident"] else "")
          + (f"; replays took {', '.join(f'{t:.2f}' for t in result['replay_seconds'])} s"
             if len(result["replay_seconds"]) > 1 else ""))
    split = result["step_seconds"]
    print("  " + ", ".join(f"{split[kind]['calls']} {label} {split[kind]['seconds']:.2f} s"
                           + (f" (median {1e3 * split[kind]['p50_s']:.2f} ms)" if split[kind]["calls"] else "")
                           for kind, label in STEP_LABELS.items()))
    bc.print_table(["ms", "p50", "p90", "p99"],
                   [[label] + [1e3 * v if v is not None else None for v in result[key].values()]
                    for label, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))])


def main(argv=None) -> int:
    args = parse_args(argv)
    device = bc.bench_device(args.device)
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    prompt_lens = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, n)
    out_lens = rng.integers(args.output_len[0], args.output_len[1] + 1, n)
    arrivals = np.zeros(n) if args.request_rate is None else bc.poisson_arrivals(rng, args.request_rate, n)
    needed = args.prompt_len[1] + args.output_len[1] + 1
    limit = bc.model_max_len(args.model)
    if limit is not None and needed > limit:
        raise SystemExit(f"prompt + output lengths need {needed} positions; {args.model} has {limit}")
    vocab = bc.model_vocab_size(args.model)
    prompts = [rng.integers(0, vocab, k).tolist() for k in prompt_lens]
    adapters = request_adapters(args, rng, n) if args.adapters else []
    print(f"{n} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, outputs "
          f"{args.output_len[0]}-{args.output_len[1]} tokens, "
          + ("all at t=0" if args.request_rate is None else f"Poisson {args.request_rate}/s")
          + (f"; LoRA: {args.adapters} adapters ({args.adapter_dist}), rank {','.join(map(str, args.lora_rank))}, "
             f"max_loras {args.max_loras or 'default'}, pool {args.lora_gpu_memory or 'default'} GiB"
             if args.adapters else ""))
    results = {}
    cachings = {"on": [True], "off": [False], "both": [False, True]}[args.prefix_caching]
    for lora in [False, True] if args.adapters else [False]:
        kind = "lora" if lora else "base"
        for caching in cachings:
            name = kind + ("" if caching else "-no-prefix-caching")
            results[name] = run_engine(args, device, lora, prompts, out_lens, arrivals, adapters, rng, caching)
            print_result(f"{args.model}{' + LoRA' if lora else ''}, prefix caching {'on' if caching else 'off'}",
                         results[name], device)
        if args.prefix_caching == "both":
            on, off = results[kind], results[f"{kind}-no-prefix-caching"]
            print(f"{kind}, prefix caching on / off: output tok/s {on['output_tok_s'] / off['output_tok_s']:.3f}, "
                  f"TTFT p50 {on['ttft_s']['p50'] / off['ttft_s']['p50']:.3f}")
    if args.adapters:
        suffix = "" if args.prefix_caching != "off" else "-no-prefix-caching"
        base, lora = results["base" + suffix], results["lora" + suffix]
        print(f"LoRA / base: output tok/s {lora['output_tok_s'] / base['output_tok_s']:.3f}, total tok/s "
              f"{lora['total_tok_s'] / base['total_tok_s']:.3f}, engine steps "
              f"{lora['engine_steps'] / base['engine_steps']:.2f}x ({lora['engine_steps']} / {base['engine_steps']})"
              + "".join(f", {label} {lora['step_seconds'][kind]['seconds'] / base['step_seconds'][kind]['seconds']:.3f}x"
                        for kind, label in STEP_LABELS.items()
                        if kind != "idle" and base["step_seconds"][kind]["seconds"] > 0))
    bc.write_json(args.out, "throughput.json", {"benchmark": "throughput", "args": vars(args),
                                                "env": bc.environment(device), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Many-adapters benchmark: one request trace on the base engine and on LoRA engines serving 8 to 2000 adapters.

N requests with random prompt ids (--prompt-len) and fixed output lengths
(--output-len, ignore_eos, greedy) arrive all at t=0, or by a Poisson process
with --request-rate. The trace runs on the base engine, then once on one LoRA
engine per scenario (default pool and limits, or --max-loras /
--lora-gpu-memory; max_lora_rank = the scenario's largest rank), each request
naming one adapter. The base engine replays the trace once untimed before its
timed run: run first in the process, it was slower than LoRA runs of the same
steps (H200), and a first replay of a trace took 1.6x the second in the
throughput benchmark, so it was no steady baseline. The LoRA runs stay single,
their adapter loads included:

- N-uniform / N-zipf, N in 8, 64, 512: rank 16 on all 7 projections, adapters
  drawn uniformly or with Zipf popularity (adapter i with probability
  proportional to 1/(i+1));
- 2000-uniform / 2000-zipf: rank 8 on q/k/v/o_proj only;
- mixed: 64 adapters of ranks 8, 16, 32, 64 in turn on all projections, uniform;
- fairness: 90 % of the requests for one hot adapter, 10 % over 200 cold ones
  (rank 16, all projections), Poisson arrivals (--request-rate, default 200/s).

Every name is its own adapter to the engine: a PEFT folder under the
engine's --lora-root, read from disk by the engine on its first request (load
on first request, as a server with thousands of adapters runs), with its own
registration, host cache entry, pool pages and host-to-device copy; the
weights repeat every 8 names of a rank (random generation is slow: the
folders of one weights share their files through hard links, and the page
cache holds them). The engine's scheduler is wrapped to
record each launched step. Per run: output tok/s, engine steps, mean decode
batch (sequences decoding in the steps that decode) and their ratios to base,
mean distinct adapters per step, the run's floor and achieved/floor, adapter
bytes copied host-to-device, adapter reads (their median and total time against
the readers' time in the run), pool loads, evictions and use, TTFT p50/p99
overall and per popularity class (zipf: "hot" = the requests of the 10 % most
popular adapters, "cold" = the rest; fairness: the hot adapter and the cold
ones), ITL p50/p99, and the wall time split by the kind of step between
schedule calls (decode rows only; with prompt tokens; nothing to run, e.g.
waiting for adapter reads), and the decode waves: runs of 20 or more decode-only
steps with about the same distinct adapters (the requests of one output length
finish together), each with its median step time and its adapters' bytes over
the copy bandwidth (`decode_waves`). The floor of a step is max(bytes / copy
bandwidth, FLOPs / GEMM rate), both measured in the same run: bytes = weights +
KV read (context of every scheduled sequence) + the step's distinct adapters
(A + B in the model dtype), FLOPs = 2 x decoder-layer parameters x prompt tokens
computed in the step; achieved/floor = the sum of the floors over the wall time. Checks:
engine steps <= 1.15x base for the 64/512/2000 scenarios, LoRA achieved/floor
>= 0.9x base's, fairness: every request finished and cold p99 TTFT <= 3x hot
p99 TTFT. Each run's ratios are to the base engine's run on the same arrivals:
fairness, whose Poisson arrivals are its own, gets a base run on them
("base-poisson-<rate>"). --quick: 32 requests, prompts
16-64 and outputs of 16 tokens, at most 40 adapters per scenario (fairness: 40
cold ones). Writes many_adapters.json (and many_adapters.png: output tok/s
against adapter count, with matplotlib) to --out.

    python benchmarks/many_adapters.py [--scenarios 64-zipf,2000-uniform,fairness] [--request-rate 50] [--out DIR]
    loraserve bench many-adapters --model synthetic:llama-3.2-1b --num-requests 512 --out DIR
    python benchmarks/many_adapters.py --model synthetic:tiny --device cpu --quick \\
        --scenarios 8-uniform,64-zipf,mixed,fairness --out /tmp/ma
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bench_common as bc  # noqa: E402
import throughput  # noqa: E402
from loraserve.config import EngineArgs, resolve_dtype  # noqa: E402
from loraserve.engine.engine import LLMEngine  # noqa: E402
from loraserve.lora.synthetic import ALL_TARGETS, random_adapter  # noqa: E402

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
SCENARIOS = ("8-uniform", "8-zipf", "64-uniform", "64-zipf", "512-uniform", "512-zipf", "2000-uniform", "2000-zipf",
             "mixed", "fairness")
MIXED_RANKS = (8, 16, 32, 64)
QUICK_MAX_ADAPTERS = 40  # --quick: adapters per scenario at most (fairness: cold adapters)
HOT_ADAPTER_SHARE = 0.1  # zipf: the most popular 10 % of the adapters are "hot"
FAIRNESS_COLD, FAIRNESS_HOT_SHARE, FAIRNESS_RATE = 200, 0.9, 200.0  # cold adapters, hot requests, arrivals/s
STEPS_LIMIT = 1.15  # engine steps / base steps, 64/512/2000 scenarios
FLOOR_LIMIT = 0.9  # LoRA achieved/floor / base achieved/floor
FAIRNESS_LIMIT = 3.0  # cold p99 TTFT / hot p99 TTFT
WARMUP_REQUESTS, WARMUP_TOKENS = 4, 8


@dataclass(frozen=True)
class Scenario:
    """The adapters of a LoRA run and how requests pick them; adapter i has rank ranks[i % len(ranks)]."""

    name: str
    num_adapters: int
    ranks: tuple[int, ...]
    targets: tuple[str, ...]
    dist: str  # "uniform", "zipf" or "fairness" (adapter 0 hot, the others cold)

    def rank_of(self, i: int) -> int:
        return self.ranks[i % len(self.ranks)]

    def picks(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """The adapter index of each of n requests: [n] int."""
        if self.dist == "uniform":
            return rng.integers(0, self.num_adapters, n)
        if self.dist == "zipf":
            weights = 1.0 / np.arange(1, self.num_adapters + 1)
            return rng.choice(self.num_adapters, size=n, p=weights / weights.sum())
        cold = rng.integers(1, self.num_adapters, n)
        return np.where(rng.random(n) < FAIRNESS_HOT_SHARE, 0, cold)

    def popularity_class(self, i: int) -> str:
        """'hot' or 'cold' for adapter i (zipf, fairness); 'all' for uniform popularity."""
        if self.dist == "uniform":
            return "all"
        hot = 1 if self.dist == "fairness" else math.ceil(HOT_ADAPTER_SHARE * self.num_adapters)
        return "hot" if i < hot else "cold"


def make_scenario(name: str, quick: bool) -> Scenario:
    """The Scenario of a name in SCENARIOS; --quick caps its adapter count at QUICK_MAX_ADAPTERS."""
    def count(n: int) -> int:
        return min(n, QUICK_MAX_ADAPTERS) if quick else n

    if name == "mixed":
        return Scenario(name, count(64), MIXED_RANKS, ALL_TARGETS, "uniform")
    if name == "fairness":
        return Scenario(name, 1 + count(FAIRNESS_COLD), (16,), ALL_TARGETS, "fairness")
    n, dist = name.split("-")
    rank, targets = (8, ATTENTION_TARGETS) if n == "2000" else (16, ALL_TARGETS)
    return Scenario(name, count(int(n)), (rank,), targets, dist)


class Trace(NamedTuple):
    prompts: list[list[int]]  # token ids
    out_lens: np.ndarray  # [n] output tokens
    arrivals: np.ndarray  # [n] seconds from the start
    rate: float | None  # Poisson arrivals per second (None: all at t=0)


class Ceilings(NamedTuple):
    bandwidth: float  # bytes/s, copy (read + write)
    gemm_rate: float  # FLOP/s, square matmul in the model dtype


SMALL_PROMPT_STEP = 1024  # prompt tokens: steps with fewer are counted apart in the printed notes
WAVE_MIN_STEPS = 20  # decode-only steps in a row of about the same distinct adapters that make a "decode wave"
WAVE_SPREAD = 3  # distinct adapters by which a wave's steps may differ from its first


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, "synthetic:llama-3-8b")
    p.add_argument("--scenarios", type=bc.str_list, default=list(SCENARIOS), help=",".join(SCENARIOS))
    p.add_argument("--num-requests", type=int, default=None, help="default 1024 (32 with --quick)")
    p.add_argument("--prompt-len", type=throughput.length_range, default=None,
                   help="MIN,MAX prompt tokens (default 64,512; 16,64 with --quick)")
    p.add_argument("--output-len", type=throughput.length_range, default=None,
                   help="MIN,MAX output tokens (default 128,128; 16,16 with --quick)")
    p.add_argument("--request-rate", type=float, default=None,
                   help=f"Poisson arrivals per second (default: all at t=0; fairness: {FAIRNESS_RATE:g}/s)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch the next step before reading the current one's tokens")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-loras", type=int, default=None,
                   help="distinct adapters in one step of the LoRA engines (default: the engine's)")
    p.add_argument("--lora-gpu-memory", type=float, default=None,
                   help="GiB of the LoRA engines' adapter pool (default: the engine's)")
    args = p.parse_args(argv)
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}; choose from {','.join(SCENARIOS)}")
    args.num_requests = args.num_requests or (32 if args.quick else 1024)
    args.prompt_len = args.prompt_len or ((16, 64) if args.quick else (64, 512))
    args.output_len = args.output_len or ((16, 16) if args.quick else (128, 128))
    if args.request_rate is not None and args.request_rate <= 0:
        p.error("--request-rate must be positive")
    return args


def measure_gemm_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a square matmul in `dtype` (n = 8192 on CUDA, as lora_kernels.py's ceilings(); 512 on the CPU)."""
    n = 8192 if device.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    seconds = bc.median_seconds(lambda: a @ b, device, reps=10)
    a = b = None  # freed before empty_cache
    if device.type == "cuda":
        torch.cuda.empty_cache()  # engines size their KV cache from the free memory
    return 2 * n**3 / seconds


def decoder_layer_params(model: torch.nn.Module) -> int:
    """Matrix parameters of the decoder layers: the FLOPs of a prompt token are 2x this (the embedding is a
    lookup; lm_head runs on sampled tokens only, so leaving it out keeps the floor a lower bound)."""
    return sum(p.numel() for name, p in model.named_parameters() if ".layers." in name and p.dim() >= 2)


def run_floor(engine, steps: list[throughput.StepRecord], adapter_bytes: list[int], ceilings: Ceilings) -> dict:
    """The floor of the recorded steps, summed: per step max(bytes / bandwidth, FLOPs / GEMM rate); adapter_bytes:
    per step the bytes of its distinct adapters."""
    weights, kv_token = bc.weight_bytes(engine.runner.model), bc.kv_bytes_per_token(engine)
    params = decoder_layer_params(engine.runner.model)
    total = {"weight_bytes": 0, "kv_bytes": 0, "adapter_bytes": 0, "flops": 0, "byte_floor_s": 0.0,
             "flop_floor_s": 0.0, "floor_s": 0.0}
    for step, adapters in zip(steps, adapter_bytes):
        kv = step.context_tokens * kv_token
        flops = 2 * params * step.prefill_tokens
        byte_s, flop_s = (weights + kv + adapters) / ceilings.bandwidth, flops / ceilings.gemm_rate
        for key, value in (("weight_bytes", weights), ("kv_bytes", kv), ("adapter_bytes", adapters),
                           ("flops", flops), ("byte_floor_s", byte_s), ("flop_floor_s", flop_s),
                           ("floor_s", max(byte_s, flop_s))):
            total[key] += value
    total["bytes"] = total["weight_bytes"] + total["kv_bytes"] + total["adapter_bytes"]
    return total


def decode_waves(trace: list[list], adapter_bytes: list[int], bandwidth: float) -> list[dict]:
    """The run's decode waves: runs of at least WAVE_MIN_STEPS decode-only steps in a row, each after a decode-only
    step (its period then holds its own GPU time only), whose distinct adapters stay within WAVE_SPREAD of the
    run's first step. With one output length the requests of a wave finish together, so a step's distinct
    adapters hold for a wave and its time follows them. trace: the JSON's step_trace; adapter_bytes: per step
    the bytes of its distinct adapters. Per wave: its median distinct adapters, its steps, their median seconds
    and the median of their adapters' bytes over the copy bandwidth (seconds)."""
    waves, current = [], []
    for i, (_, prompt_tokens, decode_rows, adapters) in enumerate(trace):
        decode_only = i > 0 and prompt_tokens == 0 and decode_rows > 0 and trace[i - 1][1] == 0
        if decode_only and current and abs(adapters - trace[current[0]][3]) <= WAVE_SPREAD:
            current.append(i)
            continue
        if len(current) >= WAVE_MIN_STEPS:
            waves.append(current)
        current = [i] if decode_only else []
    if len(current) >= WAVE_MIN_STEPS:
        waves.append(current)
    return [{"adapters": float(np.median([trace[i][3] for i in wave])), "steps": len(wave),
             "p50_s": float(np.median([trace[i][0] for i in wave])),
             "adapter_bytes_s": float(np.median([adapter_bytes[i] for i in wave])) / bandwidth} for wave in waves]


class AdapterFiles:
    """The run's adapter folders under `root` (a temporary folder): the distinct random weights, each written once
    (`weights`), and each scenario's folder of names (`scenario_root`)."""

    def __init__(self, root: str, seed: int):
        self.root, self.seed = root, seed
        self._written: dict[tuple[int, tuple[str, ...], int], tuple[str, int]] = {}  # (rank, targets, j) -> ...

    def scenario_root(self, scenario: Scenario) -> str:
        return os.path.join(self.root, scenario.name)

    def weights(self, engine, rank: int, targets: tuple[str, ...], j: int) -> tuple[str, int]:
        """The PEFT folder of the j-th distinct random adapter of (rank, targets) in the engine's dtype and its
        bytes (A + B), written on first use."""
        key = (rank, targets, j)
        if key not in self._written:
            runtime = engine.lora_manager.runtime
            adapter = random_adapter(runtime.spec, f"r{rank}-{len(targets)}t-{j}", rank, targets,
                                     seed=self.seed + 1000 * rank + 100 * len(targets) + j).to(dtype=runtime.dtype)
            folder = os.path.join(self.root, "weights", f"r{rank}-{len(targets)}t-{j}")
            bc.write_peft_folder(folder, adapter, rank)
            self._written[key] = folder, bc.adapter_bytes(adapter, runtime.dtype)
        return self._written[key]


def adapter_folders(engine, scenario: Scenario, files: AdapterFiles) -> tuple[dict[str, int], list[str]]:
    """The scenario's adapters as folders lora-0.. under its root (their files linked to weights that repeat every
    DISTINCT_WEIGHTS names of a rank) and one warm-up adapter per rank, for the engine to load on first
    request; returns each name's bytes (A + B in the model dtype) and the warm-up names."""
    sizes, warmup, root = {}, [], files.scenario_root(scenario)
    for rank in sorted(set(scenario.ranks)):
        name = f"warmup-r{rank}"
        folder, sizes[name] = files.weights(engine, rank, scenario.targets, 0)
        bc.link_peft_folder(folder, os.path.join(root, name))
        warmup.append(name)
    for i in range(scenario.num_adapters):
        j = (i // len(scenario.ranks)) % bc.DISTINCT_WEIGHTS
        folder, sizes[f"lora-{i}"] = files.weights(engine, scenario.rank_of(i), scenario.targets, j)
        bc.link_peft_folder(folder, os.path.join(root, f"lora-{i}"))
    return sizes, warmup


def warm_up(engine, args, warmup_adapters: list[str | None], rng) -> None:
    """A few short requests (base and each warm-up adapter), so kernel compilation falls outside the timing."""
    vocab = engine.hf_config.vocab_size
    prompts = [rng.integers(0, vocab, args.prompt_len[0]).tolist() for _ in range(WARMUP_REQUESTS)]
    names = [warmup_adapters[i % len(warmup_adapters)] for i in range(WARMUP_REQUESTS)]
    throughput.run_loop(engine, prompts, np.full(WARMUP_REQUESTS, WARMUP_TOKENS), np.zeros(WARMUP_REQUESTS), names)


def h2d_bytes(stats) -> int:
    """Adapter bytes copied host-to-device since the engine started (its adapters' gpu_load_bytes)."""
    return sum(int(c["gpu_load_bytes"]) for c in stats.lora_adapters.values())


def read_phases_p50(manager) -> dict | None:
    """Medians of where the reads' time went (ReadPhases: the files, waiting for a host range, packing)."""
    phases = list(manager.recent_read_phases) if manager else []
    if not phases:
        return None
    return {field: float(np.median([getattr(p, field) for p in phases])) for field in ("files", "range_wait", "pack")}


def phases_text(phases: dict | None) -> str:
    if phases is None:
        return ""
    return (f": files {phases['files']:.3f}, waiting for a host range {phases['range_wait']:.3f}, "
            f"packing {phases['pack']:.3f}")


def read_seconds(before, after) -> float:
    """Seconds the adapter reads between two engine.stats() took, summed over the adapters (reads side by side
    each count)."""
    old = {name: counts["load_seconds"] for name, counts in before.lora_adapters.items()}
    return sum(counts["load_seconds"] - old.get(name, 0.0) for name, counts in after.lora_adapters.items())


def latency(trace: Trace, times: dict[str, list[float]], classes: list[str]) -> dict:
    """TTFT p50/p99 overall and per popularity class, ITL p50/p99 (seconds), and requests finished."""
    stamps = list(times.values())
    ttft = [t[0] - a for t, a in zip(stamps, trace.arrivals) if t]
    itl = [float(d) for t in stamps for d in np.diff(t)]
    by_class = {"all": bc.percentiles(ttft, (50, 99))}
    for label in sorted(set(classes) - {"all"}):
        chosen = [t[0] - a for t, a, c in zip(stamps, trace.arrivals, classes) if c == label and t]
        by_class[label] = bc.percentiles(chosen, (50, 99)) | {"requests": classes.count(label)}
    finished = int(sum(len(t) == n for t, n in zip(stamps, trace.out_lens)))
    return {"finished": finished, "ttft_s": by_class, "itl_s": bc.percentiles(itl, (50, 99))}


def run_engine(args, device, trace: Trace, files: AdapterFiles, ceilings: Ceilings, rng, scenario: Scenario | None = None,
               picks: np.ndarray | None = None) -> dict:
    """Build one engine (base if scenario is None; request i then names adapter picks[i]), warm it up, replay
    the trace; the engine is freed on return."""
    root = files.scenario_root(scenario) if scenario else None  # its adapters, loaded on first request
    if root is not None:
        os.makedirs(root)
    lora_options = dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=max(scenario.ranks),
                        lora_gpu_memory=args.lora_gpu_memory, lora_root=root) if scenario else {}
    t0 = time.perf_counter()
    engine = LLMEngine.from_args(EngineArgs(
        args.model, device=device, dtype=args.dtype, max_model_len=args.prompt_len[1] + args.output_len[1] + 1,
        max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager, seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization, async_scheduling=args.async_scheduling,
        **lora_options))
    info = bc.engine_info(engine, time.perf_counter() - t0)
    sizes, warmup_names, names, classes = {}, [], [None] * len(trace.prompts), ["all"] * len(trace.prompts)
    if scenario:
        t0 = time.perf_counter()
        sizes, warmup_names = adapter_folders(engine, scenario, files)
        info["adapter_setup_seconds"] = time.perf_counter() - t0  # writing (first use) and linking their folders
        names = [f"lora-{i}" for i in picks]
        classes = [scenario.popularity_class(int(i)) for i in picks]
    warm_up(engine, args, [None] + warmup_names, rng)
    if scenario is None:  # the base engine, first in the process, replays the trace once untimed (see the docstring)
        throughput.run_loop(engine, trace.prompts, trace.out_lens, trace.arrivals, names, prefix="untimed")
        engine.block_manager.reset_prefix_cache()  # the timed replay computes its prompts again
    before = engine.stats()
    preempted_before = engine.scheduler.num_preemptions
    with throughput.record_steps(engine) as log:
        elapsed, times, _ = throughput.run_loop(engine, trace.prompts, trace.out_lens, trace.arrivals, names)
        end = time.perf_counter()
    after = engine.stats()
    steps = log.steps
    manager = engine.lora_manager
    step_adapter_bytes = [sum(sizes[name] for name in s.adapters) for s in steps]  # the distinct adapters' A + B
    floor = run_floor(engine, steps, step_adapter_bytes, ceilings)
    decode_steps = [s.num_decode for s in steps if s.num_decode]
    step_trace = log.trace(end)
    out_tokens = sum(len(t) for t in times.values())
    result = {
        "scenario": scenario.name if scenario else "base", "num_adapters": scenario.num_adapters if scenario else 0,
        "ranks": list(scenario.ranks) if scenario else [], "targets": list(scenario.targets) if scenario else [],
        "dist": scenario.dist if scenario else None, "engine": info, "requests": len(trace.prompts),
        "request_rate": trace.rate,
        "elapsed_s": elapsed, "output_tokens": out_tokens, "output_tok_s": out_tokens / elapsed,
        "engine_steps": len(steps), "mean_batch": float(np.mean([s.num_seqs for s in steps])),
        "mean_decode_batch": float(np.mean(decode_steps)) if decode_steps else 0.0,
        "mean_distinct_adapters": float(np.mean([len(s.adapters) for s in steps])),
        "preemptions": engine.scheduler.num_preemptions - preempted_before,
        "floor": floor, "achieved_vs_floor": floor["floor_s"] / elapsed,
        "h2d_adapter_bytes": h2d_bytes(after) - h2d_bytes(before),
        "gpu_loads": after.lora_gpu_loads - before.lora_gpu_loads,
        "gpu_evictions": after.lora_gpu_evictions - before.lora_gpu_evictions,
        "host_loads": after.lora_loads - before.lora_loads,
        "read_seconds_p50": float(np.median(manager.recent_load_seconds)) if manager else None,
        "read_phases_p50": read_phases_p50(manager),
        "read_seconds_total": read_seconds(before, after), "read_slots": manager.read_slots if manager else 0,
        "pool_bytes_used_peak": max([s.pool_bytes_used for s in steps] + [after.lora_pool_bytes_used]),
        "pool_bytes_total": after.lora_pool_bytes_total,
        "step_seconds": log.seconds_by_kind(end), "step_trace": step_trace,
        "decode_waves": decode_waves(step_trace, step_adapter_bytes, ceilings.bandwidth),
        **latency(trace, times, classes)}
    del engine, steps, log, manager
    bc.release_memory()
    if root is not None:
        shutil.rmtree(root)
    return result


def make_trace(args, rng) -> Trace:
    """The requests every run replays: random prompts and output lengths, arrivals at t=0 or Poisson."""
    n = args.num_requests
    prompt_lens = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, n)
    out_lens = rng.integers(args.output_len[0], args.output_len[1] + 1, n)
    arrivals = np.zeros(n) if args.request_rate is None else bc.poisson_arrivals(rng, args.request_rate, n)
    vocab = bc.model_vocab_size(args.model)
    return Trace([rng.integers(0, vocab, k).tolist() for k in prompt_lens], out_lens, arrivals, args.request_rate)


def add_ratios(runs: dict[str, dict]) -> None:
    """Each run's tok/s, engine steps, mean decode batch and achieved/floor over those of its base run (the base
    engine on the same arrivals)."""
    for r in runs.values():
        base = runs[r["base_run"]]
        for key, field in (("vs_base_tok_s", "output_tok_s"), ("vs_base_steps", "engine_steps"),
                           ("vs_base_decode_batch", "mean_decode_batch"), ("vs_base_floor", "achieved_vs_floor")):
            r[key] = r[field] / base[field] if base[field] else None


def ms(pct: dict | None, point: str) -> float | None:
    """A percentile of seconds in ms (None when not measured)."""
    value = pct.get(point) if pct else None
    return 1e3 * value if value is not None else None


def print_results(runs: dict[str, dict], args, device) -> None:
    print(f"\n{args.model} on {device}, {args.num_requests} requests, prompts {args.prompt_len[0]}-"
          f"{args.prompt_len[1]}, outputs {args.output_len[0]}-{args.output_len[1]} tokens "
          "(ach/floor = run floor / wall time; TTFT and ITL in ms; hot/cold: TTFT p99 per popularity class):")
    headers = ["run", "adapters", "tok/s", "vs base", "steps", "vs base", "dec batch", "vs base", "adapt/step",
               "ach/floor", "vs base", "H2D GiB", "loads", "evict", "pool GiB", "TTFT p50", "p99", "hot p99",
               "cold p99", "ITL p50", "p99", "done"]
    rows = [[name, r["num_adapters"], r["output_tok_s"], r["vs_base_tok_s"], r["engine_steps"], r["vs_base_steps"],
             r["mean_decode_batch"], r["vs_base_decode_batch"], r["mean_distinct_adapters"], r["achieved_vs_floor"],
             r["vs_base_floor"], f"{r['h2d_adapter_bytes'] / 2**30:.2f}", r["gpu_loads"], r["gpu_evictions"],
             f"{r['pool_bytes_used_peak'] / 2**30:.1f}/{r['pool_bytes_total'] / 2**30:.1f}",
             ms(r["ttft_s"]["all"], "p50"), ms(r["ttft_s"]["all"], "p99"), ms(r["ttft_s"].get("hot"), "p99"),
             ms(r["ttft_s"].get("cold"), "p99"), ms(r["itl_s"], "p50"), ms(r["itl_s"], "p99"),
             f"{r['finished']}/{r['requests']}"] for name, r in runs.items()]
    bc.print_table(headers, rows)
    for name, r in runs.items():
        arrivals = "all at t=0" if r["request_rate"] is None else f"Poisson {r['request_rate']:g}/s"
        floor = r["floor"]
        print(f"  {name}: {arrivals}, {r['elapsed_s']:.2f} s, floor {floor['floor_s']:.3f} s (bytes "
              f"{floor['byte_floor_s']:.3f} s of which adapters {floor['adapter_bytes'] / max(floor['bytes'], 1):.1%}, "
              f"FLOPs {floor['flop_floor_s']:.3f} s), mean batch {r['mean_batch']:.1f}, "
              f"{r['preemptions']} preemptions, {r['host_loads']} host cache loads"
              + (f" (read p50 {r['read_seconds_p50']:.3f} s{phases_text(r['read_phases_p50'])}; all reads "
                 f"{r['read_seconds_total']:.1f} s over "
                 f"{r['read_slots']} readers, {r['read_seconds_total'] / (r['read_slots'] * r['elapsed_s']):.0%} of "
                 "their time)" if r["read_seconds_p50"] is not None else ""))
        split = r["step_seconds"]
        decode_p50 = split["decode"]["p50_s"]
        print(f"    {split['decode']['calls']} decode-only steps {split['decode']['seconds']:.2f} s"
              + (f" (median {1e3 * decode_p50:.1f} ms)" if decode_p50 is not None else "") + ", "
              f"{split['prompt']['calls']} with prompt tokens {split['prompt']['seconds']:.2f} s, "
              f"{split['idle']['calls']} schedules with nothing to run {split['idle']['seconds']:.2f} s")
        prompt_steps = [step for step in r["step_trace"] if step[1]]
        if prompt_steps:
            tokens = sum(step[1] for step in prompt_steps)
            small = [step for step in prompt_steps if step[1] < SMALL_PROMPT_STEP]
            print(f"    steps with prompt tokens: {tokens / len(prompt_steps):.0f} prompt tokens and "
                  f"{np.mean([step[2] for step in prompt_steps]):.0f} decode rows each on average, "
                  f"{1e3 * split['prompt']['seconds'] / tokens:.3f} ms per prompt token; {len(small)} of them under "
                  f"{SMALL_PROMPT_STEP} prompt tokens ({sum(step[0] for step in small):.2f} s)")
        if r["decode_waves"]:
            print("    decode waves (distinct adapters: steps, median step ms, adapters' bytes ms): "
                  + "; ".join(f"{w['adapters']:.0f}: {w['steps']}, {1e3 * w['p50_s']:.2f}, "
                              f"{1e3 * w['adapter_bytes_s']:.2f}" for w in r["decode_waves"]))
    bc.print_engines({name: r["engine"] for name, r in runs.items()}, with_kv_blocks=True)


def make_checks(runs: dict[str, dict]) -> list[bc.Check]:
    """The targets: steps near base's with 64+ adapters, achieved/floor near base's, fairness."""
    checks = []
    for name, r in runs.items():
        if r["base_run"] == name:
            continue
        base = runs[r["base_run"]]
        if name.split("-")[0] in ("64", "512", "2000"):
            checks.append(bc.Check(f"{name}: engine steps / base", f"{r['vs_base_steps']:.3f} ({r['engine_steps']} / "
                                   f"{base['engine_steps']})", f"<= {STEPS_LIMIT}", r["vs_base_steps"] <= STEPS_LIMIT))
        checks.append(bc.Check(
            f"{name}: achieved/floor / base's", f"{r['vs_base_floor']:.3f} ({r['achieved_vs_floor']:.3f} / "
            f"{base['achieved_vs_floor']:.3f})", f">= {FLOOR_LIMIT}", r["vs_base_floor"] >= FLOOR_LIMIT))
        if r["dist"] == "fairness":
            checks.append(bc.Check(f"{name}: requests finished", f"{r['finished']} / {r['requests']}", "all",
                                   r["finished"] == r["requests"]))
            hot, cold = ms(r["ttft_s"].get("hot"), "p99"), ms(r["ttft_s"].get("cold"), "p99")
            measured = hot is not None and cold is not None and hot > 0
            checks.append(bc.Check(f"{name}: cold p99 TTFT / hot p99 TTFT",
                                   f"{cold / hot:.3f} ({cold:.1f} / {hot:.1f} ms)" if measured else "not measured",
                                   f"<= {FAIRNESS_LIMIT}", cold / hot <= FAIRNESS_LIMIT if measured else None))
    return checks


def plot(runs: dict[str, dict], args) -> None:
    """Output tok/s against adapter count: the uniform and zipf scenarios, and base as a reference line."""
    series = {}
    for dist, style in (("uniform", "o-"), ("zipf", "s-")):
        got = sorted((r["num_adapters"], r["output_tok_s"]) for r in runs.values()
                     if r["dist"] == dist and r["scenario"] != "mixed")
        series[dist] = ([x for x, _ in got], [y for _, y in got], style)
    counts = sorted({x for xs, _, _ in series.values() for x in xs})
    if not counts:
        return
    series["base"] = ([counts[0], counts[-1]], [runs["base"]["output_tok_s"]] * 2, "k--")
    bc.save_plot(args.out, "many_adapters.png", [
        dict(title=f"Many adapters, {args.model}, {args.num_requests} requests", xlabel="adapters",
             ylabel="output tokens/s", series=series, logx=True)])


def run_all(args, device, trace: Trace, files: AdapterFiles, ceilings: Ceilings, rng, runs: dict, report: dict) -> None:
    """The base run, then one run per scenario (the JSON written after each); a scenario with arrivals of its own
    (fairness) gets a base run on them first ("base-poisson-<rate>"), which its ratios compare with."""
    runs["base"] = run_engine(args, device, trace, files, ceilings, rng)
    runs["base"]["base_run"] = "base"
    for name in args.scenarios:
        scenario = make_scenario(name, args.quick)
        picks = scenario.picks(np.random.default_rng([args.seed, SCENARIOS.index(name)]), args.num_requests)
        run_trace = trace
        if scenario.dist == "fairness" and args.request_rate is None:  # its own Poisson arrivals
            arrivals_rng = np.random.default_rng([args.seed, len(SCENARIOS)])
            run_trace = trace._replace(arrivals=bc.poisson_arrivals(arrivals_rng, FAIRNESS_RATE, args.num_requests),
                                       rate=FAIRNESS_RATE)
        base_run = "base" if run_trace is trace else f"base-poisson-{run_trace.rate:g}"
        if base_run not in runs:
            print(f"{base_run}: the base engine on {name}'s arrivals")
            runs[base_run] = run_engine(args, device, run_trace, files, ceilings, rng) | {"base_run": base_run}
        print(f"{name}: {scenario.num_adapters} adapters, ranks {scenario.ranks}, {len(scenario.targets)} targets")
        runs[name] = run_engine(args, device, run_trace, files, ceilings, rng, scenario, picks) | {"base_run": base_run}
        bc.write_json(args.out, "many_adapters.json", report)  # partial


def main(argv=None) -> int:
    args = parse_args(argv)
    device = bc.bench_device(args.device)
    needed = args.prompt_len[1] + args.output_len[1] + 1
    limit = bc.model_max_len(args.model)
    if limit is not None and needed > limit:
        raise SystemExit(f"prompt + output lengths need {needed} positions; {args.model} has {limit}")
    rng = np.random.default_rng(args.seed)
    trace = make_trace(args, rng)
    ceilings = Ceilings(bc.measure_bandwidth(device), measure_gemm_rate(device, resolve_dtype(args.dtype, device)))
    print(f"copy bandwidth (read + write) {ceilings.bandwidth / 1e9:.0f} GB/s, GEMM {ceilings.gemm_rate / 1e12:.2f} "
          f"TFLOP/s on {device}; scenarios {','.join(args.scenarios)}"
          + (f" (--quick: at most {QUICK_MAX_ADAPTERS} adapters each)" if args.quick else ""))
    files = AdapterFiles(tempfile.mkdtemp(prefix="many-adapters-"), args.seed)
    runs, checks = {}, []
    report = {"benchmark": "many_adapters", "args": vars(args), "env": bc.environment(device),
              "bandwidth_bytes_per_s": ceilings.bandwidth, "gemm_flop_per_s": ceilings.gemm_rate,
              "runs": runs, "checks": checks}
    try:
        run_all(args, device, trace, files, ceilings, rng, runs, report)
    finally:
        shutil.rmtree(files.root)
    add_ratios(runs)
    print_results(runs, args, device)
    checks += make_checks(runs)
    bc.print_checks(checks)
    plot(runs, args)
    bc.write_json(args.out, "many_adapters.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

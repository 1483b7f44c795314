"""Shared helpers of the engine benchmarks (decode.py, throughput.py, lora_decode.py, prefix_cache.py,
many_adapters.py).

- memory bandwidth measured in the same run (device-to-device copy, read + write);
- the collectives of one tensor-parallel decode step, timed on their own (`collective_seconds`);
- the decode byte floor of a step: weights + KV read + adapters, over that bandwidth;
- `start_decode_batch`: B sequences put straight into the decode state at a given
  context length without a real prefill. It reaches into engine internals (it sets
  `Sequence.num_computed_tokens` of waiting sequences and writes random values
  into `runner.attn_layers[i].k_cache/v_cache`), so it must follow changes there;
- synthetic adapters registered under many names (weights repeating every DISTINCT_WEIGHTS names), or
  written as PEFT folders (`write_peft_folder`, `link_peft_folder`), Poisson arrival times;
- step timing, tables, pass/fail checks, JSON and PNG output.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shutil
import statistics
import time
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.multiprocessing
from safetensors.torch import save_file

from loraserve import LoRARequest, SamplingParams
from loraserve.distributed import ParallelGroup, host_store, join_store
from loraserve.lora.synthetic import random_adapter
from loraserve.models.linear import FP32_REDUCE_MAX_TOKENS
from loraserve.models.loader import open_model

DISTINCT_WEIGHTS = 8  # adapters with distinct random weights; names beyond repeat them (generating is slow)
PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")
_MODULE_PATH = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # of the Llama family


# -- arguments ---------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def str_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def add_common_args(parser: argparse.ArgumentParser, default_model: str | None) -> None:
    """--device, --dtype, --seed, --out, --quick; and --model unless default_model is None."""
    if default_model is not None:
        parser.add_argument("--model", default=default_model, help="synthetic:NAME, an HF folder or a .gguf file")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="folder for the JSON and PNG results")
    parser.add_argument("--quick", action="store_true", help="a small sweep (smoke test)")


def add_step_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per case (median of them)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps before them")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="the engines launch the next step before reading the current one's tokens")


def bench_device(name: str | None) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def environment(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def model_max_len(model: str) -> int | None:
    """max_position_embeddings of a synthetic model (None for others: the engine checks)."""
    if not model.startswith("synthetic:"):
        return None
    from loraserve.models.synthetic import SYNTHETIC_CONFIGS

    config = SYNTHETIC_CONFIGS.get(model.split(":", 1)[1])
    return config["max_position_embeddings"] if config else None


def model_vocab_size(model: str) -> int:
    """The vocabulary size of a model, read from its config (no weights)."""
    return open_model(model).hf_config.vocab_size


def release_memory() -> None:
    """Call after the last reference to an engine is gone: its GPU memory goes back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"engine freed: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated")


# -- bandwidth and bytes -----------------------------------------------------------------
def median_seconds(fn, device: torch.device, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn(): CUDA events on CUDA, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Copy bandwidth in bytes/s (bytes read + written) of a random tensor (1 GiB on CUDA)."""
    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**28)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device)
    bandwidth = 2 * src.numel() * src.element_size() / seconds
    src = dst = None  # freed before empty_cache
    if device.type == "cuda":
        torch.cuda.empty_cache()  # engines size their KV cache from the free memory
    return bandwidth


def _collective_rank(rank: int, size: int, port: int, shape: tuple[int, int], gather_cols: int, count: int,
                     dtype: torch.dtype, custom_all_reduce: bool, results) -> None:
    """One rank of collective_seconds (a spawned process on GPU `rank`)."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = ParallelGroup.connect(join_store(port, size), rank, size, device, custom_all_reduce)
    embedded = torch.zeros(shape, dtype=dtype, device=device)  # [B, D]
    rows_fp32 = dtype != torch.float32 and shape[0] <= FP32_REDUCE_MAX_TOKENS  # as RowParallelLinear sums
    partial = torch.zeros(shape, dtype=torch.float32 if rows_fp32 else dtype, device=device)  # [B, D]
    logits = torch.zeros(shape[0], gather_cols, dtype=dtype, device=device)  # [B, V / size]

    def reduces():
        group.all_reduce(embedded)
        for _ in range(count - 1):
            group.all_reduce(partial)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        reduces()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reduces()
    reduce_s = median_seconds(graph.replay, device, reps=50, warmup=5)
    gather_s = median_seconds(lambda: group.all_gather(logits), device, reps=50, warmup=5)
    group.barrier()
    if rank == 0:
        results.put((reduce_s, gather_s))
    # leave without aborting the communicator: NCCL's abort was seen to wait for ever here, with the graph
    # that holds its kernels still alive; the process ends now and takes both with it
    os._exit(0)


def collective_seconds(size: int, batch: int, hidden: int, num_layers: int, vocab: int, dtype: torch.dtype,
                       custom_all_reduce: bool = True) -> dict:
    """The collectives of one decode step of `batch` rows at `size` ranks (GPUs 0..size-1), timed alone: the
    embedding's all-reduce (in `dtype`) and two per layer of [batch, hidden] (the row-parallel layers' partial
    sums: in fp32 up to FP32_REDUCE_MAX_TOKENS rows, as the model sums them) replayed in one CUDA graph (as
    the decode graphs hold them; through the peer-to-peer path unless `custom_all_reduce` is off), and the
    logits' all-gather of [batch, vocab / size] (eager, as the engine runs it). Run it while no engine holds
    those GPUs."""
    store = host_store(size)
    context = torch.multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    count = 2 * num_layers + 1
    procs = [context.Process(target=_collective_rank, args=(r, size, store.port, (batch, hidden),
                                                            -(-vocab // size), count, dtype, custom_all_reduce,
                                                            results))
             for r in range(size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs):
        raise RuntimeError(f"timing the collectives of {size} ranks failed: exit codes "
                           f"{[proc.exitcode for proc in procs]}")
    reduce_s, gather_s = results.get()
    return {"all_reduces": count, "all_reduce_s": reduce_s, "all_gather_s": gather_s,
            "collective_s": reduce_s + gather_s}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters; a tied embedding counts once (LoRA slots are buffers)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(engine) -> int:
    """K + V bytes of one token over all layers."""
    return sum(2 * math.prod(layer.k_cache.shape[2:]) * layer.k_cache.element_size()
               for layer in engine.runner.attn_layers)


def kv_bytes_read(engine, context: float) -> float:
    """K + V bytes one sequence of `context` tokens reads in a decode step over all layers: a sliding-window
    layer reads only its window."""
    return sum(2 * math.prod(layer.k_cache.shape[2:]) * layer.k_cache.element_size() * min(context, layer.window or context)
               for layer in engine.runner.attn_layers)


def adapter_bytes(adapter, dtype: torch.dtype) -> int:
    """Bytes of an adapter's A and B in `dtype` (adapters are held in fp32 on the CPU); an A that the slices of a
    packed module share (Phi-3's qkv_proj) counts once."""
    elem = torch.empty((), dtype=dtype).element_size()
    tensors = {id(t): t for pair in adapter.weights.values() for t in pair}
    return sum(t.numel() for t in tensors.values()) * elem


def write_peft_folder(folder: str, adapter, rank: int) -> None:
    """`adapter` (loraserve.lora.adapter.LoRAAdapter of a Llama-family model, scaling 1 folded in B) as a PEFT
    folder: alpha = rank, target_modules = the modules it has."""
    os.makedirs(folder, exist_ok=True)
    tensors = {}
    for (layer, module), (a, b) in adapter.weights.items():
        key = f"base_model.model.model.layers.{layer}.{_MODULE_PATH[module]}.{module}"
        tensors[f"{key}.lora_A.weight"] = a.contiguous()  # [r, in]
        tensors[f"{key}.lora_B.weight"] = b.contiguous()  # [out, r]
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    targets = sorted({module for _, module in adapter.weights})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": targets}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def link_peft_folder(source: str, folder: str) -> None:
    """A PEFT folder at `folder` with the files of `source`, hard-linked where the file system allows (another
    name for the same weights: the engine reads it as its own adapter), else copied."""
    os.makedirs(folder, exist_ok=True)
    for name in PEFT_FILES:
        try:
            os.link(os.path.join(source, name), os.path.join(folder, name))
        except OSError:
            shutil.copyfile(os.path.join(source, name), os.path.join(folder, name))


def decode_floor(engine, batch: int, mean_context: float, extra_bytes: int, bandwidth: float) -> dict:
    """Byte floor of one decode step: weights + KV read by `batch` sequences + `extra_bytes` (adapters)."""
    weights = weight_bytes(engine.runner.model)
    kv = int(batch * kv_bytes_read(engine, mean_context))
    total = weights + kv + extra_bytes
    return {"weight_bytes": weights, "kv_bytes": kv, "adapter_bytes": extra_bytes, "bytes": total,
            "floor_s": total / bandwidth}


def time_capture(graph_runner) -> float:
    """Seconds to capture every bucket again, largest first, into graphs dropped at once (the runner's own
    graphs stay). Capture is host-bound and its time moves by up to 2x from one capture to the next on the
    GPU machines measured, so one start-up capture is a poor sample: the benchmarks repeat this and take a
    median."""
    if not graph_runner.graphs:
        raise RuntimeError("time_capture needs the graphs captured first (their kernels compiled and bound)")
    with torch.inference_mode():
        start = time.perf_counter()
        dropped = [graph_runner.capture_bucket(b) for b in sorted(graph_runner.buckets, reverse=True)]
        torch.cuda.synchronize(graph_runner.device)
        seconds = time.perf_counter() - start
    del dropped  # freed after timing
    return seconds


def engine_info(engine, build_seconds: float) -> dict:
    """Graph capture cost and cache size of an engine."""
    graphs = engine.runner.graph_runner
    return {"build_seconds": build_seconds, "num_kv_blocks": engine.runner.num_blocks,
            "block_size": engine.block_manager.block_size, "max_model_len": engine.max_model_len,
            "weight_bytes": weight_bytes(engine.runner.model), "kv_bytes_per_token": kv_bytes_per_token(engine),
            "num_buckets": len(graphs.buckets) if graphs else 0, "num_graphs": len(graphs.graphs) if graphs else 0,
            "max_bucket": graphs.buckets[-1] if graphs else 0,
            "warmup_seconds": graphs.warmup_seconds if graphs else None,
            "capture_seconds": graphs.capture_seconds if graphs else None,
            "graph_memory_bytes": graphs.graph_memory_bytes if graphs else None,
            "lora_pool_bytes": engine.lora_manager.pool_bytes_total if engine.lora_manager else 0,
            "lora_pool_pages": engine.lora_manager.pool.num_pages if engine.lora_manager else 0}


# -- adapters and arrivals of a trace ------------------------------------------------------------
def adapter_rank(ranks: list[int], i: int) -> int:
    """The rank of adapter lora-i: `ranks` in turn over the distinct weights."""
    return ranks[i % DISTINCT_WEIGHTS % len(ranks)]


def register_adapters(engine, count: int, ranks: list[int]) -> None:
    """`count` names lora-0.., each registered as its own adapter (rank: adapter_rank); weights repeat every
    DISTINCT_WEIGHTS names."""
    spec = engine.lora_manager.runtime.spec
    made = [random_adapter(spec, f"w{i}", adapter_rank(ranks, i), seed=i) for i in range(min(count, DISTINCT_WEIGHTS))]
    for i in range(count):
        engine.lora_manager.register_adapter(f"lora-{i}", made[i % len(made)])


def resident_adapters(engine, count: int, ranks: list[int]) -> list[str]:
    """The adapters of register_adapters to load to the GPU before timing: every one when the pool holds them
    all (a trace over resident adapters), else none (their loads belong to the trace)."""
    pool = engine.lora_manager.runtime.pool
    if sum(pool.layout.pages_for(adapter_rank(ranks, i)) for i in range(count)) <= pool.num_pages:
        return [f"lora-{i}" for i in range(count)]
    return []


def poisson_arrivals(rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
    """[n] arrival times (s) of a Poisson process of `rate` per second."""
    return np.cumsum(rng.exponential(1.0 / rate, n))


# -- decode state without prefill --------------------------------------------------------------
def fill_kv_random(engine) -> None:
    """Random values in every KV block (what a prefill would have written; never zeros)."""
    with torch.no_grad():
        for layer in engine.runner.attn_layers:
            layer.k_cache.normal_()
            layer.v_cache.normal_()


def decode_fits(engine, batch: int, context: int, num_steps: int) -> str | None:
    """None if `batch` sequences of `context` tokens can decode `num_steps` steps, else why not."""
    total = context + num_steps
    if total >= engine.max_model_len:
        return f"context {context} + {num_steps} steps reaches max_model_len {engine.max_model_len}"
    if batch > engine.config.scheduler.max_num_seqs:
        return f"batch {batch} > max_num_seqs {engine.config.scheduler.max_num_seqs}"
    need = batch * -(-total // engine.block_manager.block_size)
    if need > engine.block_manager.num_free_blocks:
        return f"needs {need} KV blocks, {engine.block_manager.num_free_blocks} free"
    return None


def start_decode_batch(engine, batch: int, context: int, max_tokens: int, adapters: list[str | None],
                       seed: int = 0) -> list[str]:
    """Add `batch` greedy requests whose first step is a decode at position context - 1.

    Each prompt is `context` random ids. Before the first step, the waiting
    sequences are marked as having computed context - 1 tokens, so the scheduler
    admits each with one new token and allocates blocks for all `context` tokens;
    the KV values they read are whatever `fill_kv_random` left there. Request i
    uses adapter adapters[i % len(adapters)] (None = base); the adapters are made
    resident here, so the first step takes every request. Returns the request ids.
    """
    rng = np.random.default_rng(seed)
    vocab = engine.hf_config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    ids = [f"decode-{batch}-{context}-{i}" for i in range(batch)]
    wanted = set(ids)
    for i, rid in enumerate(ids):
        name = adapters[i % len(adapters)] if adapters else None
        engine.add_request(rid, rng.integers(0, vocab, context).tolist(), params,
                           LoRARequest(name) if name is not None else None)
    for seq in engine.scheduler.waiting:
        if seq.request_id in wanted:
            seq.num_computed_tokens = context - 1
    names = {adapters[i % len(adapters)] for i in range(batch)} - {None} if adapters else set()
    if names:  # resident before the first step (a request waits for its adapter's read), so the batch starts whole
        engine.lora_manager.prepare(names, engine.scheduler.running_loras())
    return ids


def time_decode_steps(engine, batch: int, warmup: int, steps: int) -> list[float]:
    """Seconds of each timed `engine.step()`; each must decode all `batch` sequences.

    A step ends with a host sync (sampled tokens come back), so wall time is its latency. With
    asynchronous scheduling a call launches the next step and then reads the tokens of the one launched
    before it, so a first, untimed call fills the pipeline.
    """
    engine.step()
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t0
        if len(outputs) != batch:
            raise RuntimeError(f"a decode step returned {len(outputs)} outputs for a batch of {batch}")
        if i >= warmup:
            times.append(elapsed)
    return times


def run_decode_case(engine, batch: int, context: int, adapters: list[str | None], args, bandwidth: float,
                    extra_bytes: int = 0) -> dict:
    """Time one decode case (args: warmup, steps, seed); the measured fields, or {"skipped": why}."""
    why = decode_fits(engine, batch, context, args.warmup + args.steps + 1)  # + the call that fills the pipeline
    if why is not None:
        return {"skipped": why}
    ids = start_decode_batch(engine, batch, context, args.warmup + args.steps + 2, adapters,
                             seed=args.seed + batch)
    try:
        times = time_decode_steps(engine, batch, args.warmup, args.steps)
    except torch.cuda.OutOfMemoryError:
        return {"skipped": "out of memory"}
    finally:
        abort_all(engine, ids)
    itl = statistics.median(times)
    floor = decode_floor(engine, batch, context + args.warmup + (args.steps - 1) / 2, extra_bytes, bandwidth)
    graphs = engine.runner.graph_runner
    return dict(itl_s=itl, itl_min_s=min(times), tok_s=batch / itl,
                used_graph=graphs is not None and graphs.bucket_for(batch) is not None, floor_ratio=itl / floor["floor_s"],
                gb_s=floor["bytes"] / itl / 1e9, **floor)


def abort_all(engine, request_ids: list[str]) -> None:
    for rid in request_ids:
        engine.abort_request(rid)


def percentiles(values: list[float], points=(50, 90, 99)) -> dict:
    if not values:
        return {f"p{p}": None for p in points}
    return {f"p{p}": float(np.percentile(values, p)) for p in points}


# -- reporting -----------------------------------------------------------------------
@dataclass
class Check:
    """One target: the measured value, the target in words and whether it is met (None: not measured)."""

    name: str
    value: str
    target: str
    passed: bool | None


def print_checks(checks: list[Check]) -> None:
    print("\nChecks against the targets:")
    for c in checks:
        status = "n/a " if c.passed is None else ("PASS" if c.passed else "FAIL")
        print(f"  [{status}] {c.name}: {c.value} (target {c.target})")


def print_table(headers: list[str], rows: list[list]) -> None:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}"
        return str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def print_engines(engines: dict[str, dict], with_kv_blocks: bool) -> None:
    """One line per engine: build time, KV blocks, graphs captured, capture time and memory."""
    for mode, info in engines.items():
        blocks = f", {info['num_kv_blocks']} KV blocks" if with_kv_blocks else ""
        extra = ""
        if info["num_graphs"]:
            extra = (f", {info['num_graphs']}/{info['num_buckets']} graphs up to batch {info['max_bucket']} "
                     f"captured in {info['capture_seconds']:.3f} s using {info['graph_memory_bytes'] / 2**30:.2f} GiB "
                     f"(after {info['warmup_seconds']:.1f} s of warm-up forwards that compile the kernels)")
            if "recapture_seconds" in info:
                extra += (f"; captured again {len(info['recapture_seconds'])} times: median "
                          f"{info['recapture_median_seconds']:.3f} s (" +
                          ", ".join(f"{t:.3f}" for t in info["recapture_seconds"]) + ")")
        print(f"engine {mode}: built in {info['build_seconds']:.1f} s{blocks}{extra}")


def write_json(out_dir: str | None, name: str, data: dict) -> None:
    if out_dir is None:
        return
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=lambda o: asdict(o) if isinstance(o, Check) else str(o))
    print(f"wrote {path}")


def save_plot(out_dir: str | None, name: str, panels: list[dict]) -> None:
    """One PNG with a panel per dict: title, xlabel, ylabel, series {label: (xs, ys, style)}, logx, logy."""
    if out_dir is None:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: no PNG written", stacklevel=2)
        return
    os.makedirs(out_dir, exist_ok=True)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for label, (xs, ys, style) in panel["series"].items():
            if xs:
                ax.plot(xs, ys, style, label=label)
        if panel.get("logx"):
            ax.set_xscale("log", base=2)
            ticks = sorted({x for xs, _, _ in panel["series"].values() for x in xs})
            ax.set_xticks(ticks, [str(t) for t in ticks])
        if panel.get("logy"):
            ax.set_yscale("log")
        ax.set(title=panel["title"], xlabel=panel["xlabel"], ylabel=panel["ylabel"])
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")

"""Cold-start benchmark: what a first request for an adapter on disk costs the requests already running.

One LoRA engine serves a steady decode load: --hot-requests requests of one resident adapter, all at t=0,
--hot-output tokens each (they must outlast the arrival window, or the run stops with an error). Once they all decode, a new request arrives every --interval steps, each naming
another adapter; the hot requests' inter-token latencies (ITL) are recorded over the arrival window. The
window runs twice on the same engine:

- cold (first): the new adapters are PEFT folders under the engine's --lora-root, never seen before. As the
  server does, each folder is read, validated and packed (`load_lora_weights`, called on a worker thread) while
  the engine keeps stepping: by the engine's adapter reader, a reader process on CUDA (`--lora-reader thread`:
  the worker thread itself, in the engine's process); the request is added when its adapter is read, and its
  weights are copied into the pool ahead of its step.
- warm: the same requests added at the same steps as the cold run added them, their adapters already
  registered and resident in the GPU pool. Both windows then hold the same steps (the same prefills at the
  same places), so their ITL percentiles differ only by what the cold path costs.

The cold/warm ratio of the hot requests' ITL p99 is the cost of cold starts (target: at most 1.10). The
adapters are random (rank --rank on all seven projections) and written to a temporary folder first.

    python benchmarks/cold_start.py --model synthetic:llama-3-8b --out /tmp/bench/cold_start
    python benchmarks/cold_start.py --model synthetic:tiny --device cpu --quick --out /tmp/b
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402
from loraserve import SamplingParams  # noqa: E402
from loraserve.config import EngineArgs  # noqa: E402
from loraserve.engine.engine import LLMEngine  # noqa: E402
from loraserve.lora.request import LoRARequest  # noqa: E402
from loraserve.lora.synthetic import random_adapter  # noqa: E402

ITL_P99_LIMIT = 1.10  # cold / warm ITL p99 of the requests already running


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, "synthetic:llama-3-8b")
    p.add_argument("--hot-requests", type=int, default=None, help="requests of the resident adapter (default 64)")
    p.add_argument("--hot-output", type=int, default=None, help="their output tokens (default 2048)")
    p.add_argument("--new-adapters", type=int, default=None, help="new requests, one adapter each (default 16)")
    p.add_argument("--interval", type=int, default=8, help="steps between two new requests")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of every request")
    p.add_argument("--rank", type=int, default=16, help="rank of every adapter")
    p.add_argument("--lora-reader", choices=("auto", "process", "thread"), default="auto",
                   help="who reads the adapter folders (default: a reader process on CUDA, a thread on the CPU)")
    args = p.parse_args(argv)
    args.hot_requests = args.hot_requests or (4 if args.quick else 64)
    args.hot_output = args.hot_output or (256 if args.quick else 2048)
    args.new_adapters = args.new_adapters or (3 if args.quick else 16)
    if args.hot_output <= args.new_adapters * args.interval + 2 * args.interval:
        p.error("--hot-output must outlast the arrival window (new adapters x interval steps)")
    return args


def hot_itls(stamps: dict[str, list[float]], start: float, end: float) -> list[float]:
    """The hot requests' gaps between consecutive tokens whose later token came in [start, end)."""
    return [b - a for times in stamps.values() for a, b in zip(times, times[1:]) if start <= b < end]


def run_window(engine, args, variant: str, root: str, rng, schedule: list[int] | None = None) -> dict:
    """Start the hot load, wait until it decodes, then bring in the new requests (adapters <variant>-<j>):
    cold, one adapter read every --interval steps on a worker thread, its request added once it is read;
    warm, request j added `schedule[j]` steps into the window (the cold run's "added_at"), its adapter
    resident beforehand."""
    params_hot = SamplingParams(max_tokens=args.hot_output, ignore_eos=True, temperature=0.0)
    params_new = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    vocab = engine.hf_config.vocab_size
    hot = {f"{variant}-hot-{i}": [] for i in range(args.hot_requests)}
    for rid in hot:
        engine.add_request(rid, rng.integers(0, vocab, args.prompt_len).tolist(), params_hot, LoRARequest("hot"))
    names = [f"{variant}-{j}" for j in range(args.new_adapters)]
    if variant == "warm":  # read, registered and resident before the window
        for name in names:
            engine.add_lora(LoRARequest(name, os.path.join(root, name)))
        engine.lora_manager.prepare(set(names), engine.scheduler.running_loras())
    reader = ThreadPoolExecutor(max_workers=1)
    reads: list[tuple[str, Future]] = []
    read_seconds, added_at = [], []  # added_at[j]: steps into the window when request j was added
    step_stamps = []
    step, next_new, window = 0, 0, [None, None]
    start = time.perf_counter()
    while engine.has_unfinished_requests() or reads or (window[0] is not None and next_new < len(names)):
        decoding = all(stamps for stamps in hot.values())
        if decoding and window[0] is None:
            window[0], first_new_step = time.perf_counter() - start, step + args.interval
        if variant == "cold":
            if window[0] is not None and next_new < len(names) and step == first_new_step + next_new * args.interval:
                request = LoRARequest(names[next_new], os.path.join(root, names[next_new]))
                reads.append((names[next_new], reader.submit(engine.load_lora_weights, request)))  # off the
                next_new += 1                                                                  # engine thread
        else:
            while window[0] is not None and next_new < len(names) and step == first_new_step + schedule[next_new]:
                engine.add_request(f"new-{names[next_new]}", rng.integers(0, vocab, args.prompt_len).tolist(),
                                   params_new, LoRARequest(names[next_new]))
                added_at.append(step - first_new_step)
                next_new += 1
        for name, future in [r for r in reads if r[1].done()]:
            reads.remove((name, future))
            read_seconds.append(future.result().seconds)
            engine.add_lora(LoRARequest(name, os.path.join(root, name)), loaded=future.result())
            engine.add_request(f"new-{name}", rng.integers(0, vocab, args.prompt_len).tolist(), params_new,
                               LoRARequest(name))
            added_at.append(step - first_new_step)
        if not engine.has_unfinished_requests():  # only reads in flight: wait for them
            time.sleep(0.001)
            continue
        outputs = engine.step()
        step += 1
        stamp = time.perf_counter() - start
        step_stamps.append(stamp)
        for out in outputs:
            if out.request_id in hot:
                got = hot[out.request_id]
                got.extend([stamp] * (len(out.outputs[0].token_ids) - len(got)))
        if window[1] is None and next_new == len(names) and not reads:
            # --interval steps past the last arrival, at the pace of the last --interval steps
            window[1] = stamp + (stamp - step_stamps[max(0, len(step_stamps) - 1 - args.interval)])
    reader.shutdown()
    last_hot = min(stamps[-1] for stamps in hot.values())
    if window[1] is None or window[1] > last_hot:
        raise SystemExit(f"{variant}: the hot requests ended before the arrival window did; raise --hot-output")
    itls = hot_itls(hot, window[0], window[1])
    return {"variant": variant, "window_s": [window[0], window[1]], "hot_itl_s": bc.percentiles(itls),
            "hot_itls_in_window": len(itls), "steps": step, "added_at": added_at,
            "read_s": bc.percentiles(read_seconds) if read_seconds else None}


def warm_up(engine, args, adapter, folder: str, rng) -> None:
    """Prefill, decode and mixed steps with adapters once, so kernel compilation falls outside the windows; one
    adapter folder read (not registered), so the adapter reader is ready."""
    engine.load_lora_weights(LoRARequest("warm-up-read", folder))
    engine.lora_manager.register_adapter("warm-up", adapter)
    vocab = engine.hf_config.vocab_size
    for i, name in enumerate(["hot", "hot", "warm-up", None]):
        engine.add_request(f"warm-up-{i}", rng.integers(0, vocab, args.prompt_len).tolist(),
                           SamplingParams(max_tokens=8 + 4 * i, ignore_eos=True, temperature=0.0),
                           LoRARequest(name) if name else None)
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()


def main(argv=None) -> int:
    args = parse_args(argv)
    device = bc.bench_device(args.device)
    rng = np.random.default_rng(args.seed)
    engine = LLMEngine.from_args(EngineArgs(
        args.model, device=device, dtype=args.dtype, max_model_len=args.prompt_len + args.hot_output + 1,
        max_num_seqs=max(args.hot_requests + args.new_adapters, 8), seed=args.seed, enable_lora=True,
        max_lora_rank=args.rank, lora_reader=args.lora_reader))
    spec = engine.lora_manager.runtime.spec
    report = {"benchmark": "cold_start", "args": vars(args), "env": bc.environment(device), "runs": {}}
    with tempfile.TemporaryDirectory(prefix="cold-start-adapters-") as root:
        made = [random_adapter(spec, f"w{i}", args.rank, seed=args.seed + i) for i in range(2)]
        for variant in ("warm", "cold"):
            for j in range(args.new_adapters):
                bc.write_peft_folder(os.path.join(root, f"{variant}-{j}"), made[j % len(made)], args.rank)
        engine.lora_manager.register_adapter("hot", made[0])
        warm_up(engine, args, made[1], os.path.join(root, "warm-0"), rng)
        report["runs"]["cold"] = run_window(engine, args, "cold", root, rng)
        report["runs"]["warm"] = run_window(engine, args, "warm", root, rng, report["runs"]["cold"]["added_at"])
    report["lora_reader"] = type(engine.lora_manager.reader).__name__
    engine.shutdown()
    warm, cold = (report["runs"][v]["hot_itl_s"] for v in ("warm", "cold"))
    ratio = cold["p99"] / warm["p99"] if warm["p99"] and cold["p99"] else None
    for variant, run in report["runs"].items():
        itl = run["hot_itl_s"]
        reads = f"; reading an adapter {run['read_s']['p50']:.3f} s (p50)" if run["read_s"] else ""
        print(f"{variant}: {args.new_adapters} new requests, one every {args.interval} steps, beside "
              f"{args.hot_requests} decoding requests: their ITL p50 {1e3 * itl['p50']:.2f} ms, p90 "
              f"{1e3 * itl['p90']:.2f} ms, p99 {1e3 * itl['p99']:.2f} ms ({run['hot_itls_in_window']} gaps){reads}")
    print(f"adapter reader: {report['lora_reader']}")
    checks = [bc.Check("cold / warm ITL p99 of the requests already running",
                       f"{ratio:.3f}" if ratio is not None else "not measured", f"<= {ITL_P99_LIMIT}",
                       None if ratio is None else ratio <= ITL_P99_LIMIT)]
    report["checks"] = [vars(c) for c in checks]
    bc.print_checks(checks)
    bc.write_json(args.out, "cold_start.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

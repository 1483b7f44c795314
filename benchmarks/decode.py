"""Decode benchmark: inter-token latency and tok/s of real engine steps, CUDA graphs vs eager.

For each batch size and context length, B sequences are put straight into the
decode state (random prompt ids, random KV values, no prefill; see
bench_common.start_decode_batch) and each `engine.step()` is timed: scheduler,
input preparation, graph replay or eager forward, sampling and the host sync.
ITL is the median step time; the byte floor of a step is (weights + KV read) /
copy bandwidth measured in the same run. One engine per mode, one at a time.
Prints a table, the graph capture cost and the check against the target (batch-1
graph ITL <= 1.15x the byte floor); writes decode.json and decode.png to --out.

With --tensor-parallel-size 1,2 (a list) each mode runs once per size, one
engine at a time; the byte floor is then one rank's (its part of the weights
and of the KV cache). Before the engines start, the collectives of one batch-1
decode step at N ranks are timed alone (bench_common.collective_seconds: the
all-reduces in a CUDA graph, the logits' all-gather). The tensor-parallel
checks: batch-1 graph ITL at 2 ranks <= 0.6x one rank's, and at N ranks <= 1.3x
(its rank's byte floor + those collectives' time).

    python benchmarks/decode.py [--model synthetic:llama-3-8b] [--quick] [--out DIR]
    python benchmarks/decode.py --model synthetic:tiny --device cpu --quick --out /tmp/b
    python benchmarks/decode.py --tensor-parallel-size 1,2 --batch-sizes 1,8 --contexts 512 --modes graphs
    python benchmarks/decode.py --model synthetic:llama-3-70b --tensor-parallel-size 4 --batch-sizes 1,32 \
        --contexts 512 --modes graphs
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import bench_common as bc  # noqa: E402
from loraserve.config import EngineArgs, resolve_dtype  # noqa: E402
from loraserve.engine.engine import LLMEngine  # noqa: E402
from loraserve.models.loader import open_model  # noqa: E402

BATCH_SIZES, CONTEXTS = (1, 2, 4, 8, 16, 32, 64, 128, 256), (128, 1024, 4096)
QUICK_BATCH_SIZES, QUICK_CONTEXTS = (1, 4, 16), (128, 512)
MODES = ("graphs", "eager")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, "synthetic:llama-3-8b")
    bc.add_step_args(p)
    p.add_argument("--batch-sizes", type=bc.int_list, default=None, help=f"default {BATCH_SIZES}")
    p.add_argument("--contexts", type=bc.int_list, default=None, help=f"default {CONTEXTS}")
    p.add_argument("--modes", type=bc.str_list, default=list(MODES), help="graphs,eager")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", type=bc.int_list, default=[1],
                   help="ranks (GPUs) the model is split over; a list (1,2) runs each mode at each size")
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="every all-reduce through NCCL, in the engines and in the collectives timed alone")
    args = p.parse_args(argv)
    args.batch_sizes = args.batch_sizes or list(QUICK_BATCH_SIZES if args.quick else BATCH_SIZES)
    args.contexts = args.contexts or list(QUICK_CONTEXTS if args.quick else CONTEXTS)
    unknown = set(args.modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    return args


def run_mode(args, mode: str, tp: int, device: torch.device, bandwidth: float) -> tuple[dict, list[dict]]:
    """Build one engine (of `tp` ranks), time every (context, batch) case on it; the engine is freed on return."""
    n_steps = args.warmup + args.steps
    needed = max(args.contexts) + n_steps + 2
    limit = bc.model_max_len(args.model)
    t0 = time.perf_counter()
    engine = LLMEngine.from_args(EngineArgs(
        args.model, device=device, dtype=args.dtype, max_model_len=min(needed, limit or needed),
        max_num_seqs=max(args.batch_sizes), enforce_eager=mode == "eager", seed=args.seed,
        async_scheduling=args.async_scheduling, gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=tp, disable_custom_all_reduce=args.disable_custom_all_reduce))
    info = bc.engine_info(engine, time.perf_counter() - t0)
    bc.fill_kv_random(engine)
    rows = []
    cases = [(c, b) for c in args.contexts for b in args.batch_sizes]
    try:
        for ctx, batch in tqdm(cases, desc=f"decode {mode} tp={tp}", unit="case", disable=None):
            row = {"mode": mode, "tp": tp, "batch": batch, "context": ctx}
            rows.append(row)
            row.update(bc.run_decode_case(engine, batch, ctx, [], args, bandwidth))
    finally:
        engine.shutdown()  # a tensor-parallel engine's workers hold the other GPUs
    return info, rows


def measured(rows, mode, batch, ctx, tp: int = 1) -> dict | None:
    return next((r for r in rows if (r["mode"], r["tp"], r["batch"], r["context"]) == (mode, tp, batch, ctx)
                 and "itl_s" in r), None)


FLOOR_TARGET = 1.15  # base decode ITL at batch 1 (CUDA graphs) <= this times the byte floor
TP_TARGETS = {2: 0.6}  # batch-1 graph ITL at N ranks <= this times one rank's (synthetic Llama-3-8B)
# batch-1 graph ITL at N ranks <= this times (its rank's byte floor + the step's collectives) (synthetic Llama-3-70B);
# at other sizes the ratio is printed for information
TP_FLOOR_TARGETS = {4: 1.3}


def make_checks(rows: list[dict], contexts: list[int], sizes: list[int], collectives: dict) -> list[bc.Check]:
    """The targets: one rank's graph ITL at batch 1, shortest context, against the byte floor; at N ranks,
    that ITL against one rank's and against its rank's byte floor plus the collectives' time (`collectives`:
    N -> collective_seconds at batch 1)."""
    ctx = min(contexts)
    checks = []
    g1 = measured(rows, "graphs", 1, ctx)
    name = f"batch-1 ctx-{ctx} graph ITL / byte floor"
    if 1 in sizes:
        if g1 is None:
            checks.append(bc.Check(name, "not measured", f"<= {FLOOR_TARGET}", None))
        else:
            checks.append(bc.Check(name, f"{g1['floor_ratio']:.3f} ({1e3 * g1['itl_s']:.2f} ms vs "
                                         f"{1e3 * g1['floor_s']:.2f} ms)", f"<= {FLOOR_TARGET}",
                                   g1["floor_ratio"] <= FLOOR_TARGET))
    for tp in sizes:
        if tp == 1:
            continue
        gn = measured(rows, "graphs", 1, ctx, tp)
        name = f"batch-1 ctx-{ctx} graph ITL, {tp} ranks / (rank byte floor + collectives)"
        target = TP_FLOOR_TARGETS.get(tp)
        if gn is None:
            checks.append(bc.Check(name, "not measured", f"<= {target}" if target else "-", None))
        else:
            bound = gn["floor_s"] + collectives[tp]["collective_s"]
            checks.append(bc.Check(name, f"{gn['itl_s'] / bound:.3f} ({1e3 * gn['itl_s']:.2f} ms vs "
                                         f"{1e3 * gn['floor_s']:.2f} + {1e3 * collectives[tp]['collective_s']:.2f} ms)",
                                   f"<= {target}" if target else "none set",
                                   gn["itl_s"] / bound <= target if target else None))
        name, target = f"batch-1 ctx-{ctx} graph ITL, {tp} ranks / 1 rank", TP_TARGETS.get(tp)
        if gn is None or g1 is None:
            checks.append(bc.Check(name, "not measured", f"<= {target}" if target else "-", None))
            continue
        ratio = gn["itl_s"] / g1["itl_s"]
        checks.append(bc.Check(name, f"{ratio:.3f} ({1e3 * gn['itl_s']:.2f} ms vs {1e3 * g1['itl_s']:.2f} ms; "
                                     f"{gn['floor_ratio']:.2f}x its rank's byte floor)",
                               f"<= {target}" if target else "none set", ratio <= target if target else None))
    return checks


def print_results(rows: list[dict], engines: dict, args) -> None:
    headers = ["tp", "ctx", "B", "graph ITL ms", "graph tok/s", "eager ITL ms", "eager tok/s", "floor ms",
               "graph/floor", "eager/floor", "speedup", "graph GB/s", "eager GB/s"]
    table = []
    for tp, ctx, batch in [(t, c, b) for t in args.tensor_parallel_size for c in args.contexts
                           for b in args.batch_sizes]:
        g, e = measured(rows, "graphs", batch, ctx, tp), measured(rows, "eager", batch, ctx, tp)
        if g is None and e is None:
            continue
        floor = (g or e)["floor_s"]
        table.append([tp, ctx, batch if g is None or g["used_graph"] else f"{batch}*",
                      g and 1e3 * g["itl_s"], g and g["tok_s"], e and 1e3 * e["itl_s"], e and e["tok_s"],
                      1e3 * floor, g and g["floor_ratio"], e and e["floor_ratio"],
                      g and e and e["itl_s"] / g["itl_s"], g and g["gb_s"], e and e["gb_s"]])
    print(f"\nDecode, {args.model}, {args.steps} timed steps after {args.warmup} warm-up "
          "(* = no graph bucket, ran eagerly):")
    bc.print_table(headers, table)
    for r in rows:
        if "skipped" in r:
            print(f"  skipped {r['mode']} tp={r['tp']} B={r['batch']} ctx={r['context']}: {r['skipped']}")
    bc.print_engines(engines, with_kv_blocks=True)


def plot(rows: list[dict], args) -> None:
    itl, tps = {}, {}
    for tp in args.tensor_parallel_size:
        tag = "" if args.tensor_parallel_size == [1] else f" tp={tp}"
        for mode in args.modes:
            for ctx in args.contexts:
                got = [r for r in rows if (r["mode"], r["tp"], r["context"]) == (mode, tp, ctx) and "itl_s" in r]
                style = "o-" if mode == "graphs" else "s--"
                itl[f"{mode}{tag} ctx {ctx}"] = ([r["batch"] for r in got], [1e3 * r["itl_s"] for r in got], style)
                tps[f"{mode}{tag} ctx {ctx}"] = ([r["batch"] for r in got], [r["tok_s"] for r in got], style)
        for ctx in args.contexts:
            floors = {r["batch"]: 1e3 * r["floor_s"] for r in rows
                      if (r["tp"], r["context"]) == (tp, ctx) and "floor_s" in r}
            itl[f"floor{tag} ctx {ctx}"] = (sorted(floors), [floors[b] for b in sorted(floors)], ":")
    bc.save_plot(args.out, "decode.png", [
        dict(title=f"Decode ITL, {args.model}", xlabel="batch size", ylabel="ms per step", series=itl, logx=True,
             logy=True),
        dict(title="Decode throughput", xlabel="batch size", ylabel="output tokens/s", series=tps, logx=True,
             logy=True)])


def main(argv=None) -> int:
    args = parse_args(argv)
    device = bc.bench_device(args.device)
    if device.type != "cuda" and "graphs" in args.modes:
        print("note: CUDA graphs need a CUDA device; running the eager mode only")
        args.modes = [m for m in args.modes if m != "graphs"] or ["eager"]
    bandwidth = bc.measure_bandwidth(device)
    print(f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s on {device}")
    engines, rows, checks, collectives = {}, [], [], {}
    several = [t for t in args.tensor_parallel_size if t > 1]
    config = open_model(args.model).hf_config if several else None  # read only to size the collectives
    for tp in several:
        collectives[tp] = bc.collective_seconds(tp, 1, config.hidden_size, config.num_hidden_layers,
                                                config.vocab_size, resolve_dtype(args.dtype, device),
                                                not args.disable_custom_all_reduce)
        print(f"collectives of a batch-1 step at {tp} ranks: {collectives[tp]['all_reduces']} all-reduces "
              f"{1e3 * collectives[tp]['all_reduce_s']:.3f} ms, logits all-gather "
              f"{1e3 * collectives[tp]['all_gather_s']:.3f} ms")
    report = {"benchmark": "decode", "args": vars(args), "env": bc.environment(device),
              "bandwidth_bytes_per_s": bandwidth, "collectives": collectives, "engines": engines, "results": rows,
              "checks": checks}
    for tp in args.tensor_parallel_size:
        for mode in args.modes:
            key = mode if args.tensor_parallel_size == [1] else f"{mode} tp={tp}"
            engines[key], mode_rows = run_mode(args, mode, tp, device, bandwidth)
            rows += mode_rows
            bc.release_memory()
            bc.write_json(args.out, "decode.json", report)  # partial results survive a later failure
    print_results(rows, engines, args)
    checks += make_checks(rows, args.contexts, args.tensor_parallel_size, collectives)
    bc.print_checks(checks)
    bc.write_json(args.out, "decode.json", report)
    plot(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

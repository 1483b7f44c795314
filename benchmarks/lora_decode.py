"""Multi-LoRA decode benchmark: what LoRA inside the CUDA graphs costs against the bare base model.

Per model, three engines built one after another: "graphs" (no LoRA: the base),
"graphs+lora" and "eager+lora" (max_loras 8, max_lora_rank 64). On the LoRA
engines each batch runs with an adapter set: 0 (base requests on the LoRA
engine: the cost of LoRA kernels over empty slots), 1, 4 or 8 distinct random
adapters of rank 16 on all 7 projections (or any other number N: N names, each
its own adapter in the pool, whose weights repeat every 8 names), or "mixed"
(ranks 8, 16, 32, 64); requests take the set's adapters round-robin. Sequences start straight in the
decode state (bench_common.start_decode_batch); ITL is the median
`engine.step()` time. Reports tok/s against base graphs, ITL against the byte
floor (weights + KV + the distinct adapters of the batch, in the model dtype),
graph capture time/memory with and without LoRA, and checks against the
targets (on Llama-3-8B; other models' ratios are printed for information). A
model's engines stay alive until, after its decode runs, the two graph engines
capture every bucket again --capture-rounds times, taking turns (one start-up
capture is a noisy sample of a host-bound time); then a graphs+lora engine is
built at each --capture-max-loras value and captures again in turns with the
max_loras engine: capture time must not grow with max_loras. Writes
lora_decode.json and lora_decode_<model>.png to --out.

    python benchmarks/lora_decode.py [--models synthetic:llama-3-8b,synthetic:llama-3.2-1b] [--out DIR]
    python benchmarks/lora_decode.py --models synthetic:tiny --device cpu --quick --out /tmp/b
    python benchmarks/lora_decode.py --models synthetic:llama-3-70b --tensor-parallel-size 4 --out DIR
        (the tensor-parallel target: 8 adapters at batch 32 >= 0.9x base tok/s)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

from tqdm import tqdm  # noqa: E402

import bench_common as bc  # noqa: E402
from loraserve.config import EngineArgs  # noqa: E402
from loraserve.engine.engine import LLMEngine  # noqa: E402
from loraserve.lora.synthetic import random_adapter  # noqa: E402

MODELS = ("synthetic:llama-3-8b", "synthetic:llama-3.2-1b")
TARGET_MODEL = "synthetic:llama-3-8b"  # the targets are stated for it
TARGET_8_AT_32 = 0.92  # graphs + 8 adapters at batch 32: tok/s >= this times base tok/s
TARGET_1_AT_1 = 1.05  # graphs + 1 adapter at batch 1: ITL <= this times base ITL
TP_TARGET_8_AT_32 = 0.9  # with --tensor-parallel-size > 1, any model: graphs + 8 adapters at batch 32 vs base
CAPTURE_GROWTH_LIMIT = 1.2  # capture time at the largest --capture-max-loras / at the smallest (noise margin)
MODES = ("graphs", "graphs+lora", "eager+lora")
BATCH_SIZES, QUICK_BATCH_SIZES = (1, 16, 32, 64), (1, 4)
ADAPTER_SETS = ("0", "1", "4", "8", "mixed")
RANK, MIXED_RANKS = 16, (8, 16, 32, 64)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, None)
    bc.add_step_args(p)
    p.add_argument("--models", type=bc.str_list, default=None, help=f"default {','.join(MODELS)}")
    p.add_argument("--modes", type=bc.str_list, default=list(MODES), help=",".join(MODES))
    p.add_argument("--batch-sizes", type=bc.int_list, default=None, help=f"default {BATCH_SIZES}")
    p.add_argument("--adapter-sets", type=bc.str_list, default=list(ADAPTER_SETS), help=",".join(ADAPTER_SETS))
    p.add_argument("--context", type=int, default=512, help="context length of every sequence")
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--lora-gpu-memory", type=float, default=None,
                   help="GiB of the adapter pool (default: the engine's); the kernels' cost must not depend on it")
    p.add_argument("--fill-pool", type=int, default=0,
                   help="load this many more rank-16 adapters into the pool before timing (they are not used)")
    p.add_argument("--capture-rounds", type=int, default=5,
                   help="capture every bucket again this many times per graph engine, the engines taking turns; "
                        "the capture-time check compares the medians (0: compare the start-up captures)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (GPUs) every engine's model is split over; the byte floor is then one rank's")
    p.add_argument("--disable-custom-all-reduce", action="store_true", help="every all-reduce through NCCL")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="largest graph bucket (default: the largest batch size)")
    p.add_argument("--capture-max-loras", type=lambda t: [int(v) for v in t.split(",") if v.strip()],
                   default=[1, 16], help="max_loras values of the capture-time sweep, each captured in turns "
                                         "with the --max-loras engine ('' to skip)")
    args = p.parse_args(argv)
    args.models = args.models or list(MODELS)
    args.batch_sizes = args.batch_sizes or list(QUICK_BATCH_SIZES if args.quick else BATCH_SIZES)
    args.max_num_seqs = args.max_num_seqs or max(args.batch_sizes)
    for name, given, known in (("modes", args.modes, MODES), ("adapter sets", args.adapter_sets, ADAPTER_SETS)):
        unknown = sorted(g for g in given if g not in known and not (name == "adapter sets" and g.isdigit()))
        if unknown:
            p.error(f"unknown {name} {unknown}; choose from {known}" + (" or a number" if name != "modes" else ""))
    if any(len(set_adapters(s)) > args.max_loras for s in args.adapter_sets):
        p.error("an adapter set has more adapters than --max-loras")
    if max(MIXED_RANKS) > args.max_lora_rank and "mixed" in args.adapter_sets:
        p.error(f"the mixed set needs --max-lora-rank >= {max(MIXED_RANKS)}")
    return args


def set_adapters(key: str) -> list[tuple[str, int]]:
    """(adapter name, rank) of an adapter set."""
    if key == "mixed":
        return [(f"mixed-r{r}", r) for r in MIXED_RANKS]
    return [(f"r{RANK}-{i}", RANK) for i in range(int(key))]


def register_adapters(engine, keys: list[str], adapters: dict, seed: int) -> None:
    """Register every adapter of the sets, made once per model and kept in `adapters` (fp32, CPU); rank-16
    names past the first bc.DISTINCT_WEIGHTS share their weights (each still its own adapter to the engine)."""
    wanted = dict(pair for key in keys for pair in set_adapters(key))  # name -> rank
    spec = engine.lora_manager.runtime.spec
    for i, (name, rank) in enumerate(sorted(wanted.items())):
        if name not in adapters:
            index = int(name.rsplit("-", 1)[1]) if name.startswith(f"r{RANK}-") else -1
            if index >= bc.DISTINCT_WEIGHTS:
                first = f"r{RANK}-{index % bc.DISTINCT_WEIGHTS}"
                if first not in adapters:
                    adapters[first] = random_adapter(spec, first, rank, seed=seed + 1 + index % bc.DISTINCT_WEIGHTS)
                adapters[name] = adapters[first]
            else:
                adapters[name] = random_adapter(spec, name, rank, seed=seed + 1 + i)
        engine.lora_manager.register_adapter(name, adapters[name])


def fill_pool(engine, count: int, adapters: dict, seed: int) -> None:
    """Make `count` more rank-16 adapters resident in the pool (names of their own, weights of the timed sets'
    rank-16 adapters), a step's worth (max_loras) at a time; raises if the pool can't hold them all."""
    if not count:
        return
    manager = engine.lora_manager
    weights = [a for a in adapters.values() if a.max_rank == RANK] or [
        random_adapter(manager.runtime.spec, "fill", RANK, seed=seed)]
    names = [f"fill-{i}" for i in range(count)]
    for i, name in enumerate(names):
        manager.register_adapter(name, weights[i % len(weights)])
    step = engine.config.lora.max_loras
    for i in range(0, count, step):
        manager.prepare(set(names[i:i + step]), set())
    missing = set(names) - set(manager.resident_on_gpu)
    if missing:
        raise SystemExit(f"--fill-pool {count}: the pool holds only {count - len(missing)} of them; raise --lora-gpu-memory")


def build_engine(args, model: str, mode: str, device, max_loras: int):
    return LLMEngine.from_args(EngineArgs(
        model, device=device, dtype=args.dtype, max_model_len=args.context + args.warmup + args.steps + 3,
        async_scheduling=args.async_scheduling, max_num_seqs=args.max_num_seqs,
        enforce_eager=mode.startswith("eager"), seed=args.seed, enable_lora=mode.endswith("+lora"),
        max_loras=max_loras, max_lora_rank=args.max_lora_rank, lora_gpu_memory=args.lora_gpu_memory,
        tensor_parallel_size=args.tensor_parallel_size, disable_custom_all_reduce=args.disable_custom_all_reduce))


def run_mode(args, model: str, mode: str, device, bandwidth: float, adapters: dict) -> tuple[dict, list[dict], object]:
    """One engine; every (adapter set, batch) case on it. Returns its info, the rows and the engine."""
    lora = mode.endswith("+lora")
    t0 = time.perf_counter()
    engine = build_engine(args, model, mode, device, args.max_loras)
    info = bc.engine_info(engine, time.perf_counter() - t0)
    bc.fill_kv_random(engine)
    sets = args.adapter_sets if lora else ["base"]
    if lora:
        register_adapters(engine, sets, adapters, args.seed)
        fill_pool(engine, args.fill_pool, adapters, args.seed)
        info["lora_pool_used_bytes"] = engine.lora_manager.pool_bytes_used
    rows = []
    cases = [(s, b) for s in sets for b in args.batch_sizes]
    for key, batch in tqdm(cases, desc=f"{model} {mode}", unit="case", disable=None):
        row = {"model": model, "mode": mode, "adapters": key, "batch": batch, "context": args.context}
        rows.append(row)
        names = [name for name, _ in set_adapters(key)] if lora else []
        extra = sum(bc.adapter_bytes(adapters[n], engine.config.model.dtype) for n in names[:batch])
        row.update(bc.run_decode_case(engine, batch, args.context, names, args, bandwidth, extra))
        if "itl_s" in row:
            row["distinct_adapters"] = len(names[:batch])
    return info, rows, engine


def time_captures(infos: dict, engines: dict, rounds: int) -> None:
    """Capture time again, `rounds` times per graph engine, the engines taking turns (so that a slow spell
    of the host falls on both); adds each engine's times and their median to its info in `infos`."""
    runners = {mode: e.runner.graph_runner for mode, e in engines.items() if e.runner.graph_runner}
    times = {mode: [] for mode in runners}
    for _ in tqdm(range(rounds), desc="capture time, again", unit="round", disable=None):
        for mode, runner in runners.items():
            times[mode].append(bc.time_capture(runner))
    for mode, seconds in times.items():
        infos[mode]["recapture_seconds"] = seconds
        infos[mode]["recapture_median_seconds"] = statistics.median(seconds)


def capture_sweep(args, model: str, device, reference, rounds: int) -> dict[int, dict]:
    """Per --capture-max-loras value: a graphs+lora engine built with it captures every bucket again
    `rounds` times in turns with `reference` (the --max-loras engine); its graph count, its median capture
    time and that median over the reference's median in the same turns."""
    sweep = {}
    for max_loras in args.capture_max_loras:
        engine = build_engine(args, model, "graphs+lora", device, max_loras)
        runners = {"sweep": engine.runner.graph_runner, "reference": reference.runner.graph_runner}
        times = {name: [] for name in runners}
        for _ in tqdm(range(rounds), desc=f"capture time, max_loras {max_loras}", unit="round", disable=None):
            for name, runner in runners.items():
                times[name].append(bc.time_capture(runner))
        median = statistics.median(times["sweep"])
        sweep[max_loras] = {"num_graphs": len(engine.runner.graph_runner.graphs), "median_seconds": median,
                            "vs_reference": median / statistics.median(times["reference"]), "seconds": times}
        engine.shutdown()
        del engine, runners
        bc.release_memory()
    return sweep


def find(rows, mode, key, batch) -> dict | None:
    return next((r for r in rows if (r["mode"], r["adapters"], r["batch"]) == (mode, key, batch) and "itl_s" in r),
                None)


def add_base_ratios(rows: list[dict]) -> None:
    for r in rows:
        base = find(rows, "graphs", "base", r["batch"])
        if "itl_s" in r and base is not None:
            r["vs_base_tok_s"] = r["tok_s"] / base["tok_s"]


def make_checks(model: str, rows: list[dict], engines: dict, sweep: dict[int, dict], max_loras: int,
                tp: int = 1) -> list[bc.Check]:
    """The targets (Llama-3-8B); other models' values are reported without a verdict. With several ranks (tp),
    the tensor-parallel target instead: 8 adapters at batch 32 against base, on any model."""
    if tp > 1:
        base32, lora8 = find(rows, "graphs", "base", 32), find(rows, "graphs+lora", "8", 32)
        name = f"{model} tp={tp}: graphs+LoRA 8 adapters B=32 tok/s / base tok/s"
        if base32 is None or lora8 is None:
            return [bc.Check(name, "not measured", f">= {TP_TARGET_8_AT_32}", None)]
        value = lora8["tok_s"] / base32["tok_s"]
        return [bc.Check(name, f"{value:.3f}", f">= {TP_TARGET_8_AT_32}", value >= TP_TARGET_8_AT_32)]
    judged = model == TARGET_MODEL

    def check(name, value, target, met):
        return bc.Check(f"{model}: {name}", value, target, met if judged else None)

    def ratio(name, num, den, target, le=False):
        sign = "<=" if le else ">="
        if num is None or den is None:
            return bc.Check(f"{model}: {name}", "not measured", f"{sign} {target}", None)
        value = num / den
        return check(name, f"{value:.3f}", f"{sign} {target}", value <= target if le else value >= target)

    base32, base1 = find(rows, "graphs", "base", 32), find(rows, "graphs", "base", 1)
    lora8, lora1 = find(rows, "graphs+lora", "8", 32), find(rows, "graphs+lora", "1", 1)
    checks = [ratio("graphs+LoRA 8 adapters B=32 tok/s / base tok/s", lora8 and lora8["tok_s"],
                    base32 and base32["tok_s"], TARGET_8_AT_32),
              ratio("graphs+LoRA 1 adapter B=1 ITL / base ITL", lora1 and lora1["itl_s"], base1 and base1["itl_s"],
                    TARGET_1_AT_1, le=True)]
    base, with_lora = engines.get("graphs"), engines.get("graphs+lora")
    if base and with_lora and base["num_graphs"]:
        counts = {max_loras: with_lora["num_graphs"]} | {m: v["num_graphs"] for m, v in sweep.items()}
        checks.append(check("graphs captured with LoRA (by max_loras) / without",
                            ", ".join(f"{n} (max_loras {m})" for m, n in sorted(counts.items()))
                            + f" / {base['num_graphs']}", "equal",
                            all(n == base["num_graphs"] for n in counts.values())))
    if len(sweep) >= 2:
        low, high = min(sweep), max(sweep)
        growth = sweep[high]["vs_reference"] / sweep[low]["vs_reference"]
        checks.append(check(f"capture time at max_loras {high} / at max_loras {low} (medians, each in turns with "
                            f"max_loras {max_loras})", f"{growth:.3f} ({sweep[high]['median_seconds']:.3f} / "
                            f"{sweep[low]['median_seconds']:.3f} s)", f"<= {CAPTURE_GROWTH_LIMIT} (does not grow)",
                            growth <= CAPTURE_GROWTH_LIMIT))
    return checks


def print_results(model: str, rows: list[dict], engines: dict, sweep: dict[int, dict], args) -> None:
    headers = ["mode", "adapters", "B", "ITL ms", "tok/s", "vs base", "floor ms", "ITL/floor", "GB/s"]
    table = [[r["mode"], r["adapters"], r["batch"] if r["used_graph"] or "graphs" not in r["mode"] else
              f"{r['batch']}*", 1e3 * r["itl_s"], r["tok_s"], r.get("vs_base_tok_s"), 1e3 * r["floor_s"],
              r["floor_ratio"], r["gb_s"]] for r in rows if "itl_s" in r]
    print(f"\n{model}, context {args.context}, {args.steps} timed steps after {args.warmup} warm-up "
          "(vs base = tok/s over base graphs tok/s; * = no graph bucket, ran eagerly):")
    bc.print_table(headers, table)
    for r in rows:
        if "skipped" in r:
            print(f"  skipped {r['mode']} adapters={r['adapters']} B={r['batch']}: {r['skipped']}")
    bc.print_engines(engines, with_kv_blocks=False)
    for max_loras, v in sorted(sweep.items()):
        print(f"engine graphs+lora at max_loras {max_loras}: {v['num_graphs']} graphs, capture median "
              f"{v['median_seconds']:.3f} s, {v['vs_reference']:.3f}x the max_loras {args.max_loras} engine's "
              "in the same turns")


def plot(model: str, rows: list[dict], args) -> None:
    tps, ratio = {}, {}
    for mode in args.modes:
        for key in (["base"] if mode == "graphs" else args.adapter_sets):
            got = [r for r in rows if r["mode"] == mode and r["adapters"] == key and "itl_s" in r]
            label, style = f"{mode} {key}", "k-" if mode == "graphs" else ("o-" if mode == "graphs+lora" else "s--")
            tps[label] = ([r["batch"] for r in got], [r["tok_s"] for r in got], style)
            got = [r for r in got if "vs_base_tok_s" in r]
            ratio[label] = ([r["batch"] for r in got], [r["vs_base_tok_s"] for r in got], style)
    stem = model.split(":")[-1].replace("/", "_")
    bc.save_plot(args.out, f"lora_decode_{stem}.png", [
        dict(title=f"Multi-LoRA decode, {model}, ctx {args.context}", xlabel="batch size", ylabel="output tokens/s",
             series=tps, logx=True, logy=True),
        dict(title="tok/s relative to base graphs", xlabel="batch size", ylabel="ratio", series=ratio, logx=True)])


def main(argv=None) -> int:
    args = parse_args(argv)
    device = bc.bench_device(args.device)
    if device.type != "cuda":
        print("note: CUDA graphs need a CUDA device; running the eager+lora mode only")
        args.modes = [m for m in args.modes if not m.startswith("graphs")] or ["eager+lora"]
    bandwidth = bc.measure_bandwidth(device)
    print(f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s on {device}")
    results, engines_by_model, sweeps, checks = [], {}, {}, []
    report = {"benchmark": "lora_decode", "args": vars(args), "env": bc.environment(device),
              "bandwidth_bytes_per_s": bandwidth, "engines": engines_by_model, "capture_sweep": sweeps,
              "results": results, "checks": checks}
    for model in args.models:
        engines, rows, adapters, alive = {}, [], {}, {}
        engines_by_model[model] = engines
        for mode in args.modes:  # the engines of a model stay alive until its capture times are taken
            engines[mode], mode_rows, engine = run_mode(args, model, mode, device, bandwidth, adapters)
            if args.capture_rounds:
                alive[mode] = engine
            else:  # no capture times to take: one engine at a time (a 70B's two engines need not fit at once)
                engine.shutdown()
                del engine
                bc.release_memory()
            rows += mode_rows
            bc.write_json(args.out, "lora_decode.json", dict(report, results=results + rows))  # partial
        sweep = {}
        if args.capture_rounds:
            time_captures(engines, alive, args.capture_rounds)
            for mode in ("eager+lora", "graphs"):  # the sweep takes turns with the graphs+lora engine alone
                if mode in alive:
                    alive.pop(mode).shutdown()
            bc.release_memory()
            if "graphs+lora" in alive and args.capture_max_loras:
                sweep = capture_sweep(args, model, device, alive["graphs+lora"], args.capture_rounds)
        sweeps[model] = sweep
        for engine in alive.values():
            engine.shutdown()  # a tensor-parallel engine's workers hold the other GPUs
        del alive
        bc.release_memory()
        add_base_ratios(rows)
        print_results(model, rows, engines, sweep, args)
        plot(model, rows, args)
        checks += make_checks(model, rows, engines, sweep, args.max_loras, args.tensor_parallel_size)
        results += rows
    bc.print_checks(checks)
    bc.write_json(args.out, "lora_decode.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

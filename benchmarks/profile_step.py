"""Where a prefill step's and a mixed step's time goes, on the base engine and on a LoRA engine.

Builds the base engine, then a LoRA engine with --adapters random adapters of rank --lora-rank on all
7 projections or on --targets (ranks cycle through --lora-rank when it lists several), and times two kinds
of step on each, with the same token counts:

- prefill: fresh prompts of --prompt-len tokens filling the step's token budget (each asks for one
  output token), spread over the adapters;
- mixed: --decode-rows sequences decoding (random KV, bench_common.start_decode_batch) plus one prompt
  chunk that fills the rest of the budget.

Each step is timed from the host (the step ends with a device sync: its tokens come back), then a
few more run under the torch profiler, whose kernel times are summed by kind: GEMM, attention, LoRA
shrink, LoRA expand, fused elementwise ops, other kernels; "GPU idle" is the step's wall time that no
kernel covers (host work the GPU waits for). Prints one table per step kind and the LoRA/base ratio of
step time; writes profile_step.json to --out. The ops that expand a layer's LoRA factors (rotary, RMSNorm,
SiLU*mul) count as elementwise; the kernels that place the products' factors beside x and W (the products
summed inside the base GEMMs) as other. --factored-only LAYERS runs the LoRA engine's steps again without
the products in the GEMMs, with only those packed layers passing factors to the next op (the others adding
their product in place), e.g. `--factored-only gate_up_proj`, or `--factored-only none`.

    python benchmarks/profile_step.py --model synthetic:llama-3-8b --adapters 8
    python benchmarks/profile_step.py --model synthetic:llama-3-8b --adapters 64 --lora-rank 8,16,32,64
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bench_common as bc  # noqa: E402
from loraserve import LoRARequest, SamplingParams  # noqa: E402
from loraserve.config import EngineArgs  # noqa: E402
from loraserve.engine.engine import LLMEngine  # noqa: E402
from loraserve.lora.synthetic import random_adapter  # noqa: E402

# kernel kinds, by a piece of the kernel's name (first match wins); the rest are "other"
KERNEL_KINDS = (
    ("LoRA shrink", ("_shrink_kernel",)),
    ("LoRA expand", ("_expand_kernel",)),
    ("attention", ("_prefill_kernel", "_decode_kernel", "_decode_reduce_kernel")),
    ("elementwise", ("_rms_norm", "_silu", "_rotary")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "sm90", "sm80", "cublas", "splitk")),
)
COLUMNS = ("GEMM", "attention", "LoRA shrink", "LoRA expand", "elementwise", "other")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p, "synthetic:llama-3-8b")
    p.add_argument("--adapters", type=int, default=8, help="distinct adapters in each step")
    p.add_argument("--lora-rank", type=bc.int_list, default=[16], help="rank, or ranks cycled over the adapters")
    p.add_argument("--targets", type=bc.str_list, default=None,
                   help="comma-separated PEFT module names of the adapters (default: all seven projections)")
    p.add_argument("--prompt-len", type=int, default=1024, help="tokens of each prefill prompt")
    p.add_argument("--decode-rows", type=int, default=64, help="decoding sequences in the mixed step")
    p.add_argument("--context", type=int, default=512, help="context of the decoding sequences")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="step token budget (engine default)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per case (median)")
    p.add_argument("--profiled-steps", type=int, default=3)
    p.add_argument("--factored-only", type=bc.str_list, default=None,
                   help="also run the LoRA steps without the products in the GEMMs, only these packed layers passing "
                        "factors ('none': no layer)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.profiled_steps = 2, 1
    return args


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, pieces in KERNEL_KINDS:
        if any(piece.lower() in low for piece in pieces):
            return kind
    return "other"


class StepCase:
    """One kind of step, repeatable: `prepare()` queues its requests, `engine.step()` runs it."""

    def __init__(self, engine, args, kind: str, adapters: list[str | None], rng):
        self.engine, self.args, self.kind, self.adapters, self.rng = engine, args, kind, adapters, rng
        self.vocab = engine.hf_config.vocab_size
        self.budget = engine.config.scheduler.max_num_batched_tokens
        self.count = 0
        self.decoding: list[str] = []

    def start(self) -> None:
        if self.kind == "mixed":
            self.decoding = bc.start_decode_batch(self.engine, self.args.decode_rows, self.args.context, 200,
                                                  self.adapters, seed=self.args.seed)
            self.engine.step()  # the decode rows' first step (their prefill is skipped)

    def prepare(self) -> int:
        """Queue the next step's prompts; returns the prompt tokens it will compute."""
        params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
        if self.kind == "prefill":
            lengths = [self.args.prompt_len] * max(1, self.budget // self.args.prompt_len)
        else:
            lengths = [self.budget - self.args.decode_rows]
        for length in lengths:
            name = self.adapters[self.count % len(self.adapters)]
            self.engine.add_request(f"{self.kind}-{self.count}", self.rng.integers(0, self.vocab, length).tolist(),
                                    params, LoRARequest(name) if name is not None else None)
            self.count += 1
        return sum(lengths)

    def finish(self) -> None:
        bc.abort_all(self.engine, self.decoding)
        while self.engine.has_unfinished_requests():
            self.engine.step()


def timed_steps(case: StepCase, steps: int) -> list[float]:
    """Seconds of each of `steps` steps, each from a synced device to a synced device."""
    times = []
    for _ in range(steps):
        case.prepare()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        case.engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def profiled_steps(case: StepCase, steps: int) -> dict[str, float]:
    """Seconds per step by kernel kind, and 'GPU idle' (wall time not covered by kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        walls = timed_steps(case, steps)
    kinds = dict.fromkeys(COLUMNS, 0.0)
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.self_device_time_total > 0:
            kinds[kernel_kind(evt.key)] += evt.self_device_time_total * 1e-6 / steps
    busy = sum(kinds.values())
    kinds["GPU kernels"] = busy
    kinds["GPU idle"] = max(0.0, statistics.median(walls) - busy)
    return kinds


def run_engine(args, lora: bool, device) -> dict:
    lora_options = dict(enable_lora=True, max_loras=max(args.adapters, 1), max_lora_rank=max(args.lora_rank)) \
        if lora else {}
    engine = LLMEngine.from_args(EngineArgs(
        args.model, device=device, dtype=args.dtype, seed=args.seed, async_scheduling=False,
        max_model_len=min(bc.model_max_len(args.model) or 2**20,
                          max(args.prompt_len, args.context + 256, (args.max_num_batched_tokens or 8192) + 1)),
        max_num_seqs=max(256, args.decode_rows + 16), max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=0.9, **lora_options))
    adapters: list[str | None] = [None]
    if lora:
        spec = engine.lora_manager.runtime.spec
        adapters = []
        for i in range(args.adapters):
            rank = args.lora_rank[i % len(args.lora_rank)]
            engine.lora_manager.register_adapter(f"a{i}", random_adapter(spec, f"a{i}", rank,
                                                 tuple(args.targets) if args.targets else None, seed=i))
            adapters.append(f"a{i}")
        engine.lora_manager.prepare(set(adapters), set())  # resident before timing: no load inside a step
    bc.fill_kv_random(engine)
    rng = np.random.default_rng(args.seed)
    results = {"lora" if lora else "base": run_cases(engine, args, adapters, rng)}
    if lora and args.factored_only is not None:
        runtime = engine.lora_manager.runtime
        layers = [layer for _, layer in runtime.layers]
        default, in_gemms = [layer.factored for layer in layers], runtime.gemm_columns
        runtime.gemm_columns = False
        packed = {tuple(slices): name for name, slices in engine.runner.model.packed_modules.items()}
        for layer in layers:  # a packed layer by its name (qkv_proj), another by its module's (o_proj)
            layer.factored = packed.get(layer.slice_names, layer.slice_names[0]) in args.factored_only
        results[f"lora, factored: {','.join(args.factored_only)}"] = run_cases(engine, args, adapters, rng)
        for layer, factored in zip(layers, default):
            layer.factored = factored
        runtime.gemm_columns = in_gemms
    del engine
    bc.release_memory()
    return results


def run_cases(engine, args, adapters: list[str | None], rng) -> dict:
    """The prefill and the mixed step on `engine`: median step time and kernel times by kind."""
    results = {}
    for kind in ("prefill", "mixed"):
        case = StepCase(engine, args, kind, adapters, rng)
        case.start()
        tokens = case.prepare()  # warm-up step (first use of this shape)
        engine.step()
        times = timed_steps(case, args.steps)
        profile = profiled_steps(case, args.profiled_steps)
        case.finish()
        step = statistics.median(times)
        results[kind] = {"step_s": step, "tokens": tokens + (args.decode_rows if kind == "mixed" else 0),
                         "tok_s": (tokens + (args.decode_rows if kind == "mixed" else 0)) / step, "kernels_s": profile}
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    device = bc.bench_device(args.device)
    if device.type != "cuda":
        raise SystemExit("profile_step needs CUDA (it reads kernel times from the CUDA profiler)")
    results = run_engine(args, False, device)
    if args.adapters:
        results.update(run_engine(args, True, device))
    for kind in ("prefill", "mixed"):
        rows = []
        for name, res in results.items():
            r = res[kind]
            rows.append([name, r["tokens"], 1e3 * r["step_s"]] + [1e3 * r["kernels_s"][c] for c in COLUMNS]
                        + [1e3 * r["kernels_s"]["GPU idle"]])
        print(f"\n{kind} step ({args.model}"
              + (f", {args.adapters} adapters of rank {','.join(map(str, args.lora_rank))}" if args.adapters else "")
              + (f", {args.decode_rows} decode rows at context {args.context}" if kind == "mixed" else "") + "), ms:")
        bc.print_table(["engine", "tokens", "step"] + list(COLUMNS) + ["GPU idle"], rows)
        for name in results:
            if name != "base":
                print(f"{name} / base step time: {results[name][kind]['step_s'] / results['base'][kind]['step_s']:.3f}")
    bc.write_json(args.out, "profile_step.json", {"benchmark": "profile_step", "args": vars(args),
                                                  "env": bc.environment(device), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

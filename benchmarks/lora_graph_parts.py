"""Where LoRA's cost in a decode graph goes: the bucket's graph recaptured with parts of the LoRA layers left out.

Builds a LoRA engine with B sequences in the decode state over N adapters (as profile_decode.py does), then
for each variant recaptures the graph of B's bucket on the same GPU and times its replay (median of --reps,
CUDA events), the variants in turn for --rounds rounds, and prints the torch profiler's GPU time per replay
by kernel kind in the first round. Variants other than `full` compute wrong outputs: they are for timing
only, and the engine is not used to serve afterwards.

- full: as the engine serves (each LoRA layer forks the side stream, runs its shrink and expand there
  beside the base GEMM and joins back);
- base: the LoRA layers run their base layer alone (no fork, no join, no delta);
- fork-join: the forks and joins and the delta read by the next op, without the shrink and expand kernels;
- no-shrink / no-expand: one of the two kernels left out;
- no-join: the side stream is joined back only after the model's last LoRA layer;
- no-fork: the side stream waits for the main one only before the first LoRA layer;
- no-edges: both: one fork before the first LoRA layer and one join after the last;
- edges-only: the forks and joins alone (no kernels, and the next op reads no delta); forks-only and
  joins-only: the same with one join after the last LoRA layer, or one fork before the first;
- delta-only: the next op reads a delta from the scratch, with no fork, join or kernel;
- inline, inline-MODULE: every LoRA layer, or those holding PEFT module MODULE (e.g. inline-o_proj), add
  their products in order on the main stream, in place (the path of steps larger than the side stream takes;
  right outputs);
- any of them with -no-pdl (e.g. base-no-pdl): every kernel launched without programmatic dependent launch
  (the fused ops after the GEMMs then wait for the GEMM's end before they start).

    python benchmarks/lora_graph_parts.py --batch 32 --adapters 8 --lora-rank 16
    python benchmarks/lora_graph_parts.py --batch 256 --adapters 200 --lora-rank 8 \
        --targets q_proj,k_proj,v_proj,o_proj --variants full,base,fork-join
    python benchmarks/lora_graph_parts.py --variants full,inline,inline-o_proj,inline-down_proj
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from unittest import mock

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(__file__)]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_common import fill_kv_random, start_decode_batch  # noqa: E402
from loraserve.config import EngineArgs  # noqa: E402
from loraserve.engine.engine import LLMEngine  # noqa: E402
from loraserve.lora.layers import LoRALinear  # noqa: E402
from loraserve.lora.synthetic import random_adapter  # noqa: E402
from loraserve.models.linear import LinearOutput  # noqa: E402

VARIANTS = ("full", "base", "fork-join", "no-shrink", "no-expand", "no-join", "no-fork", "no-edges", "edges-only",
            "forks-only", "joins-only", "delta-only", "inline")
KINDS = (("shrink", ("shrink",)), ("expand", ("expand",)),
         ("attention", ("decode_kernel", "reduce_kernel", "attn")),
         ("gemm", ("gemm", "cutlass", "sm90", "xmma", "cublas")))


NO_PDL = "-no-pdl"
# variant -> the LoRA kernels it leaves out of each layer's bound pair (BoundLoRADelta.shrink / .expand)
LEFT_OUT = {"fork-join": ("shrink", "expand"), "no-shrink": ("shrink",), "no-expand": ("expand",)}
# variant -> (a fork per LoRA layer, a join per LoRA layer); the side stream otherwise forked once before the first
# and joined once after the last
EDGES = {"no-join": (True, False), "no-fork": (False, True), "no-edges": (False, False),
         "edges-only": (True, True), "forks-only": (True, False), "joins-only": (False, True)}
NO_KERNELS = ("edges-only", "forks-only", "joins-only")  # the side stream waits for each fork and launches nothing


def leave_out(model: torch.nn.Module, kernels: tuple[str, ...]) -> None:
    """Make the LoRA layers' bound launches named in `kernels` launch nothing (until the layers bind again)."""
    for layer in model.modules():
        if isinstance(layer, LoRALinear):
            for bound in layer._bound.values():
                for kernel in kernels:
                    setattr(bound, kernel, lambda *args, **kwargs: None)


class _OnStream:
    """A LoRA layer's fork or join event recorded on another stream than the layer asks for, so that waiting
    for it orders nothing: the fork on the side stream itself, the join on the stream the pass is issued on."""

    def __init__(self, event: torch.cuda.Event, stream: torch.cuda.Stream | None):
        self.event, self.stream = event, stream  # stream None: the current one (the pass's main stream)

    def record(self, stream=None):
        self.event.record(self.stream or torch.cuda.current_stream())

    def wait(self, stream=None):
        self.event.wait(stream)


@contextlib.contextmanager
def with_edges(model: torch.nn.Module, side_stream: torch.cuda.Stream, fork: bool, join: bool):
    """The LoRA layers with the side stream forked (waiting for the main one) only before the first LoRA layer
    unless `fork`, and joined back only after the last one unless `join`."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    saved = [(layer, layer._fork, layer._join) for layer in layers]
    try:
        for layer in layers[1:] if not fork else ():
            layer._fork = _OnStream(layer._fork, side_stream)
        for layer in layers[:-1] if not join else ():
            layer._join = _OnStream(layer._join, None)
        yield
    finally:
        for layer, fork_event, join_event in saved:
            layer._fork, layer._join = fork_event, join_event


def in_order(module: str | None):
    """LoRALinear.forward running the layers that hold PEFT module `module` (all layers: None) without the side
    stream: their products added in place, in order, on the pass's stream."""
    forward = LoRALinear.forward

    def patched(self, x, ctx=None):
        lora = ctx.lora if ctx is not None else None
        if lora is not None and lora.side is not None and (module is None or module in self.slice_names):
            ctx = dataclasses.replace(ctx, lora=dataclasses.replace(lora, side=None))
        return forward(self, x, ctx)
    return mock.patch.object(LoRALinear, "forward", patched)


def variant(name: str, model: torch.nn.Module, side_stream: torch.cuda.Stream):
    """The context that makes the LoRA layers run as variant `name`."""
    if name.endswith(NO_PDL):
        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch("loraserve.kernels.launch.pdl_supported", lambda t: False))
        stack.enter_context(variant(name[:-len(NO_PDL)], model, side_stream))
        return stack
    if name == "full":
        return contextlib.nullcontext()
    if name == "inline" or name.startswith("inline-"):
        return in_order(name[len("inline-"):] or None)
    if name == "base":
        return mock.patch.object(LoRALinear, "forward", lambda self, x, ctx=None: self.base(x))
    if name in LEFT_OUT:
        return contextlib.nullcontext()  # leave_out after the launches are bound
    if name == "delta-only":
        return mock.patch.object(LoRALinear, "forward", _base_with_scratch_delta)
    stack = contextlib.ExitStack()
    if name in NO_KERNELS:
        stack.enter_context(mock.patch.object(LoRALinear, "_launch_on_side",
                                              lambda self, x, meta, side: side.stream.wait_event(self._fork)))
    fork, join = EDGES[name]
    stack.enter_context(with_edges(model, side_stream, fork=fork, join=join))
    return stack


def _base_with_scratch_delta(self, x, ctx=None):
    """LoRALinear.forward as its base layer, returning the side stream's scratch as its delta [T, N]."""
    side = ctx.lora.side if ctx is not None and ctx.lora is not None else None
    y = self.base(x).y
    if side is None or not 0 < x.shape[0] <= side.scratch.max_tokens:
        return LinearOutput(y, None)
    return LinearOutput(y, side.scratch.delta_view(x.shape[0], self.out_features))


def kernel_split(graph: torch.cuda.CUDAGraph, replays: int = 5) -> dict[str, float]:
    """GPU ms per replay of the graph's kernels by kind (side-stream kernels overlap the others)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    for event in prof.key_averages():
        name = event.key.lower()
        kind = next((k for k, words in KINDS if any(w in name for w in words)), "other")
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e3 / replays
    return {k: round(v, 3) for k, v in sorted(kinds.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="synthetic:llama-3-8b")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--targets", default="", help="comma-separated PEFT module names (default: every module)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n.removesuffix(NO_PDL) not in VARIANTS and not n.startswith("inline-")]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.adapters < 1:
        parser.error("--adapters must be at least 1")
    engine = LLMEngine.from_args(EngineArgs(
        args.model, max_model_len=args.context + 256, max_num_seqs=args.batch, gpu_memory_utilization=0.85,
        enable_lora=True, max_loras=args.adapters, max_lora_rank=args.lora_rank))
    targets = tuple(args.targets.split(",")) if args.targets else None
    adapters = [f"a{i}" for i in range(args.adapters)]
    for i, name in enumerate(adapters):
        engine.lora_manager.register_adapter(
            name, random_adapter(engine.lora_manager.runtime.spec, name, args.lora_rank, targets, seed=i))
    fill_kv_random(engine)
    start_decode_batch(engine, args.batch, args.context, 100, adapters)
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    runner, model = engine.runner.graph_runner, engine.runner.model
    side_stream = engine.lora_manager.runtime.side.stream
    bucket = runner.bucket_for(args.batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        for name in names:
            for layer in model.modules():  # launches bound in another variant would be reused
                if isinstance(layer, LoRALinear):
                    layer._bound.clear()
            with variant(name, model, side_stream), torch.inference_mode():
                runner._forward(bucket)  # binds the launches outside the capture
                torch.cuda.synchronize()
                leave_out(model, LEFT_OUT.get(name.removesuffix(NO_PDL), ()))
                graph, _ = runner.capture_bucket(bucket)
            replays = []
            for _ in range(args.reps):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                replays.append(start.elapsed_time(end))
            times[name].append(float(np.median(replays)))
            print(f"round {rnd} {name:10s} replay {times[name][-1]:.3f} ms", flush=True)
            if rnd == 0:
                print(f"    GPU ms per replay by kernel kind: {kernel_split(graph)}", flush=True)
            del graph
    first = np.mean(times[names[0]])
    print(f"{args.model} B={args.batch} context={args.context} adapters={args.adapters} rank={args.lora_rank} "
          f"targets={args.targets or 'all'}; replay ms, mean of the rounds' medians:")
    for name in names:
        print(f"  {name:10s} {np.mean(times[name]):.3f} ({np.mean(times[name]) / first:.3f}x {names[0]})")


if __name__ == "__main__":
    main()

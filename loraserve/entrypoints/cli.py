"""The `loraserve` command: generate, serve, bench."""
from __future__ import annotations

import argparse
import dataclasses
import runpy
import sys
import time
from pathlib import Path

from loraserve.entrypoints.engine_flags import add_engine_flags, engine_args
from loraserve.entrypoints.llm import LLM
from loraserve.entrypoints.serve_cli import add_serve_arguments, parse_lora_module, run_server
from loraserve.entrypoints.version import package_version
from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams


DEMO_PROMPT = "What is the capital of France?"


def _usage_error(message: str) -> int:
    """argparse's way: the message on stderr, exit status 2."""
    print(f"loraserve generate: error: {message}", file=sys.stderr)
    return 2


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*", help="prompts (and/or --prompts-file; one of them, or --demo, is required)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--demo", action="store_true", help=f"ask the chat model {DEMO_PROMPT!r} (no prompt needed)")
    add_engine_flags(p)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="in [0, 2], as the server takes it; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="a stop string (repeat the flag for more: --stop A --stop B)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--lora", nargs="+", type=parse_lora_module, default=[], metavar="NAME=PATH", help="adapters to register")
    p.add_argument("--lora-root", default=None, metavar="DIR",
                   help="a folder of adapters: --use-lora may name any adapter folder in it")
    p.add_argument("--use-lora", default=None, metavar="NAME",
                   help="generate with this adapter (one given with --lora, or a folder in --lora-root)")


def run_generate(args: argparse.Namespace) -> int:
    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file) as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as exc:
            return _usage_error(f"--prompts-file {args.prompts_file!r}: {exc.strerror or exc}")
    if args.demo:
        prompts, args.chat = prompts or [DEMO_PROMPT], True
    if not prompts:
        return _usage_error("no prompt: give one or more prompts, a --prompts-file with prompts in it, or --demo")
    if not 0.0 <= args.temperature <= 2.0:
        return _usage_error(f"--temperature must be in [0, 2], got {args.temperature}")
    if args.use_lora and args.use_lora not in {n for n, _ in args.lora} and not args.lora_root:
        raise SystemExit(f"--use-lora {args.use_lora!r} is not one of the adapters given with --lora "
                         "(or give --lora-root DIR to take it from DIR)")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos)
    options = dataclasses.replace(engine_args(args, enable_lora=bool(args.lora or args.lora_root)),
                                  lora_root=args.lora_root)
    llm = LLM(**dataclasses.asdict(options))
    for name, path in args.lora:
        llm.add_lora(LoRARequest(name, path))
    lora = LoRARequest(args.use_lora) if args.use_lora else None
    start = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, lora)
    else:
        outputs = llm.generate(prompts, params, lora)
    elapsed = time.perf_counter() - start
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for prompt, out in zip(prompts, outputs):
        print(f"### {prompt}\n{out.outputs[0].text}\n[{len(out.outputs[0].token_ids)} tokens, "
              f"finish: {out.outputs[0].finish_reason}]\n")
    print(f"{n_tokens} tokens in {elapsed:.2f} s: {n_tokens / elapsed:.1f} tokens/s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"loraserve {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_arguments(sub.add_parser("generate", help="generate text for prompts (offline)"))
    add_serve_arguments(sub.add_parser("serve", help="run the OpenAI-compatible server"))
    bench = sub.add_parser("bench", help="benchmarks (see benchmarks/)")
    bench.add_argument("which", choices=["decode", "throughput", "lora", "lora-kernels", "many-adapters",
                                         "cold-start", "adapter-reads", "cpu-prefill", "prefix-cache"])
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    return parser


def run_bench(args: argparse.Namespace) -> int:
    script = {"decode": "decode.py", "throughput": "throughput.py", "lora": "lora_decode.py",
              "lora-kernels": "lora_kernels.py", "many-adapters": "many_adapters.py",
              "cold-start": "cold_start.py", "adapter-reads": "adapter_reads.py", "cpu-prefill": "cpu_prefill.py",
              "prefix-cache": "prefix_cache.py"}[args.which]
    path = Path(__file__).resolve().parents[2] / "benchmarks" / script
    if not path.is_file():
        raise SystemExit(f"benchmark script {path} not found (benchmarks live in the source checkout)")
    sys.argv = [str(path)] + list(args.args)
    runpy.run_path(str(path), run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        try:
            return run_generate(args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.command == "serve":
        run_server(args)
        return 0
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())

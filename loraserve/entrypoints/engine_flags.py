"""The engine flags that `loraserve generate` and `loraserve serve` share (named as in vLLM), with the
defaults of loraserve.config.EngineArgs, and the EngineArgs they give."""
from __future__ import annotations

import argparse

from loraserve.config import EngineArgs

_DEFAULTS = EngineArgs()


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model folder, .gguf file or synthetic:NAME (default: SmolLM2-135M-Instruct, built in)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or auto (default: auto)")
    parser.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="engine seed")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion (default: the model's, at most 8192)")
    parser.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs,
                        help="most requests running at once")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=_DEFAULTS.async_scheduling,
                        help="schedule and launch the next step before reading the current one's tokens")
    parser.add_argument("--max-loras", type=int, default=_DEFAULTS.max_loras,
                        help="most distinct adapters one step mixes (default: max-num-seqs, at most 256)")
    parser.add_argument("--max-lora-rank", type=int, default=_DEFAULTS.max_lora_rank,
                        help="largest adapter rank accepted")
    parser.add_argument("--lora-gpu-memory", type=float, default=_DEFAULTS.lora_gpu_memory,
                        help="GiB of GPU memory for the adapter pool; adapters take pages for their own rank "
                             "(default: 22%% of the memory the KV cache could take, and what it could never use, "
                             "up to room for max-loras adapters of max-lora-rank)")
    parser.add_argument("--max-cpu-lora-memory", type=float, default=_DEFAULTS.max_cpu_lora_memory,
                        help="GiB of host memory caching adapters, least recently used out")
    parser.add_argument("--max-cpu-loras", type=int, default=_DEFAULTS.max_cpu_loras,
                        help="most adapters cached in host memory (default: as many as fit in the bytes)")


def engine_args(args: argparse.Namespace, enable_lora: bool) -> EngineArgs:
    """The EngineArgs of parsed engine flags (add_engine_flags)."""
    return EngineArgs(model=args.model, device=args.device, dtype=args.dtype, seed=args.seed,
                      max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                      enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
                      enable_lora=enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                      lora_gpu_memory=args.lora_gpu_memory, max_cpu_lora_memory=args.max_cpu_lora_memory,
                      max_cpu_loras=args.max_cpu_loras)

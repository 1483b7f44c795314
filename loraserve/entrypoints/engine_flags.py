"""The engine flags that `loraserve generate` and `loraserve serve` share (named as in vLLM), with the
defaults of loraserve.config.EngineArgs, and the EngineArgs they give."""
from __future__ import annotations

import argparse
import os

from loraserve.config import EngineArgs

_DEFAULTS = EngineArgs()


def chat_template_arg(value: str) -> str:
    """--chat-template: a file holding a Jinja chat template, or the template itself (vLLM's two forms)."""
    if os.path.isfile(value):
        try:
            with open(value) as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise argparse.ArgumentTypeError(f"can't read chat template file {value!r}: {exc}") from exc
    if any(c in value for c in "{}\n"):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither a chat template file nor a template")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model folder, Hugging Face repo id in the local cache, .gguf file or synthetic:NAME "
                             "(default: SmolLM2-135M-Instruct, built in)")
    parser.add_argument("--tokenizer", default=None,
                        help="HF tokenizer folder to use instead of the model's own")
    parser.add_argument("--chat-template", type=chat_template_arg, default=None,
                        help="a Jinja chat template, or a file holding one, instead of the tokenizer's")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or auto (default: auto)")
    parser.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="engine seed")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion (default: the model's, at most 8192)")
    parser.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs,
                        help="most requests running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS.max_num_batched_tokens,
                        help="token budget of one step, prompt chunks and decodes together "
                             "(default: 8192 on CUDA, 2048 on the CPU, at least max-num-seqs)")
    parser.add_argument("--block-size", type=int, default=_DEFAULTS.block_size, help="tokens per KV cache block")
    parser.add_argument("--gpu-memory-utilization", type=float, default=_DEFAULTS.gpu_memory_utilization,
                        help="share of the GPU's memory the engine may use (weights, KV cache, adapters, graphs)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=_DEFAULTS.enable_prefix_caching,
                        help="reuse the KV cache of prompt prefixes seen before (per adapter weights)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=_DEFAULTS.tensor_parallel_size,
                        help="split the model's layers over this many GPUs (CUDA devices 0..N-1), one process each "
                             "(on the CPU: processes talking through gloo)")
    parser.add_argument("--disable-custom-all-reduce", action="store_true",
                        help="with tensor parallelism on GPUs, every all-reduce through NCCL (by default the small "
                             "fp32/bf16 ones, up to 2 MiB, are one kernel reading the peers' buffers directly)")
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
                             "(default: 22.4%% of the memory the KV cache could take, and what it could never use, "
                             "up to room for twice max-loras adapters of max-lora-rank)")
    parser.add_argument("--max-cpu-lora-memory", type=float, default=_DEFAULTS.max_cpu_lora_memory,
                        help="GiB of host memory caching adapters, least recently used out (on CUDA pinned once, at "
                             "start-up)")
    parser.add_argument("--max-cpu-loras", type=int, default=_DEFAULTS.max_cpu_loras,
                        help="most adapters cached in host memory (default: as many as fit in the bytes)")
    parser.add_argument("--lora-reader", choices=("auto", "process", "thread"), default=_DEFAULTS.lora_reader,
                        help="who reads, checks and packs adapter folders: reader processes (off the engine's "
                             "interpreter), a thread of the engine's process, or auto: the process on CUDA")


def engine_args(args: argparse.Namespace, enable_lora: bool) -> EngineArgs:
    """The EngineArgs of parsed engine flags (add_engine_flags)."""
    return EngineArgs(model=args.model, tokenizer=args.tokenizer, chat_template=args.chat_template,
                      device=args.device, dtype=args.dtype,
                      seed=args.seed, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
                      enable_lora=enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                      lora_gpu_memory=args.lora_gpu_memory, max_cpu_lora_memory=args.max_cpu_lora_memory,
                      max_cpu_loras=args.max_cpu_loras, lora_reader=args.lora_reader,
                      tensor_parallel_size=args.tensor_parallel_size,
                      disable_custom_all_reduce=args.disable_custom_all_reduce)

"""Engine configuration: the options a user sets (EngineArgs) and the frozen, validated EngineConfig built
from them once, before the model's weights are loaded, and passed to every part of the engine.

Derived values (the step's token bound, the metadata sizes that follow from it) are computed here and
nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
DEFAULT_MAX_MODEL_LEN = 8192  # when the user gives none and the model allows more
CPU_STEP_TOKENS, CUDA_STEP_TOKENS = 2048, 8192  # default token budget of one step
MAX_LORAS_PER_STEP = 256  # the default bound on distinct adapters in one step (when max_num_seqs is larger)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None -> CUDA when present, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device}; use 'cpu' or 'cuda'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None/'auto' -> bfloat16 on CUDA, float32 on CPU."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of float32, bfloat16, float16, auto")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class ModelConfig:
    """Which model runs where, in what precision, and the longest sequence it serves."""

    model: str | None  # an HF folder, a .gguf file or synthetic:NAME; None: the built-in default model
    device: torch.device
    dtype: torch.dtype
    max_model_len: int  # prompt + generated tokens of one sequence
    seed: int = 0  # the sampler's generator for requests without a seed of their own

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and how many blocks to allocate."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.90  # share of the GPU's memory the engine may use (CUDA)
    cpu_kv_cache_gb: float = 2.0  # KV cache size on the CPU
    num_gpu_blocks_override: int | None = None  # a fixed number of blocks (tests)
    enable_prefix_caching: bool = True  # reuse the K/V of cached blocks of equal prefixes (same adapter weights)

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size must be 8, 16, 32 or 64, got {self.block_size}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.98:
            raise ValueError(f"gpu_memory_utilization must be in [0.05, 0.98], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_gb <= 0:
            raise ValueError(f"cpu_kv_cache_gb must be positive, got {self.cpu_kv_cache_gb}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be at least 2")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one forward pass can hold: a scheduled step stays within the token budget, and a
        decode step padded to its CUDA graph bucket holds at most max_num_seqs rows. Step buffers (the LoRA
        metadata and its kernels' tile counters) are sized for this."""
        return max(self.max_num_batched_tokens, self.max_num_seqs)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA limits. Capacity is bytes: the GPU adapter pool (`lora_gpu_memory`) holds as many adapters
    as fit at their own ranks, the host cache (`max_cpu_lora_memory`) as many as fit in its budget;
    `max_loras` only bounds how many distinct adapters one step mixes (vLLM's meaning)."""

    max_loras: int = 256  # distinct adapters in one step
    max_lora_rank: int = 64
    lora_gpu_memory: float | None = None  # GiB of GPU adapter pool; None: a share of the memory after the weights
    max_cpu_lora_memory: float = 8.0  # GiB of adapters cached in host memory (on CUDA pinned at start-up)
    max_cpu_loras: int | None = None  # and at most this many of them (vLLM's flag); None: the bytes alone decide
    max_wait_steps: int = 32  # steps a request waits for its adapter before room is made for it
    lora_root: str | None = None  # a folder of adapters served by name on first request
    # who reads adapter folders: "process" (reader processes, off the engine's interpreter), "thread" (a thread
    # of the engine's process) or "auto" (the process on CUDA where it can run, else the thread; lora/reader.py)
    lora_reader: str = "auto"

    def __post_init__(self) -> None:
        if self.lora_reader not in ("auto", "process", "thread"):
            raise ValueError(f"lora_reader must be auto, process or thread, got {self.lora_reader!r}")
        if self.max_wait_steps < 1:
            raise ValueError(f"max_wait_steps must be at least 1, got {self.max_wait_steps}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.lora_gpu_memory is not None and self.lora_gpu_memory <= 0:
            raise ValueError(f"lora_gpu_memory must be positive (GiB), got {self.lora_gpu_memory}")
        if self.max_cpu_lora_memory <= 0:
            raise ValueError(f"max_cpu_lora_memory must be positive (GiB), got {self.max_cpu_lora_memory}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be at least 1, got {self.max_cpu_loras}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: the model's layers split over this many devices, one process each."""

    tensor_parallel_size: int = 1
    disable_custom_all_reduce: bool = False  # every all-reduce through NCCL (no peer-to-peer sums)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")

    def device_of(self, device: torch.device, rank: int) -> torch.device:
        """The device of `rank`: CUDA device `rank` when the engine runs on CUDA with several ranks."""
        if device.type == "cuda" and self.tensor_parallel_size > 1:
            return torch.device("cuda", rank)
        return device


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is built from; made once by EngineArgs.create_config."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    lora: LoRAConfig | None  # None: LoRA is off (no LoRA layers, kernels or metadata)
    enforce_eager: bool = False  # no CUDA graphs
    async_scheduling: bool = True  # launch the next step before reading the tokens of the one in flight
    parallel: ParallelConfig = ParallelConfig()


@dataclass(frozen=True)
class EngineArgs:
    """The engine options a user sets (the keywords of `LLM(...)`, the flags of `loraserve generate` and
    `loraserve serve`), with their defaults; nothing is resolved yet."""

    model: str | None = None
    tokenizer: str | None = None  # an HF tokenizer folder to use instead of the model's own
    chat_template: str | None = None  # a Jinja chat template (its text) to use instead of the tokenizer's
    device: str | torch.device | None = None  # None: CUDA when present
    dtype: str | torch.dtype | None = None  # None/"auto": bfloat16 on CUDA, float32 on CPU
    max_model_len: int | None = None  # None: the model's limit, at most DEFAULT_MAX_MODEL_LEN
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: CPU_/CUDA_STEP_TOKENS, at least max_num_seqs
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 2.0
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    async_scheduling: bool = True
    seed: int = 0
    enable_lora: bool = False
    max_loras: int | None = None  # None: max_num_seqs, at most MAX_LORAS_PER_STEP
    max_lora_rank: int = 64
    lora_gpu_memory: float | None = None
    max_cpu_lora_memory: float = 8.0
    max_cpu_loras: int | None = None
    lora_root: str | None = None
    lora_reader: str = "auto"
    tensor_parallel_size: int = 1  # ranks (devices, one process each) the model's layers are split over
    disable_custom_all_reduce: bool = False  # small sums peer to peer unless set (vLLM's name)

    def check(self) -> None:
        """Validate what does not depend on the model (before anything is read from disk)."""
        self._device_and_dtype()
        self._cache()
        self._lora()
        self._parallel()
        if self.tensor_parallel_size > 1 and self.lora_reader == "process":
            raise ValueError("lora_reader='process' is not available with tensor parallelism (rank 0 reads "
                             "adapters on a thread and cuts every rank's part): use 'auto' or 'thread'")

    def create_config(self, max_position_embeddings: int) -> EngineConfig:
        """The engine's config for a model of this many positions."""
        device, dtype = self._device_and_dtype()
        limit = max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"{limit}")
        max_model_len = self.max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = max(CPU_STEP_TOKENS if device.type == "cpu" else CUDA_STEP_TOKENS, self.max_num_seqs)
        return EngineConfig(
            model=ModelConfig(self.model, device, dtype, max_model_len, self.seed),
            cache=self._cache(),
            scheduler=SchedulerConfig(self.max_num_seqs, budget, max_model_len),
            lora=self._lora(),
            enforce_eager=self.enforce_eager,
            async_scheduling=self.async_scheduling,
            parallel=self._parallel())

    def _device_and_dtype(self) -> tuple[torch.device, torch.dtype]:
        device = resolve_device(self.device)
        return device, resolve_dtype(self.dtype, device)

    def _cache(self) -> CacheConfig:
        return CacheConfig(self.block_size, self.gpu_memory_utilization, self.cpu_kv_cache_gb,
                           self.num_gpu_blocks_override, self.enable_prefix_caching)

    def _parallel(self) -> ParallelConfig:
        parallel = ParallelConfig(self.tensor_parallel_size, self.disable_custom_all_reduce)
        device = resolve_device(self.device)
        if device.type == "cuda" and self.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} needs as many CUDA devices, but "
                             f"{torch.cuda.device_count()} are visible")
        if device.type == "cuda" and device.index not in (None, 0) and self.tensor_parallel_size > 1:
            raise ValueError(f"with tensor_parallel_size > 1 the ranks use CUDA devices 0..N-1; device {device} "
                             "can't be chosen (set CUDA_VISIBLE_DEVICES instead)")
        return parallel

    def _lora(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        max_loras = self.max_loras if self.max_loras is not None else min(self.max_num_seqs, MAX_LORAS_PER_STEP)
        return LoRAConfig(max_loras, self.max_lora_rank, self.lora_gpu_memory, self.max_cpu_lora_memory,
                          self.max_cpu_loras, lora_root=self.lora_root, lora_reader=self.lora_reader)

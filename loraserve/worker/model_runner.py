"""Runs one scheduled step on the device: step inputs -> forward (graph or eager) -> logits -> sampled tokens.

With tensor parallelism every rank has a ModelRunner over its part of the
model; all of them run the same device work in the same order (their layers'
collectives meet). Rank 0's runner is the engine's: `execute` prepares the
step, sends it to the other ranks once (`followers`, the worker processes),
runs it and samples; the other ranks' runners `follow` the steps they get.
Start-up (the KV cache's size, the warm-up, graph capture and the graph check)
runs on every rank, the ranks agreeing on sizes and verdicts. The graphs of steps
that prefill (worker/mixed_graphs.py) are captured with one rank only.
"""
from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from loraserve.config import EngineConfig
from loraserve.distributed import NO_PARALLEL, ParallelGroup
from loraserve.forward_context import AttentionMetadata, ForwardContext
from loraserve.lora.runtime import KVRoom, LoRARuntime
from loraserve.models.attention import PagedAttention
from loraserve.sequence import Sequence, SchedulerOutput
from loraserve.worker.cuda_graphs import CUDAGraphRunner
from loraserve.worker.graph_check import verify_graphs, verify_mixed_graphs
from loraserve.worker.mixed_graphs import MixedGraphRunner
from loraserve.worker.sampler import PromptLogprobs, SampledTokens, Sampler, TokenHistory
from loraserve.worker.step_inputs import DeviceStep, PendingTokenFill, PromptLogprobRows, StepInputs

logger = logging.getLogger(__name__)


def kv_bytes_per_block(attn_layers: list[PagedAttention], block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block in every attention layer."""
    a = attn_layers[0]
    return 2 * len(attn_layers) * block_size * a.num_kv_heads * a.head_dim * torch.empty((), dtype=dtype).element_size()


def useful_kv_blocks(config: EngineConfig) -> int:
    """The most KV blocks the engine can ever hold at once: max_num_seqs sequences of max_model_len."""
    return config.scheduler.max_num_seqs * -(-config.model.max_model_len // config.cache.block_size)


def kv_room_bytes(model, config: EngineConfig) -> int:
    """CUDA memory free now for the KV cache: within gpu_memory_utilization, less a reserve for activations
    (the step's widest intermediates and the logits). Memory the allocator holds unused is given back first."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(config.model.device)
    cfg, sched = model.config, config.scheduler
    width = 4 * cfg.hidden_size + 3 * cfg.intermediate_size
    reserve = 2**30 + sched.max_num_batched_tokens * width * 4 * 4 + sched.max_num_seqs * cfg.vocab_size * 4 * 4
    return int(max(0.0, free - total * (1.0 - config.cache.gpu_memory_utilization) - reserve))


def kv_cache_need(model, config: EngineConfig) -> tuple[int, int]:
    """(bytes the KV cache could take now, bytes it can ever use) on CUDA, before the cache is allocated: what
    the LoRA adapter pool is sized against."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    block = kv_bytes_per_block(layers, config.cache.block_size, config.model.dtype)
    return kv_room_bytes(model, config), useful_kv_blocks(config) * block


def warm_up_sizes(budget: int) -> list[int]:
    """The token counts of the start-up warm-up passes: each power of two p from 32 up to the step budget, p + 1
    and p + 2, and the budget. The kernels' shapes change only past powers of two (the LoRA kernels' tiles and
    K splits; the side stream's 512-token scratch, past which the LoRA eager path starts), so p + 1 and p + 2
    start each range of one shape, odd and even: Triton specializes an integer argument on whether 16 divides
    it, and the kernels whose token-derived arguments are not marked do_not_specialize (the shrink's partial-sum
    stride, T x S*R, was one) see odd and even counts as different kernels."""
    powers = [1 << k for k in range(5, budget.bit_length())]
    return sorted({n for p in powers for n in (p, p + 1, p + 2) if n <= budget} | {budget})


class StepFollowers:
    """Where rank 0's runner sends each step for the other ranks of a tensor-parallel group (the engine's
    worker processes, loraserve.worker.processes)."""

    def send(self, step: DeviceStep) -> None:
        raise NotImplementedError


@dataclass
class LaunchedStep:
    """A step launched on the device: the sequences that sample (in row order) and their samples."""

    sequences: list[Sequence]
    samples: SampledTokens | None  # None when no sequence samples (prefill chunks only)
    prompt_logprobs: tuple[PromptLogprobRows, PromptLogprobs] | None = None  # requests that asked for them


class ModelRunner:
    """Owns the model's device state: KV cache, sampler, CUDA graphs; LoRA state through the LoRA runtime.

    `tp`: the model's tensor-parallel group; `followers` (rank 0 of several ranks): where each step goes for
    the other ranks."""

    def __init__(self, model, config: EngineConfig, lora: LoRARuntime | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), tp: ParallelGroup = NO_PARALLEL,
                 followers: StepFollowers | None = None):
        self.model = model
        self.config = config
        self.tp, self.followers = tp, followers
        self.device, self.dtype = config.model.device, config.model.dtype
        self.block_size = config.cache.block_size
        self.max_blocks_per_seq = -(-config.model.max_model_len // self.block_size)
        self.attn_layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        self.num_blocks = self._count_kv_blocks()
        # the block at index num_blocks is a dummy: padding rows write their K/V there
        self.dummy_block = self.num_blocks
        self._allocate_kv_cache()
        self.sampler = Sampler(self.device, config.model.seed, eos_token_ids)  # EOS: held back before min_tokens
        self.lora = lora
        self.graph_runner: CUDAGraphRunner | None = None
        if self.device.type == "cuda":
            self.warm_up_eager()
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graph_runner = CUDAGraphRunner(model, config.scheduler.max_num_seqs, self.max_blocks_per_seq,
                                                self.block_size, self.dummy_block, lora, tp)
            self.graph_runner.capture()
            verify_graphs(self)
        self.mixed_graphs: MixedGraphRunner | None = None
        if self.device.type == "cuda" and not config.enforce_eager and not tp.is_parallel:
            self.mixed_graphs = MixedGraphRunner(model, config.scheduler.max_step_tokens, config.model.max_model_len,
                                                 self.block_size, self.dummy_block, lora)
            self.mixed_graphs.capture()
            verify_mixed_graphs(self)

    @classmethod
    def build(cls, model, config: EngineConfig, model_name: str | None, eos_token_ids: frozenset[int] = frozenset(),
              tp: ParallelGroup = NO_PARALLEL, followers: StepFollowers | None = None) -> "ModelRunner":
        """The runner of a loaded model, with the LoRA runtime when the config enables LoRA (its adapter pool
        sized against the room the KV cache would have, the same on every rank)."""
        lora = None
        if config.lora is not None:
            kv_room = None
            if config.model.device.type == "cuda":
                kv_room = KVRoom(*tp.agree(list(kv_cache_need(model, config)), "min"))
            lora = LoRARuntime(model, config.lora, config.scheduler.max_step_tokens, model_name, kv_room, tp)
        return cls(model, config, lora, eos_token_ids, tp, followers)

    # -- KV cache -----------------------------------------------------------
    def _bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.attn_layers, self.block_size, self.dtype)

    def _count_kv_blocks(self) -> int:
        cache = self.config.cache
        useful = useful_kv_blocks(self.config)  # more than this can never be used
        if cache.num_gpu_blocks_override is not None:
            blocks = cache.num_gpu_blocks_override
        elif self.device.type == "cuda":
            blocks = min(useful, kv_room_bytes(self.model, self.config) // self._bytes_per_block())
        else:
            blocks = min(useful, int(cache.cpu_kv_cache_gb * 2**30 // self._bytes_per_block()))
        blocks = self.tp.agree([blocks], "min")[0]  # every rank's cache holds the same blocks
        if blocks * self.block_size < self.config.model.max_model_len:
            raise ValueError(f"the KV cache holds {blocks} blocks of {self.block_size} tokens, fewer than one "
                             f"sequence of max_model_len={self.config.model.max_model_len} needs; lower "
                             "max_model_len or give the cache more memory")
        return blocks

    def _allocate_kv_cache(self) -> None:
        for layer in self.attn_layers:
            shape = (self.num_blocks + 1, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.bind_cache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                             torch.zeros(shape, dtype=self.dtype, device=self.device))
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", self.num_blocks, self.block_size,
                    self.num_blocks * self._bytes_per_block() / 2**30)

    def release_graphs(self) -> None:
        """Drop every captured graph (decode and prefill) and its memory; later steps run eagerly. Rank 0 of a
        tensor-parallel engine does this before leaving its group: NCCL's abort waits until no graph holds
        the group's collectives any more."""
        for graphs in (self.graph_runner, self.mixed_graphs):
            if graphs is not None:
                for bucket in list(graphs.graphs):
                    graphs.drop(bucket)
        self.graph_runner = self.mixed_graphs = None

    def abandon_graphs(self) -> None:
        """Rank 0 after a tensor-parallel worker died: its device may wait for good in the dead rank's
        collective, so its graphs can't be destroyed (the destructor blocks), and freeing them in the
        interpreter's finalization lets NCCL's abort, left behind on its thread, return into a finalizing
        interpreter (the C++ runtime then aborts the process). They are deliberately never freed: the
        process ends with its own status and the driver reclaims the device."""
        kept = [graphs for graphs in (self.graph_runner, self.mixed_graphs) if graphs is not None]
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))  # one reference no one holds: never collected
        self.graph_runner = self.mixed_graphs = None

    # -- start-up ---------------------------------------------------------------
    @torch.inference_mode()
    def warm_up_eager(self) -> None:
        """One eager pass at each size of `warm_up_sizes`, so that Triton compiles every kernel shape a step can
        take here, at start-up, not while requests wait. With LoRA the tokens name adapter id 0 (no adapter
        is loaded yet: rank 0 in every layer, so the kernels run and add nothing); where a step's adapters can
        need more room than the base GEMMs have for their products, sizes that put them there run twice, so
        that the path of such steps is compiled too; where larger steps can pass a product on as factors
        (LoRARuntime.factors_may_run), the first such size runs once more for each width the kernels that
        expand them can take (LoRABatch.step_rank)."""
        sizes = warm_up_sizes(self.config.scheduler.max_num_batched_tokens)
        lora = self.lora
        widths = lora.expand_widths() if lora is not None else ()
        start = time.perf_counter()
        for num_tokens in sizes:
            inputs = StepInputs.dummy_prefill(num_tokens, self.config.model.max_model_len, self.dummy_block,
                                              self.block_size, -1 if lora is None else 0)
            self.model.compute_logits(self.forward_eager(inputs, every_lora_layer=True))
            if (lora is not None and lora.side is not None and lora.factors_may_run
                    and num_tokens > lora.side.scratch.max_tokens):
                # the first such size: once for each dot width; later ones: the path without the GEMMs' columns
                for rank in widths or ((None,) if lora.columns_may_overflow else ()):
                    self.model.compute_logits(self.forward_eager(inputs, every_lora_layer=True, lora_in_gemms=False,
                                                                 lora_step_rank=rank))
                widths = ()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("eager warm-up at %d step sizes (%d..%d tokens): %.1f s", len(sizes), sizes[0], sizes[-1],
                    time.perf_counter() - start)

    # -- one step -------------------------------------------------------------
    def _to_device(self, array) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def forward_eager(self, inputs: StepInputs, fill: PendingTokenFill | None = None,
                      rows: np.ndarray | None = None, every_lora_layer: bool = False,
                      lora_in_gemms: bool = True, lora_step_rank: int | None = None) -> torch.Tensor:
        """The model on this step's tokens; returns the hidden states of `rows` [R, D] (default: the sampled
        rows). LoRA layers that no adapter of the step has weights in run without LoRA kernels, unless
        `every_lora_layer` (the warm-up); larger steps sum the LoRA products inside the base GEMMs where they
        fit, unless not `lora_in_gemms` (the warm-up); `lora_step_rank`: LoRARuntime.for_step's (the warm-up)."""
        attn = AttentionMetadata(
            slot_mapping=self._to_device(inputs.slot_mapping), block_tables=self._to_device(inputs.block_tables),
            seq_lens=self._to_device(inputs.seq_lens), query_start_loc=self._to_device(inputs.query_start_loc),
            max_query_len=inputs.max_query_len, is_decode=inputs.is_decode, num_decode_rows=inputs.num_decode_rows)
        lora = None
        if self.lora is not None and (inputs.token_adapters >= 0).any():
            lora = self.lora.for_step(inputs.token_adapters, every_lora_layer, lora_in_gemms, lora_step_rank)
        share = self.tp.is_parallel and inputs.has_pending_tokens  # (asked before the fill: on the CPU the
        input_ids = self._to_device(inputs.input_ids)                # device ids are the host array itself)
        if fill is not None:
            fill.apply(input_ids)
        if share:
            self.tp.broadcast(input_ids)  # the tokens still on rank 0's device reach every rank
        hidden = self.model(input_ids, self._to_device(inputs.positions), ForwardContext(attn, lora))
        return hidden[self._to_device(inputs.logits_rows if rows is None else rows)]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, lora_ids: dict[str, int],
                in_flight: LaunchedStep | None = None) -> LaunchedStep:
        """Launch the step without waiting for it (lora_ids: adapter name -> its id in the GPU adapter pool). Input
        tokens that are still pending on the host are taken from `in_flight`'s samples on the device. With several
        ranks the step goes to the others first, with the adapter loads they repeat before it."""
        inputs = StepInputs.prepare(out.scheduled, lora_ids, self.block_size)
        samples = in_flight.samples if in_flight is not None else None
        fill = PendingTokenFill.find(inputs, out.scheduled, in_flight.sequences if in_flight else [],
                                     samples.tokens if samples is not None else None)
        prompt_rows = PromptLogprobRows.find(out.scheduled, inputs.query_start_loc)
        sampling = [s for s in out.scheduled if s.samples]
        step = DeviceStep(inputs, prompt_rows.rows if prompt_rows is not None else None, bool(sampling))
        if self.followers is not None:
            if self.lora is not None:
                step.adapter_loads = self.lora.take_peer_loads()
            self.followers.send(step)
        logits, prompt_logits = self.run(step, fill)
        prompt = None
        if prompt_rows is not None:
            prompt = (prompt_rows, PromptLogprobs(prompt_logits, prompt_rows.targets, prompt_rows.num_top))
        if not sampling:
            return LaunchedStep([], None, prompt)
        seqs = [s.seq for s in sampling]
        params = [seq.sampling_params for seq in seqs]
        history = None
        if any(p.has_penalties for p in params):
            row_of = {seq: i for i, seq in enumerate(in_flight.sequences)} if in_flight is not None else {}
            history = TokenHistory([seq.prompt_token_ids for seq in seqs], [seq.output_token_ids for seq in seqs],
                                   [row_of.get(seq) if seq.num_pending_tokens else None for seq in seqs],
                                   samples.tokens if samples is not None else None)
        tokens = self.sampler(logits, [seq.request_id for seq in seqs], params,
                              [len(seq.output_token_ids) + seq.num_pending_tokens for seq in seqs], history)
        return LaunchedStep(seqs, tokens, prompt)

    @torch.inference_mode()
    def run(self, step: DeviceStep, fill: PendingTokenFill | None = None
            ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The device work of a step, the same on every rank: the forward pass (a graph replay for a decode
        step that fits a bucket; on one rank, the graphs of a step that prefills where one fits its tokens, the
        attention between them eager; else eager), then the fp32 logits of the rows that score prompt tokens
        [R, V] and of the sampled rows [N, V] (None where there are none). `fill`: rank 0's tokens still on
        its device."""
        inputs, prompt_logits = step.inputs, None
        if step.prompt_rows is None and self.graph_runner is not None and self.graph_runner.can_replay(inputs):
            hidden = self.graph_runner.replay(inputs, fill)  # [T, D]
            if inputs.logits_rows.shape[0] != inputs.num_tokens:  # a row that does not sample (a prompt chunk)
                hidden = hidden[self._to_device(inputs.logits_rows)]
        elif step.prompt_rows is None and self.mixed_graphs is not None and self.mixed_graphs.can_replay(inputs):
            hidden = self.mixed_graphs.replay(inputs, fill)[self._to_device(inputs.logits_rows)]  # [N, D]
        elif step.prompt_rows is None:
            hidden = self.forward_eager(inputs, fill)
        else:  # the sampled rows, then the rows that score prompt tokens
            both = self.forward_eager(inputs, fill, np.concatenate([inputs.logits_rows, step.prompt_rows]))
            hidden = both[:inputs.logits_rows.shape[0]]
            prompt_logits = self.model.compute_logits(both[hidden.shape[0]:])
        logits = self.model.compute_logits(hidden) if step.samples else None  # [N, V]
        return logits, prompt_logits

    def follow(self, step: DeviceStep) -> None:
        """A rank other than 0: load the adapters rank 0 loaded since the last step, then run the step."""
        for load in step.adapter_loads:
            self.lora.load_peer(load)
        self.run(step)

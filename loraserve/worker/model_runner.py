"""Runs one scheduled step on the device: step metadata -> forward -> logits -> sampled tokens."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from loraserve.config import CacheConfig, SchedulerConfig
from loraserve.engine.request import PENDING_TOKEN, Sequence
from loraserve.engine.scheduler import ScheduledSequence, SchedulerOutput
from loraserve.models.attention import PagedAttention
from loraserve.worker.forward_context import (AttentionMetadata, ForwardContext, LoRASideStream,
                                              lora_side_for_this_pass)
from loraserve.worker.sampler import SampledTokens, Sampler

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """Host-side (numpy) inputs of one step: T tokens of S sequences."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [S, MB] int32
    seq_lens: np.ndarray  # [S] int32
    query_start_loc: np.ndarray  # [S+1] int32
    token_lora_slots: np.ndarray  # [T] int32, -1 = base
    logits_rows: np.ndarray  # [N] int64: rows whose hidden state is sampled
    max_query_len: int

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass
class LaunchedStep:
    """A step launched on the device: the sequences that sample (in row order) and their samples."""

    sequences: list[Sequence]
    samples: SampledTokens | None  # None when no sequence samples (prefill chunks only)


@dataclass
class PendingTokenFill:
    """Input rows whose token is still on the device: ids[rows] = in-flight samples[sources]."""

    rows: np.ndarray  # [K] int64 rows of this step's input_ids
    sources: np.ndarray  # [K] int64 rows of the in-flight step's samples
    tokens: torch.Tensor  # [M] int64 the in-flight step's samples (device)

    def apply(self, input_ids: torch.Tensor) -> None:
        """Write the tokens into the device input ids (no host sync)."""
        k = self.rows.shape[0]
        if np.array_equal(self.rows, self.sources) and np.array_equal(self.rows, np.arange(k)):
            input_ids[:k].copy_(self.tokens[:k])  # the usual decode case: same rows, same order
            return
        rows = torch.from_numpy(self.rows).to(input_ids.device, non_blocking=True)
        sources = torch.from_numpy(self.sources).to(input_ids.device, non_blocking=True)
        input_ids.index_copy_(0, rows, self.tokens.index_select(0, sources).to(input_ids.dtype))


class ModelRunner:
    """Owns the model's device state: KV cache, sampler, LoRA step metadata, CUDA graphs."""

    def __init__(self, model, device: torch.device, dtype: torch.dtype, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, seed: int, max_loras: int = 0, enforce_eager: bool = False,
                 lora_layers: list | None = None):
        self.model = model
        self.device, self.dtype = device, dtype
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.attn_layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        self.num_blocks = self._count_kv_blocks(cache_config, scheduler_config)
        # the block at index num_blocks is a dummy: padding rows write their K/V there
        self.dummy_block = self.num_blocks
        self._allocate_kv_cache()
        self.sampler = Sampler(device, seed)
        self.lora_meta_builder = None
        self.lora_side = None  # CUDA: decode-sized LoRA products run on its stream, beside the base GEMMs
        if max_loras > 0:
            from loraserve.kernels.lora_meta import LoRAMetaBuilder
            from loraserve.lora.layers import LORA_DELTA_MAX_TOKENS, allocate_lora_scratch

            self.lora_meta_builder = LoRAMetaBuilder(scheduler_config.max_num_batched_tokens
                                                     + scheduler_config.max_num_seqs, max_loras, device)
            if device.type == "cuda" and lora_layers:
                scratch = allocate_lora_scratch([layer for _, layer in lora_layers],
                                                min(LORA_DELTA_MAX_TOKENS, self.lora_meta_builder.max_tokens))
                self.lora_side = LoRASideStream(torch.cuda.Stream(device), scratch)
        self.graph_runner = None
        if device.type == "cuda" and not enforce_eager:
            self._capture_graphs(scheduler_config.max_num_seqs, lora_layers)

    def _capture_graphs(self, max_num_seqs: int, lora_layers: list | None) -> None:
        from loraserve.worker.cuda_graphs import CUDAGraphRunner
        from loraserve.worker.graph_check import verify_graphs

        self.graph_runner = CUDAGraphRunner(self.model, max_num_seqs, self.max_blocks_per_seq, self.block_size,
                                            self.dummy_block, self.device, self.lora_meta_builder,
                                            self.lora_side)
        self.graph_runner.capture()
        verify_graphs(self.graph_runner, self.model, self.num_blocks, lora_layers)

    # -- KV cache -----------------------------------------------------------
    def _bytes_per_block(self) -> int:
        a = self.attn_layers[0]
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.attn_layers) * self.block_size * a.num_kv_heads * a.head_dim * elem

    def _count_kv_blocks(self, cache: CacheConfig, sched: SchedulerConfig) -> int:
        useful = sched.max_num_seqs * self.max_blocks_per_seq  # more than this can never be used
        if cache.num_gpu_blocks_override is not None:
            blocks = cache.num_gpu_blocks_override
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            reserve = total * (1.0 - cache.gpu_memory_utilization) + self._activation_reserve(sched)
            blocks = min(useful, int(max(0.0, free - reserve) // self._bytes_per_block()))
        else:
            blocks = min(useful, int(cache.cpu_kv_cache_gb * 2**30 // self._bytes_per_block()))
        if blocks * self.block_size < self.max_model_len:
            raise ValueError(f"the KV cache holds {blocks} blocks of {self.block_size} tokens, fewer than one "
                             f"sequence of max_model_len={self.max_model_len} needs; lower max_model_len or "
                             "give the cache more memory")
        return blocks

    def _activation_reserve(self, sched: SchedulerConfig) -> float:
        cfg = self.model.config
        t = sched.max_num_batched_tokens
        width = 4 * cfg.hidden_size + 3 * cfg.intermediate_size
        return 2**30 + t * width * 4 * 4 + sched.max_num_seqs * cfg.vocab_size * 4 * 4

    def _allocate_kv_cache(self) -> None:
        for layer in self.attn_layers:
            shape = (self.num_blocks + 1, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.bind_cache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                             torch.zeros(shape, dtype=self.dtype, device=self.device))
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", self.num_blocks, self.block_size,
                    self.num_blocks * self._bytes_per_block() / 2**30)

    # -- one step -------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledSequence], lora_slots: dict[str, int]) -> StepInputs:
        if all(item.num_new_tokens == 1 for item in scheduled):
            return self._prepare_decode(scheduled, lora_slots)
        bs = self.block_size
        ids, pos, slots, lora, rows = [], [], [], [], []
        seq_lens, qsl = [], [0]
        max_blocks = 1
        for item in scheduled:
            seq, n, start = item.seq, item.num_new_tokens, item.seq.num_computed_tokens
            ids.extend(seq.token_range(start, start + n))
            p = np.arange(start, start + n)
            pos.append(p)
            table = np.asarray(seq.block_table, dtype=np.int64)
            slots.append(table[p // bs] * bs + p % bs)
            lora.append(np.full(n, lora_slots[seq.lora_name] if seq.lora_name is not None else -1, np.int32))
            seq_lens.append(start + n)
            qsl.append(qsl[-1] + n)
            if item.samples:
                rows.append(qsl[-1] - 1)
            max_blocks = max(max_blocks, len(seq.block_table))
        tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
        for i, item in enumerate(scheduled):
            tables[i, :len(item.seq.block_table)] = item.seq.block_table
        return StepInputs(np.asarray(ids, np.int64), np.concatenate(pos).astype(np.int64),
                          np.concatenate(slots).astype(np.int64), tables, np.asarray(seq_lens, np.int32),
                          np.asarray(qsl, np.int32), np.concatenate(lora), np.asarray(rows, np.int64),
                          max(s.num_new_tokens for s in scheduled))

    def _prepare_decode(self, scheduled: list[ScheduledSequence], lora_slots: dict[str, int]) -> StepInputs:
        """The decode-only case with plain Python ints: per-sequence numpy calls cost more than they save."""
        bs = self.block_size
        n = len(scheduled)
        seqs = [item.seq for item in scheduled]
        positions = [seq.num_computed_tokens for seq in seqs]
        ids = [seq.token_range(p, p + 1)[0] for seq, p in zip(seqs, positions)]
        slots = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)]
        lora = [lora_slots[seq.lora_name] if seq.lora_name is not None else -1 for seq in seqs]
        max_blocks = max(len(seq.block_table) for seq in seqs)
        tables = np.zeros((n, max_blocks), dtype=np.int32)
        for i, seq in enumerate(seqs):
            tables[i, :len(seq.block_table)] = seq.block_table
        rows = np.arange(n, dtype=np.int64)
        return StepInputs(np.asarray(ids, np.int64), np.asarray(positions, np.int64), np.asarray(slots, np.int64),
                          tables, np.asarray(positions, np.int32) + 1, np.arange(n + 1, dtype=np.int32),
                          np.asarray(lora, np.int32), rows, 1)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    @staticmethod
    def pending_fill(inputs: StepInputs, scheduled: list[ScheduledSequence],
                     in_flight: LaunchedStep | None) -> PendingTokenFill | None:
        """Where this step's input holds tokens sampled by the step in flight, and which ones."""
        rows = np.flatnonzero(inputs.input_ids == PENDING_TOKEN)
        if rows.size == 0:
            return None
        if in_flight is None or in_flight.samples is None:
            raise RuntimeError("a pending token is scheduled but no step is in flight")
        source_of = {seq: i for i, seq in enumerate(in_flight.sequences)}
        owners = np.searchsorted(inputs.query_start_loc, rows, side="right") - 1  # [K] scheduled index per row
        sources = np.array([source_of[scheduled[i].seq] for i in owners.tolist()], dtype=np.int64)
        return PendingTokenFill(rows.astype(np.int64), sources, in_flight.samples.tokens)

    @torch.inference_mode()
    def forward_eager(self, inputs: StepInputs, fill: PendingTokenFill | None = None) -> torch.Tensor:
        """The model on this step's tokens; returns the hidden states of the sampled rows [N, D]."""
        attn = AttentionMetadata(
            slot_mapping=self._to_device(inputs.slot_mapping), block_tables=self._to_device(inputs.block_tables),
            seq_lens=self._to_device(inputs.seq_lens), query_start_loc=self._to_device(inputs.query_start_loc),
            max_query_len=inputs.max_query_len, is_decode=inputs.is_decode)
        lora = None
        if self.lora_meta_builder is not None and (inputs.token_lora_slots >= 0).any():
            lora = self.lora_meta_builder.build(inputs.token_lora_slots)
        input_ids = self._to_device(inputs.input_ids)
        if fill is not None:
            fill.apply(input_ids)
        hidden = self.model(input_ids, self._to_device(inputs.positions),
                            ForwardContext(attn, lora, lora_side_for_this_pass(self.lora_side)))
        return hidden[self._to_device(inputs.logits_rows)]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, lora_slots: dict[str, int],
                in_flight: LaunchedStep | None = None) -> LaunchedStep:
        """Launch the step without waiting for it. Input tokens that are still pending on the host are
        taken from `in_flight`'s samples on the device."""
        inputs = self.prepare(out.scheduled, lora_slots)
        fill = self.pending_fill(inputs, out.scheduled, in_flight)
        graphs = self.graph_runner
        n = len(inputs.input_ids)
        bucket = graphs.bucket_for(n) if inputs.is_decode and graphs is not None else None
        if bucket is not None:
            lora = inputs.token_lora_slots if self.lora_meta_builder is not None else None
            graphs.write_inputs(inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.seq_lens,
                                inputs.block_tables, lora, bucket)
            if fill is not None:
                fill.apply(graphs.inputs.input_ids)
            hidden = graphs.replay(bucket, n)
        else:
            hidden = self.forward_eager(inputs, fill)
        sampling = [s for s in out.scheduled if s.samples]
        if not sampling:
            return LaunchedStep([], None)
        logits = self.model.compute_logits(hidden)  # [N, V]
        samples = self.sampler(logits, [s.seq.request_id for s in sampling],
                               [s.seq.sampling_params for s in sampling])
        return LaunchedStep([s.seq for s in sampling], samples)

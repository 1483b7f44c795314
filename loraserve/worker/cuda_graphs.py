"""CUDA graphs for decode steps: one graph per padded batch size, with the LoRA kernels inside.

Every input of a decode step lives in static device buffers sized for the
largest bucket; a step is padded to the smallest bucket that holds the batch
(StepInputs.pad_into: padding rows point at the dummy KV block, have seq_len 0
and adapter -1, so they can't touch real sequences) straight into a pinned
host buffer, copied to the device with one non-blocking copy (plus the LoRA
metadata's own copy), and that bucket's graph is replayed. With LoRA enabled the
LoRA kernels are always captured: adapters loaded later are picked up by the
same graphs, since the adapter pool, its page table and the metadata buffers never move.
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch
from tqdm import tqdm

from loraserve.distributed import NO_PARALLEL, ParallelGroup
from loraserve.forward_context import AttentionMetadata, ForwardContext
from loraserve.lora.runtime import LoRARuntime
from loraserve.worker.step_inputs import PendingTokenFill, StepInputs

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, ending at max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, min(max_batch, 64) + 1, 8)) + list(range(80, max_batch + 1, 16))
    sizes = sorted({b for b in sizes if b <= max_batch} | {max_batch})
    return sizes


class GraphInputs(NamedTuple):
    """The decode graphs' static inputs for up to B rows: views of one int32 vector laid out as
    input_ids [B] | positions [B] | slot_mapping [B] | seq_lens [B] | token_adapters [B] | block_tables [B, MB].
    The same layout serves the device buffer and the pinned host buffers it is copied from (the tokens'
    adapter ids go from there into the LoRA metadata; on the device they are not read)."""

    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    slot_mapping: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]
    token_adapters: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, MB]

    @staticmethod
    def size(max_batch: int, max_blocks: int) -> int:
        return 5 * max_batch + max_batch * max_blocks

    @classmethod
    def views(cls, buf, max_batch: int, max_blocks: int) -> GraphInputs:
        """Views of `buf` (a tensor, or a numpy array over a pinned host buffer)."""
        b = max_batch
        return cls(buf[:b], buf[b:2 * b], buf[2 * b:3 * b], buf[3 * b:4 * b], buf[4 * b:5 * b],
                   buf[5 * b:].reshape(b, max_blocks))

    @staticmethod
    def used(bucket: int, max_batch: int, max_blocks: int) -> int:
        """How much of the vector a bucket reads (block-table rows past it are never read)."""
        return 5 * max_batch + bucket * max_blocks


class CUDAGraphRunner:
    """capture / replay of decode steps of up to `max_batch` sequences."""

    def __init__(self, model, max_batch: int, max_blocks: int, block_size: int, dummy_block: int,
                 lora: LoRARuntime | None = None, tp: ParallelGroup = NO_PARALLEL):
        self.model = model
        self.tp = tp  # the graphs hold the model's collectives; input tokens still on rank 0 are broadcast
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.dummy_block = dummy_block
        self.device = next(model.parameters()).device
        self.lora = lora  # its metadata buffers and side stream are captured with each graph
        self.buckets = batch_buckets(max_batch)
        size = GraphInputs.size(max_batch, max_blocks)
        self._device_buf = torch.zeros(size, dtype=torch.int32, device=self.device)
        self.inputs = GraphInputs.views(self._device_buf, max_batch, max_blocks)
        self._query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=self.device)  # one token a row
        self._staging = [torch.zeros(size, dtype=torch.int32, pin_memory=True) for _ in range(2)]  # used in turn
        self._host = [GraphInputs.views(s.numpy(), max_batch, max_blocks) for s in self._staging]
        self._copy_done = [torch.cuda.Event() for _ in range(2)]
        self._next = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> static hidden states [bucket, D]
        self.warmup_seconds = 0.0  # one eager forward per bucket before capturing (compiles the Triton kernels)
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0
        self._pool = None

    # -- capture --------------------------------------------------------------------
    def _forward(self, batch: int) -> torch.Tensor:
        i = self.inputs
        attn = AttentionMetadata(slot_mapping=i.slot_mapping[:batch].long(), block_tables=i.block_tables[:batch],
                                 seq_lens=i.seq_lens[:batch], query_start_loc=self._query_start_loc[:batch + 1],
                                 max_query_len=1, is_decode=True)
        lora = self.lora.for_capture() if self.lora is not None else None  # inside a capture: its stream
        return self.model(i.input_ids[:batch].long(), i.positions[:batch].long(), ForwardContext(attn, lora))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool."""
        self.write_inputs(StepInputs.empty_decode(), self.max_batch)
        order = sorted(self.buckets, reverse=True)
        start = time.perf_counter()
        for batch in order:  # warm-up: Triton compiles (or loads from its cache) outside the capture
            self._forward(batch)
        torch.cuda.synchronize(self.device)
        self.warmup_seconds = time.perf_counter() - start
        # the first capture empties the allocator's cache: do it first, so that what it gives back to the
        # device is not counted against the graphs
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        for batch in tqdm(order, desc="Capturing CUDA graphs", unit="graph", leave=False, disable=None):
            self.graphs[batch], self.outputs[batch] = self.capture_bucket(batch)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        logger.info("captured %d CUDA graphs (batch %d..%d) in %.1f s using %.2f GiB (warm-up and kernel "
                    "compilation before it: %.1f s)", len(self.graphs), self.buckets[0], self.buckets[-1],
                    self.capture_seconds, self.graph_memory_bytes / 2**30, self.warmup_seconds)

    def capture_bucket(self, batch: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A graph of one bucket, captured into the shared pool, and its static output [batch, D]."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(batch)
        if self._pool is None:
            self._pool = graph.pool()
        return graph, out

    # -- replay ---------------------------------------------------------------------
    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket with a graph that holds `batch` rows, or None."""
        for b in self.buckets:
            if b >= batch and b in self.graphs:
                return b
        return None

    def can_replay(self, inputs: StepInputs) -> bool:
        return inputs.is_decode and self.bucket_for(inputs.num_tokens) is not None

    def drop(self, bucket: int) -> None:
        """Serve this bucket eagerly from now on (its graph failed the integrity check)."""
        self.graphs.pop(bucket, None)
        self.outputs.pop(bucket, None)

    def pad(self, inputs: StepInputs) -> StepInputs:
        """The inputs padded as the graph that replays them sees them (for an eager forward to compare)."""
        return inputs.padded(self.bucket_for(inputs.num_tokens), self.max_blocks, self.dummy_block, self.block_size)

    def replay(self, inputs: StepInputs, fill: PendingTokenFill | None = None) -> torch.Tensor:
        """Replay the graph of the smallest bucket holding this decode step (can_replay); returns the hidden
        states of its n rows [n, D] (a view of the graph's static output). `fill` writes tokens still on the
        device into the input ids."""
        bucket = self.bucket_for(inputs.num_tokens)
        share = self.tp.is_parallel and inputs.has_pending_tokens
        self.write_inputs(inputs, bucket)
        if fill is not None:
            fill.apply(self.inputs.input_ids)
        if share:
            self.tp.broadcast(self.inputs.input_ids[:bucket])  # the tokens still on rank 0's device, to every rank
        self.graphs[bucket].replay()
        return self.outputs[bucket][:inputs.num_tokens]

    def write_inputs(self, inputs: StepInputs, bucket: int) -> None:
        """Write a decode step, padded to `bucket` rows, into the static buffers, and its LoRA slots into
        the LoRA metadata."""
        index = self._next
        self._next = 1 - index
        self._copy_done[index].synchronize()  # the copy that last used this staging buffer is done
        host = self._host[index]
        inputs.pad_into(host, bucket, self.dummy_block, self.block_size)
        used = GraphInputs.used(bucket, self.max_batch, self.max_blocks)
        self._device_buf[:used].copy_(self._staging[index][:used], non_blocking=True)
        self._copy_done[index].record()
        if self.lora is not None:
            self.lora.write_metadata(host.token_adapters[:bucket])

"""CUDA graphs for decode steps: one graph per padded batch size, with the LoRA kernels inside.

Every input of a decode step lives in static device buffers sized for the
largest bucket; a step writes them from one pinned host buffer with one
non-blocking copy (plus the LoRA metadata's own copy), then replays the graph
of the smallest bucket that holds the batch. Padding rows point at the dummy
KV block, have seq_len 0 and LoRA slot -1, so they can't touch real sequences.
With LoRA enabled the LoRA kernels are always captured (DESIGN.md section 3):
adapters loaded later are picked up by the same graphs, since slot storage and
metadata buffers never move.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from loraserve.worker.forward_context import (AttentionMetadata, ForwardContext, LoRASideStream,
                                              lora_side_for_this_pass)

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, ending at max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, min(max_batch, 64) + 1, 8)) + list(range(80, max_batch + 1, 16))
    sizes = sorted({b for b in sizes if b <= max_batch} | {max_batch})
    return sizes


@dataclass
class GraphInputs:
    """Static decode inputs for up to B rows; one int32 device vector and its views."""

    device_buf: torch.Tensor  # [4B + B*MB] int32: ids | positions | slot_mapping | seq_lens | block tables
    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    slot_mapping: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, MB]
    query_start_loc: torch.Tensor  # [B+1] = arange (one token per row)

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device) -> "GraphInputs":
        b = max_batch
        buf = torch.zeros(4 * b + b * max_blocks, dtype=torch.int32, device=device)
        return cls(buf, buf[:b], buf[b:2 * b], buf[2 * b:3 * b], buf[3 * b:4 * b],
                   buf[4 * b:].view(b, max_blocks), torch.arange(b + 1, dtype=torch.int32, device=device))


class CUDAGraphRunner:
    """capture / can_run / run for decode steps of up to `max_batch` sequences."""

    def __init__(self, model, max_batch: int, max_blocks: int, block_size: int, dummy_block: int,
                 device: torch.device, lora_meta_builder=None, lora_side: LoRASideStream | None = None):
        self.model = model
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.dummy_slot = dummy_block * block_size
        self.device = device
        self.lora_meta_builder = lora_meta_builder
        self.lora_side = lora_side  # the LoRA kernels' side stream, forked and joined inside each graph
        self.buckets = batch_buckets(max_batch)
        self.inputs = GraphInputs.allocate(max_batch, max_blocks, device)
        size = self.inputs.device_buf.numel()
        self._staging = [torch.zeros(size, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._copy_done = [torch.cuda.Event() for _ in range(2)]
        self._next = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> static hidden states [bucket, D]
        self.warmup_seconds = 0.0  # one eager forward per bucket before capturing (compiles the Triton kernels)
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0
        self._pool = None

    # -- capture --------------------------------------------------------------------
    def _context(self, batch: int) -> ForwardContext:
        i = self.inputs
        attn = AttentionMetadata(slot_mapping=i.slot_mapping[:batch].long(), block_tables=i.block_tables[:batch],
                                 seq_lens=i.seq_lens[:batch], query_start_loc=i.query_start_loc[:batch + 1],
                                 max_query_len=1, is_decode=True)
        lora = self.lora_meta_builder.meta if self.lora_meta_builder is not None else None
        return ForwardContext(attn, lora, lora_side_for_this_pass(self.lora_side))  # inside a capture: its stream

    def _forward(self, batch: int) -> torch.Tensor:
        ctx = self._context(batch)
        return self.model(self.inputs.input_ids[:batch].long(), self.inputs.positions[:batch].long(), ctx)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool."""
        self._write_padding_only()
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
            self.graphs[batch], self.outputs[batch] = self._capture_bucket(batch)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        logger.info("captured %d CUDA graphs (batch %d..%d) in %.1f s using %.2f GiB (warm-up and kernel "
                    "compilation before it: %.1f s)", len(self.graphs), self.buckets[0], self.buckets[-1],
                    self.capture_seconds, self.graph_memory_bytes / 2**30, self.warmup_seconds)

    def _capture_bucket(self, batch: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph of one bucket, captured into the shared pool, and its static output [batch, D]."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(batch)
        if self._pool is None:
            self._pool = graph.pool()
        return graph, out

    @torch.inference_mode()
    def time_capture(self) -> float:
        """Seconds to capture every bucket again, largest first, into graphs dropped at once (the runner's
        own graphs stay). For benchmarks: capture is host-bound, and on the GPU machines measured in
        docs/benchmarks.md its time moves by up to 2x from one capture to the next, so one start-up capture is
        a poor sample; they repeat this and take a median."""
        if not self.graphs:
            raise RuntimeError("time_capture needs the graphs captured first (their kernels compiled and bound)")
        start = time.perf_counter()
        dropped = [self._capture_bucket(batch) for batch in sorted(self.buckets, reverse=True)]  # freed after timing
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def _write_padding_only(self) -> None:
        i = self.inputs
        i.input_ids.zero_()
        i.positions.zero_()
        i.slot_mapping.fill_(self.dummy_slot)
        i.seq_lens.zero_()
        i.block_tables.fill_(self.dummy_slot // self.block_size)
        if self.lora_meta_builder is not None:
            self.lora_meta_builder.build(np.full(self.max_batch, -1, dtype=np.int64))

    # -- replay ---------------------------------------------------------------------
    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch and b in self.graphs:
                return b
        return None

    def can_run(self, batch: int) -> bool:
        return self.bucket_for(batch) is not None

    def drop(self, bucket: int) -> None:
        """Serve this bucket eagerly from now on (its graph failed the integrity check)."""
        self.graphs.pop(bucket, None)
        self.outputs.pop(bucket, None)

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, seq_lens: np.ndarray,
            block_tables: np.ndarray, token_lora_slots: np.ndarray | None) -> torch.Tensor:
        """Replay the decode graph for n = len(input_ids) rows; returns hidden states [n, D]."""
        n = input_ids.shape[0]
        bucket = self.bucket_for(n)
        self.write_inputs(input_ids, positions, slot_mapping, seq_lens, block_tables, token_lora_slots, bucket)
        return self.replay(bucket, n)

    def replay(self, bucket: int, n: int) -> torch.Tensor:
        """Replay a bucket's graph on the inputs written last; returns hidden states [n, D]."""
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]

    def write_inputs(self, input_ids, positions, slot_mapping, seq_lens, block_tables, token_lora_slots,
                     bucket: int) -> None:
        """Fill the static buffers for rows [0, bucket): real rows from the arrays, the rest padding."""
        n, b, mb = input_ids.shape[0], self.max_batch, self.max_blocks
        index = self._next
        self._next = 1 - index
        self._copy_done[index].synchronize()  # the copy that last used this staging buffer is done
        host = self._staging[index].numpy()
        host[:n] = input_ids
        host[n:bucket] = 0
        host[b:b + n] = positions
        host[b + n:b + bucket] = 0
        host[2 * b:2 * b + n] = slot_mapping
        host[2 * b + n:2 * b + bucket] = self.dummy_slot
        host[3 * b:3 * b + n] = seq_lens
        host[3 * b + n:3 * b + bucket] = 0
        tables = host[4 * b:].reshape(b, mb)
        tables[:bucket] = self.dummy_slot // self.block_size
        tables[:n, :block_tables.shape[1]] = block_tables
        used = 4 * b + bucket * mb  # rows past the bucket are never read
        self.inputs.device_buf[:used].copy_(self._staging[index][:used], non_blocking=True)
        self._copy_done[index].record()
        if self.lora_meta_builder is not None:
            slots = np.full(bucket, -1, dtype=np.int64)
            if token_lora_slots is not None:
                slots[:n] = token_lora_slots
            self.lora_meta_builder.build(slots)

"""CUDA graphs for small steps that prefill: per bucket of padded token counts, one graph per stretch of the
forward pass between two attentions, the attention itself run eagerly between them.

A step that computes a prompt chunk (alone, or beside decode rows) runs eagerly, and at a few hundred tokens
the host's work per op bounds it: a step of 64 decode rows and a 128-token chunk of Llama-3-8B took 16 ms
(26 ms with LoRA) for about 8 ms of GPU work. The attention of such a step has a grid that depends on its
sequences (how many, how long their chunks), so it stays eager; everything else (embedding, norms, GEMMs,
the LoRA kernels with their side stream, rotary with the KV-cache write, the final norm) depends only on the
token count, and is captured for each bucket of `mixed_buckets`: the model's forward pass is run under
capture with a hook in its attention metadata (`AttentionMetadata.split`) that ends the current graph where
a layer's attention starts, runs that attention once outside any graph (on the static buffers it will read
and write), and begins the next graph. A replay writes the step's tokens, positions, KV slots and adapters,
padded to the bucket, into static buffers, then replays graph 0, the first layer's attention, graph 1, and
so on. Padding tokens write K/V into the dummy block, name no adapter and belong to no sequence (no
attention reads or writes their rows), so they touch nothing real.

With LoRA the buckets stop at the side stream's scratch (512 tokens), where the LoRA products are bound
launches on the side stream as in the decode graphs. `graph_check.verify_mixed_graphs` compares each bucket
with the eager forward at start-up, as the decode graphs' check does.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch

from loraserve.forward_context import AttentionMetadata, ForwardContext
from loraserve.lora.runtime import LoRARuntime
from loraserve.worker.step_inputs import PendingTokenFill, StepInputs

logger = logging.getLogger(__name__)

MAX_MIXED_TOKENS = 512


def mixed_buckets(max_tokens: int) -> list[int]:
    """Token counts with a graph: 32 to 128 in steps of 32, then 192, 256, 384, 512, up to max_tokens."""
    sizes = [32, 64, 96, 128, 192, 256, 384, 512]
    return [s for s in sizes if s <= max_tokens]


class _Splitter:
    """The capture hook (AttentionMetadata.split): at each attention, end the graph being captured, run the
    attention once on static buffers, and begin the next graph."""

    def __init__(self, pool, meta_for_warmup: AttentionMetadata):
        self.pool = pool
        self.meta = meta_for_warmup  # real (dummy-block) metadata, so the attention can run during capture
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.pieces: list[tuple] = []  # per attention: (layer, q [T, H, hd], out [T, H, hd])

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def end(self) -> None:
        self.graphs[-1].capture_end()

    def __call__(self, layer, q: torch.Tensor) -> torch.Tensor:
        self.end()
        out = torch.zeros_like(q)  # [T, H, hd] static: written by the eager attention at every replay
        layer.attend(q, self.meta, out)
        self.pieces.append((layer, q, out))
        self.begin()
        return out


class MixedGraphRunner:
    """capture / replay of steps that prefill, of up to the largest bucket's tokens (tensor-parallel size 1)."""

    def __init__(self, model, max_tokens: int, max_model_len: int, block_size: int, dummy_block: int,
                 lora: LoRARuntime | None = None):
        self.model = model
        self.block_size, self.dummy_block, self.max_model_len = block_size, dummy_block, max_model_len
        self.device = next(model.parameters()).device
        self.lora = lora
        if lora is not None and lora.side is not None:
            max_tokens = min(max_tokens, lora.side.scratch.max_tokens)
        self.buckets = mixed_buckets(min(max_tokens, MAX_MIXED_TOKENS))
        t = self.buckets[-1] if self.buckets else 0
        # static inputs: input_ids | positions | slot_mapping, [3, T] int64, and their pinned staging (in turn)
        self._device_buf = torch.zeros(3, t, dtype=torch.int64, device=self.device)
        self._staging = [torch.zeros(3, t, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._adapters = np.full(t, -1, dtype=np.int32)  # token -> adapter id, padded (read at once by the metadata)
        self._copy_done = [torch.cuda.Event() for _ in range(2)]
        self._next = 0
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pieces: dict[int, list[tuple]] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> static hidden states [bucket, D]
        self.capture_seconds = 0.0
        self._pool = torch.cuda.graph_pool_handle() if self.buckets else None
        # every bucket is captured on this one stream: cuBLAS keeps a workspace for each stream it has run on,
        # for the life of the process, so a stream per bucket would leave a workspace per bucket behind
        self._capture_stream = torch.cuda.Stream(self.device) if self.buckets else None

    # -- capture --------------------------------------------------------------------
    def _meta(self, inputs: StepInputs, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._device_buf[2, :bucket], block_tables=self._to_device(inputs.block_tables),
            seq_lens=self._to_device(inputs.seq_lens), query_start_loc=self._to_device(inputs.query_start_loc),
            max_query_len=inputs.max_query_len, is_decode=False, num_decode_rows=inputs.num_decode_rows)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool."""
        start = time.perf_counter()
        for bucket in sorted(self.buckets, reverse=True):
            self.graphs[bucket], self.pieces[bucket], self.outputs[bucket] = self.capture_bucket(bucket)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        if self.buckets:
            logger.info("captured CUDA graphs for steps that prefill, %d buckets of %d..%d tokens, %d graphs each, "
                        "in %.1f s", len(self.buckets), self.buckets[0], self.buckets[-1],
                        len(self.graphs[self.buckets[0]]), self.capture_seconds)

    def capture_bucket(self, bucket: int) -> tuple[list[torch.cuda.CUDAGraph], list[tuple], torch.Tensor]:
        """One bucket's graphs, their attentions' static buffers and the static output [bucket, D]."""
        dummy = StepInputs.dummy_prefill(bucket, self.max_model_len, self.dummy_block, self.block_size,
                                         -1 if self.lora is None else 0)
        self.write_inputs(dummy, bucket)
        ids, positions = self._device_buf[0, :bucket], self._device_buf[1, :bucket]
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            lora = self.lora.for_capture() if self.lora is not None else None
            meta = self._meta(dummy, bucket)
            self.model(ids, positions, ForwardContext(meta, lora))  # warm-up, outside capture
            splitter = _Splitter(self._pool, meta)
            captured = replace(meta, split=splitter)  # made before the capture: it copies host arrays
            torch.cuda.synchronize(self.device)
            splitter.begin()
            try:
                out = self.model(ids, positions, ForwardContext(captured, lora))
            finally:
                splitter.end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return splitter.graphs, splitter.pieces, out

    # -- replay ---------------------------------------------------------------------
    def bucket_for(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens and b in self.graphs), None)

    def can_replay(self, inputs: StepInputs) -> bool:
        return not inputs.is_decode and self.bucket_for(inputs.num_tokens) is not None

    def drop(self, bucket: int) -> None:
        """Serve this bucket eagerly from now on (its graphs failed the integrity check)."""
        for table in (self.graphs, self.pieces, self.outputs):
            table.pop(bucket, None)

    def replay(self, inputs: StepInputs, fill: PendingTokenFill | None = None) -> torch.Tensor:
        """Replay the graphs of the smallest bucket holding this step (can_replay), each layer's attention
        between them; returns the hidden states of its T rows [T, D] (a view of the static output). `fill`
        writes tokens still on the device into the input ids."""
        bucket = self.bucket_for(inputs.num_tokens)
        self.write_inputs(inputs, bucket)
        if fill is not None:
            fill.apply(self._device_buf[0])
        meta = self._meta(inputs, bucket)
        graphs = self.graphs[bucket]
        for graph, (layer, q, out) in zip(graphs, self.pieces[bucket]):
            graph.replay()
            layer.attend(q, meta, out)
        graphs[-1].replay()
        return self.outputs[bucket][:inputs.num_tokens]

    def write_inputs(self, inputs: StepInputs, bucket: int) -> None:
        """Write a step's token ids, positions and KV slots, padded to `bucket` tokens (StepInputs.pad_tokens_into),
        into the static buffers, and its tokens' adapters into the LoRA metadata."""
        index = self._next
        self._next = 1 - index
        self._copy_done[index].synchronize()  # the copy that last used this staging buffer is done
        host = self._staging[index].numpy()
        inputs.pad_tokens_into(host[0], host[1], host[2], self._adapters, bucket, self.dummy_block, self.block_size)
        self._device_buf[:, :bucket].copy_(self._staging[index][:, :bucket], non_blocking=True)
        self._copy_done[index].record()
        if self.lora is not None:
            self.lora.write_metadata(self._adapters[:bucket])

"""The LoRA runtime's one owner: the model's LoRA layers, the adapter pool they read, the step metadata, and
the side stream with its scratch.

With tensor parallelism every rank has its own runtime over its part of the
model (`tp`), whose pool holds its part of each adapter at the same id and
pages on every rank: rank 0's LoRA manager decides, rank 0's runtime packs
every rank's part (`pack`) and keeps the loads the other ranks repeat
(`take_peer_loads`, sent with the next step; `load_peer` there).

The model runner speaks to it through three calls: `for_step(token_adapters)`
before an eager forward pass (writes the step's token -> adapter metadata and
returns the pass's LoRA state, the ForwardContext's `lora`, which also tells
the layers of page blocks no adapter of the step has weights in to launch no
LoRA kernels, and on one GPU how wide the step's adapters lie side by side for
larger steps to sum their products inside the base GEMMs), `for_capture()`
when a CUDA graph is captured (the same static buffers), and
`write_metadata(token_adapters)` before a graph replay (which reads the buffers
as it left them). Adapters enter the pool with `pack` (host side, any thread)
and `load` (a copy on the load stream, returning the adapter id and an event
that the first step using it waits for), and leave it with `release`: the LoRA
manager decides which, and the start-up graph check loads its probe adapters
the same way.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from loraserve.config import LoRAConfig
from loraserve.distributed import NO_PARALLEL, ParallelGroup
from loraserve.kernels.lora_columns import padded_columns
from loraserve.kernels.lora_meta import PAGE_RANK, LoRAMeta
from loraserve.kernels.lora_shrink import shrink_splits
from loraserve.lora.adapter import LoRAAdapter
from loraserve.lora.host_arena import HostArena
from loraserve.lora.layers import FACTORED_LAYERS, GEMM_COLUMNS, GEMM_FIRST_LAYERS, LoRALinear
from loraserve.lora.metadata import LoRAMetaBuilder
from loraserve.lora.pool import AdapterPacker, AdapterPool, PackedAdapter, PageLayout, SliceWeights
from loraserve.lora.side_stream import SIDE_STREAM_MAX_TOKENS, LoRAScratch, LoRASideStream
from loraserve.models.lora_spec import LoRAModelSpec

logger = logging.getLogger(__name__)

# Without lora_gpu_memory the adapter pool takes this share of the memory the KV cache could take, and more
# where the KV cache could never use it all (max_num_seqs sequences of max_model_len need less): up to room for
# POOL_STEPS steps of max_loras adapters of max_lora_rank. Measured for Llama-3-8B on an 80 GB budget
# (docs/experiments.md): 129 rank-16 adapters, and the KV cache keeps 0.752 of the blocks it has without LoRA
# (the weight columns of LoRALinear.enable_columns take 1.31 GiB of it, the pool 10.2 GiB).
DEFAULT_POOL_SHARE = 0.224
# Room for the adapters of the running requests and as many again, read and copied ahead for the next ones: with
# room for one step's only, the pool was full from the first wave of a trace over 512 adapters and the adapters
# of each next wave were copied in as its requests were admitted (docs/experiments.md, the default pool).
POOL_STEPS = 2
CPU_POOL_BYTES = 256 * 2**20  # the default pool on a CPU: at most this, at most max_loras adapters of max rank


@dataclass(frozen=True)
class KVRoom:
    """What the KV cache could take on the device before it is allocated, and the most it can ever use
    (bytes); the default adapter pool is sized against it."""

    available: int
    useful: int


@dataclass(frozen=True)
class LoRABatch:
    """The LoRA state of one forward pass (ForwardContext.lora), read by the LoRA layers only."""

    metas: tuple[LoRAMeta, ...]  # the step's token -> adapter metadata (static device buffers), per page block
    side: LoRASideStream | None  # decode-sized products beside the base GEMMs (CUDA); None: in place, in order
    # per page block: whether an adapter of the step has weights in it (its layers run no LoRA kernels when not);
    # None: every block runs them (a pass captured into a graph, which later steps replay with other adapters)
    active: tuple[bool, ...] | None = None
    # larger steps on one GPU, the products as extra columns of the base GEMMs (LoRALinear.input_columns): the
    # step's adapters side by side, each as wide as its largest rank, take step_columns columns per slice (at
    # least PAGE_RANK in the warm-up); num_slots adapters; 0: not in this pass
    step_columns: int = 0
    num_slots: int = 0
    # what those columns hold (the ids, what each id was given, step_columns): equal keys, equal columns, so a
    # layer whose weight has the step's B beside it already need not place them again; (): place them
    columns_key: tuple = ()
    # an eager pass: no adapter of the step has a larger rank in any layer (host), so the kernels that expand
    # LoRA factors take dots this wide (LoRAFactors.max_rank); None: the pool's max_lora_rank (a captured pass,
    # which later steps replay with other adapters)
    step_rank: int | None = None


@dataclass
class PeerLoad:
    """An adapter rank 0 loaded, for the other ranks of a tensor-parallel group to load at the same id and
    pages, each its own part: rank r's is data[r - 1] (shared memory, sent to r's process without a copy)."""

    adapter_id: int
    pages: list[int]
    data: torch.Tensor  # [ranks - 1, pages, width]
    row_blocks: tuple[int, ...]  # [pages]: the page block of each row
    ranks: np.ndarray  # [layers] int32: the adapter's rank in each LoRA layer


class TensorParallelPacker:
    """Packs adapters for a tensor-parallel group in rank 0's process: this rank's part of each LoRA layer (the
    base layer's split, `lora_shard`) in page layout, and the other ranks' parts in the same layout beside it
    (`PackedAdapter.peer_data`, shared memory: sent to their processes without a copy)."""

    def __init__(self, packer: AdapterPacker, layers: list[tuple[int, LoRALinear]], tp: ParallelGroup):
        self.packer, self.layers, self.tp = packer, layers, tp

    def pack(self, adapter: LoRAAdapter) -> PackedAdapter:
        packed = self.pack_own(adapter)
        peers = torch.zeros((self.tp.size - 1, *packed.data.shape), dtype=self.packer.dtype).share_memory_()
        others = [r for r in range(self.tp.size) if r != self.tp.rank]
        for part, r in zip(peers, others):  # part: [pages, width], written in place
            self.packer.pack_layers(self._rank_weights(adapter, r), data=part)
        packed.peer_data = peers  # [ranks - 1, pages, width]
        return packed

    def shape_of(self, adapter: LoRAAdapter) -> tuple[int, int]:
        """(pages, width) of each rank's packed part (the same on every rank)."""
        return self.packer.shape_of(adapter)

    def pack_own(self, adapter: LoRAAdapter) -> PackedAdapter:
        """This rank's part alone (an adapter every rank packs for itself: the graph check's probes)."""
        return self.packer.pack_layers(self._rank_weights(adapter, self.tp.rank))

    def _rank_weights(self, adapter: LoRAAdapter, rank: int) -> list[list[SliceWeights | None]]:
        """Per LoRA layer, per slice: rank `rank`'s part of the adapter's (A, B) and B's scale, or None where it
        has none."""
        return [[None if w is None else (*layer.base.lora_shard(w[0], w[1], s, rank), w[2])
                 for s, w in enumerate(slices)]
                for (_, layer), slices in zip(self.layers, self.packer.layer_weights(adapter))]


class LoRARuntime:
    """Wraps the model's LoRA targets in LoRALinear layers and owns everything they read at run time.

    `max_step_tokens`: the most tokens one forward pass holds (SchedulerConfig.max_step_tokens), which sizes
    the metadata. `model_name`: the served model's name, compared with an adapter's base model at load.
    The adapter pool holds lora_gpu_memory GiB when set; else, with `kv_room` (CUDA), DEFAULT_POOL_SHARE of
    the KV cache's room, or more as above; else (a CPU) room for max_loras adapters of max rank, at most
    CPU_POOL_BYTES.
    """

    def __init__(self, model: nn.Module, config: LoRAConfig, max_step_tokens: int, model_name: str | None,
                 kv_room: KVRoom | None = None, tp: ParallelGroup = NO_PARALLEL):
        self.config = config
        self.tp = tp  # the model's tensor-parallel group (its layers hold this rank's part)
        self._peer_loads: list[PeerLoad] = []  # rank 0: loads the other ranks repeat before the next step
        self.spec: LoRAModelSpec = replace(model.lora_spec(), model_name=model_name)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.layers: list[tuple[int, LoRALinear]] = []  # (decoder layer index, LoRA layer), in model order
        attrs = []
        for target in model.lora_targets():
            layer = LoRALinear(target.linear, target.slices, gemm_first=target.attr in GEMM_FIRST_LAYERS,
                               factored=target.attr in FACTORED_LAYERS)
            setattr(target.parent, target.attr, layer)
            self.layers.append((target.layer_index, layer))
            attrs.append(target.attr)
        # one GPU, steps larger than the side stream takes: their LoRA products summed inside the base GEMMs
        # (LoRALinear.enable_columns), whose weights take up to GEMM_COLUMNS more columns each (what max_loras
        # adapters of max_lora_rank can use), out of the KV cache's room
        self.gemm_columns = (self.device.type == "cuda" and not tp.is_parallel
                             and max_step_tokens > SIDE_STREAM_MAX_TOKENS)
        # whether a step's adapters can need more room than a layer has (that layer then takes the former path)
        self.columns_may_overflow = False
        if self.gemm_columns:
            most = config.max_loras * config.max_lora_rank
            for _, layer in self.layers:
                need = padded_columns(len(layer.slice_names), most)
                self.columns_may_overflow |= need > GEMM_COLUMNS
                layer.enable_columns(min(GEMM_COLUMNS, need))
                # the former weight's storage back to the device at once: were it cached, the next layer's
                # wider weight would be cut out of it, and the holes left could hold no KV cache
                torch.cuda.empty_cache()
            column_bytes = sum((layer.w_columns.shape[1] - layer.in_features) * layer.out_features
                               for _, layer in self.layers) * self.dtype.itemsize
            logger.info("LoRA in the GEMMs of larger steps: %.2f GiB of weight columns", column_bytes / 2**30)
            if kv_room is not None:
                kv_room = replace(kv_room, available=max(0, kv_room.available - column_bytes))
        layout = PageLayout([(attr, layer.in_features, layer.out_features, layer.slice_offsets)
                             for attr, (_, layer) in zip(attrs, self.layers)])
        self.pool = AdapterPool(layout, self._num_pages(layout, kv_room), config.max_lora_rank, self.dtype,
                                self.device)
        packer = AdapterPacker(layout, tuple((i, layer.slice_names) for i, layer in self.layers), self.dtype)
        # with several ranks, rank 0 packs every rank's part (adapters are then read on a thread: lora/reader.py)
        self.packer = TensorParallelPacker(packer, self.layers, tp) if tp.is_parallel else packer
        for i, (_, layer) in enumerate(self.layers):
            layer.bind_pool(*self.pool.layer_views(i), self.pool.rank_width, layout.block_of[i])
        logger.info("LoRA adapter pool: %.2f GiB in %d pages of %.1f MiB (each %d rank rows of one of %d blocks of "
                    "layers); it holds %s adapters on every LoRA layer; at most %d distinct adapters in one step",
                    self.pool.num_pages * self.pool.page_bytes / 2**30, self.pool.num_pages,
                    self.pool.page_bytes / 2**20, PAGE_RANK, layout.num_blocks,
                    self.pool.capacity_summary(), config.max_loras)
        self.metadata = LoRAMetaBuilder(max_step_tokens, config.max_loras,
                                        self.pool.block_tables, self.pool.block_targets, self.pool.adapter_ranks)
        self.side: LoRASideStream | None = None
        self._load_stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self.side = LoRASideStream(torch.cuda.Stream(self.device),
                                       self._allocate_scratch(min(SIDE_STREAM_MAX_TOKENS, max_step_tokens)))
            self._load_stream = torch.cuda.Stream(self.device)
        # rank 0 packs and caches the adapters on the host (the other ranks copy their parts from shared memory)
        self.host: HostArena | None = None
        if self.device.type == "cuda" and tp.rank == 0:
            start = time.perf_counter()
            headroom = 2 * self.pool.max_adapter_pages * self.pool.page_bytes  # adapters being read, not yet cached
            # shared where it can be, so that reader processes pack straight into it (lora/reader.py)
            self.host = HostArena(int(config.max_cpu_lora_memory * 2**30) + headroom,
                                  shared=hasattr(os, "memfd_create"))
            logger.info("LoRA host cache: %.2f GiB of pinned memory (%.1f s)", self.host.nbytes / 2**30,
                        time.perf_counter() - start)

    def _num_pages(self, layout: PageLayout, kv_room: KVRoom | None) -> int:
        page_bytes = layout.page_elems * self.dtype.itemsize
        max_pages = layout.pages_for(self.config.max_lora_rank)  # one adapter on every layer
        step_pages = self.config.max_loras * max_pages  # the most one step can use
        if self.config.lora_gpu_memory is not None:
            size = int(self.config.lora_gpu_memory * 2**30)
        elif kv_room is not None:
            unused_by_kv = min(kv_room.available - kv_room.useful, POOL_STEPS * step_pages * page_bytes)
            size = int(max(DEFAULT_POOL_SHARE * kv_room.available, unused_by_kv))
        else:
            return max(max_pages, min(CPU_POOL_BYTES // page_bytes, step_pages))
        pages = size // page_bytes
        if pages < max_pages:
            raise ValueError(f"the LoRA pool of {size / 2**30:.3g} GiB holds {pages} pages of {page_bytes / 2**20:.1f} "
                             f"MiB, but an adapter of max_lora_rank={self.config.max_lora_rank} needs {max_pages}: "
                             "raise lora_gpu_memory or lower max_lora_rank")
        return pages

    def _allocate_scratch(self, max_tokens: int) -> LoRAScratch:
        """Static scratch for the side-stream products of every layer, steps of up to max_tokens tokens."""
        layers = [layer for _, layer in self.layers]
        splits = max(shrink_splits(t, layer.in_features, layer.lora_rows) for layer in layers for t in (1, max_tokens))
        return LoRAScratch.allocate(max_tokens, max(layer.out_features for layer in layers),
                                    max(layer.lora_rows for layer in layers), splits, self.dtype, self.device)

    # -- a forward pass -------------------------------------------------------------------
    def write_metadata(self, token_adapters: np.ndarray) -> tuple[LoRAMeta, ...]:
        """Write the metadata of a step's tokens (token_adapters: [T] adapter id per token, -1 = base) into the
        static buffers (one LoRAMeta per page block); the copy is issued on the current stream, ahead of the
        pass that reads it."""
        self.metadata.build(token_adapters)
        return self.metadata.metas

    def for_step(self, token_adapters: np.ndarray, every_block: bool = False, in_gemms: bool = True,
                 step_rank: int | None = None) -> LoRABatch:
        """write_metadata, and the LoRA state of an eager pass over these tokens: the layers of page blocks that
        no adapter of the step has weights in run without LoRA kernels, unless `every_block` (the start-up
        warm-up, which compiles them); on one GPU larger steps sum the products inside the base GEMMs, unless
        not `in_gemms` (the warm-up compiles the other path too). `step_rank`: the LoRABatch's, in place of
        the step's adapters' largest rank (the warm-up, whose adapter holds nothing, compiles each width)."""
        metas = self.write_metadata(token_adapters)
        active = None if every_block else self.metadata.active
        adapters = self.metadata.step_adapters
        rank = self.metadata.step_rank if step_rank is None else step_rank
        if not (self.gemm_columns and in_gemms) or not adapters.size:
            return LoRABatch(metas, self._side_for_this_pass(), active, step_rank=rank)
        columns = self.metadata.step_columns
        if every_block:
            columns = max(columns, PAGE_RANK)  # the warm-up's adapter id holds nothing: compile that path anyway
        key = (tuple(adapters.tolist()), tuple(self.pool.adapter_versions[adapters].tolist()), columns)
        return LoRABatch(metas, self._side_for_this_pass(), active, columns, int(adapters.size), key, rank)

    @property
    def factors_may_run(self) -> bool:
        """Whether larger steps can pass a layer's product on as factors (FACTORED_LAYERS): their adapters may
        not fit the base GEMMs' columns, or there are none."""
        return self.columns_may_overflow or not self.gemm_columns

    def expand_widths(self) -> tuple[int, ...]:
        """The widths a step's rank bound (LoRABatch.step_rank) gives the dots of the kernels that expand LoRA
        factors, each a kernel of its own: 16, 32 and 64 up to the pool's rank width, and that width."""
        width = self.pool.rank_width
        return tuple(sorted({min(width, w) for w in (16, 32, 64)} | {width}))

    def for_capture(self) -> LoRABatch:
        """The LoRA state of a pass captured into a CUDA graph: the static metadata buffers, not rewritten."""
        return LoRABatch(self.metadata.metas, self._side_for_this_pass())

    def _side_for_this_pass(self) -> LoRASideStream | None:
        return self.side.for_this_pass() if self.side is not None else None

    # -- the pool -------------------------------------------------------------------------------
    def pack(self, adapter: LoRAAdapter, local_only: bool = False) -> PackedAdapter:
        """The adapter in page layout in host memory (the pinned host arena where it has room); touches no device
        state (any thread). With several ranks it also holds the other ranks' parts (`peer_data`), unless
        local_only (an adapter every rank packs for itself)."""
        if self.tp.is_parallel and local_only:
            packed = self.packer.pack_own(adapter)
        else:
            packed = self.packer.pack(adapter)
        return self.host.hold(packed) if self.host is not None else packed

    def pages_of(self, adapter: LoRAAdapter) -> int:
        """The pool pages `adapter` takes (the same on every rank of a tensor-parallel group)."""
        return self.packer.shape_of(adapter)[0]

    def release_host(self, packed: PackedAdapter) -> None:
        """The host cache dropped `packed`: its arena range is reused once its last copy to the pool is done."""
        if self.host is not None:
            self.host.give_back(packed.data)

    def load(self, packed: PackedAdapter) -> tuple[int, torch.cuda.Event | None]:
        """Copy a packed adapter into free pages (the caller made room); returns its id and, on CUDA, the event
        that marks the copy done (on the load stream, so it overlaps the step in flight). Before a step reads
        the adapter, the stream that runs it must wait for the event (`wait_for`). The pages must hold no adapter
        a step in flight reads (the manager releases only adapters with no request running)."""
        adapter_id, pages = self.pool.allocate(packed.num_pages)
        if packed.peer_data is not None:
            self._peer_loads.append(PeerLoad(adapter_id, pages, packed.peer_data, packed.row_blocks,
                                             packed.ranks.numpy().copy()))
        return adapter_id, self._write(adapter_id, pages, packed)

    def _write(self, adapter_id: int, pages: list[int], packed: PackedAdapter) -> torch.cuda.Event | None:
        """Copy a packed adapter into `pages` under `adapter_id`; on CUDA on the load stream, returning the event
        that marks the copy done (None on the CPU, where the copy is done on return)."""
        if self._load_stream is None:
            self.pool.write_at(adapter_id, pages, packed)
            return None
        with torch.cuda.stream(self._load_stream):
            self.pool.write_at(adapter_id, pages, packed)
            done = torch.cuda.Event()
            done.record(self._load_stream)
        if self.host is not None:
            self.host.copied(packed.data, done)  # its range is not reused before this copy is done
        return done

    def take_peer_loads(self) -> list[PeerLoad]:
        """Rank 0: the loads since the last call, for the other ranks to repeat before the next step."""
        loads, self._peer_loads = self._peer_loads, []
        return loads

    def load_peer(self, load: PeerLoad) -> None:
        """Rank r > 0: write its part of an adapter rank 0 loaded, at the same id and pages; the current stream
        is ordered after the copy."""
        packed = PackedAdapter(load.data[self.tp.rank - 1], load.row_blocks, torch.from_numpy(load.ranks))
        self.wait_for(self._write(load.adapter_id, load.pages, packed))

    def wait_for(self, event: torch.cuda.Event | None) -> None:
        """Order the current stream after a load."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def release(self, adapter_id: int) -> None:
        """Free an adapter's pages and id (no step in flight may read it)."""
        self.pool.release(adapter_id)

"""The GPU adapter pool: device memory sized in bytes, handed out in pages of PAGE_RANK rank rows.

The LoRA layers of one module (every layer's q/k/v, every o, ...) are cut into blocks of consecutive layers
(`PageLayout`), sized so that the blocks of every module fill about the same number of elements; the pool's
pages all have that size. A page holds PAGE_RANK rank rows of one adapter for the layers of one block, as
one contiguous row of the pool's storage ([P, page elements]). An adapter of rank r takes cdiv(r, PAGE_RANK)
pages for each block whose layers it targets, wherever they are free: it occupies memory for its own rank
(not for max_lora_rank) and for its own modules (an adapter of q/k/v/o takes no page of the MLP blocks).
Its host copy (`PackedAdapter`, laid out by `AdapterPacker` in any thread or process) holds one row per
page, and loading it costs one host-to-device copy per page.

Adapter ids are the rows of the page table ([A, blocks * max_pages] int32, A = P: block b's pages in columns
b * max_pages ...) and of the per-layer rank table ([layers, A] int32); each LoRA layer reads views of the
storage, its block's columns of the page table (through the step metadata) and its rank row
(kernels/lora_meta.py), whose addresses never change, so CUDA graphs captured once read whatever the pool
holds at replay. The pool only does the bookkeeping of pages and ids and the copies; which adapter goes in
or out is the LoRA manager's choice.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraserve.kernels.launch import cdiv
from loraserve.kernels.lora_meta import PAGE_RANK
from loraserve.lora.adapter import LoRAAdapter, all_finite
from loraserve.lora.peft_config import LoRAAdapterError

ALIGN = 64  # elements: every layer's region in a page starts on a 128-byte boundary (bf16)
# Pages may hold up to this many times the largest layer's rows: the page size among 1x..MAX_PAGE_LAYERS x that
# wasting the least memory (an adapter on every layer) is taken, the largest of equals (fewer pages per adapter).
MAX_PAGE_LAYERS = 8


@dataclass(frozen=True)
class LayerRegion:
    """Where one LoRA layer's page rows sit inside a page of its block (element offsets)."""

    a_offset: int  # A: [S*PAGE_RANK, in] row-major
    b_offset: int  # B^T: [PAGE_RANK, N] row-major
    num_slices: int
    in_features: int
    out_features: int
    slice_offsets: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.b_offset + PAGE_RANK * self.out_features


class PageLayout:
    """The page blocks and the element layout of a page for a list of LoRA layers (in the runtime's layer order).

    layers: per layer (module attr, in_features, out_features, slice_offsets). The layers of each module attr
    (in order of first appearance) are cut greedily, in layer order, into blocks whose regions (each aligned to
    ALIGN elements) fit one page; `block_of[i]` is layer i's block and its region's offsets are within a page
    of that block.
    """

    def __init__(self, layers: list[tuple[str, int, int, tuple[int, ...]]]):
        if not layers:
            raise ValueError("a page layout needs at least one LoRA layer")
        kinds = list(dict.fromkeys(attr for attr, *_ in layers))
        self._by_kind = [[i for i, (attr, *_) in enumerate(layers) if attr == kind] for kind in kinds]
        self._sizes = [_region_size(in_features, out_features, len(offsets) - 1)
                       for _, in_features, out_features, offsets in layers]
        largest = max(self._sizes)
        # (waste, -size): the least memory for an adapter on every layer, then the largest page
        _, neg_size = min((len(self._blocks_for(m * largest)) * m * largest, -m * largest)
                          for m in range(1, MAX_PAGE_LAYERS + 1))
        self.page_elems = -neg_size
        blocks = self._blocks_for(self.page_elems)
        self.regions: list[LayerRegion | None] = [None] * len(layers)
        self.block_of = [0] * len(layers)
        for b, members in enumerate(blocks):
            offset = 0
            for i in members:
                _, in_features, out_features, offsets = layers[i]
                num_slices = len(offsets) - 1
                b_offset = _aligned(offset + num_slices * PAGE_RANK * in_features)
                self.regions[i] = LayerRegion(offset, b_offset, num_slices, in_features, out_features, tuple(offsets))
                self.block_of[i] = b
                offset = _aligned(self.regions[i].end)
        self.num_blocks = len(blocks)

    def _blocks_for(self, page_elems: int) -> list[list[int]]:
        """The blocks (layer indices) when pages have page_elems elements."""
        blocks = []
        for members in self._by_kind:
            used = page_elems  # start a block at the first layer
            for i in members:
                if used + self._sizes[i] > page_elems:
                    blocks.append([])
                    used = 0
                blocks[-1].append(i)
                used += self._sizes[i]
        return blocks

    def pages_for(self, rank: int) -> int:
        """The pages of an adapter of `rank` on every LoRA layer: cdiv(rank, PAGE_RANK) in each block."""
        return cdiv(rank, PAGE_RANK) * self.num_blocks

    def a_view(self, storage: torch.Tensor, i: int) -> torch.Tensor:
        """Layer i's A rows in every page: [P, S*PAGE_RANK, in] (page stride = page_elems)."""
        r = self.regions[i]
        rows = r.num_slices * PAGE_RANK
        return storage[:, r.a_offset:r.a_offset + rows * r.in_features].view(-1, rows, r.in_features)

    def b_view(self, storage: torch.Tensor, i: int) -> torch.Tensor:
        """Layer i's B^T rows in every page: [P, PAGE_RANK, N]."""
        r = self.regions[i]
        return storage[:, r.b_offset:r.end].view(-1, PAGE_RANK, r.out_features)


def _aligned(n: int) -> int:
    return cdiv(n, ALIGN) * ALIGN


def _region_size(in_features: int, out_features: int, num_slices: int) -> int:
    """Elements of one layer's region in a page: its A rows, then its B^T rows, each aligned."""
    return _aligned(_aligned(num_slices * PAGE_RANK * in_features) + PAGE_RANK * out_features)


@dataclass
class PackedAdapter:
    """An adapter in page layout in host memory, ready to copy: one row per page it takes, row p for page
    block row_blocks[p] (a block's rows are consecutive, its rank rows 0.., PAGE_RANK per row), each the first
    `width` elements of its page (zeros where it has no weights)."""

    data: torch.Tensor  # [pages, width], in the pinned host arena on CUDA (lora/host_arena.py)
    row_blocks: tuple[int, ...]  # [pages]: the page block of each row
    ranks: torch.Tensor  # [layers] int32: its rank in each LoRA layer (0: not targeted)
    # tensor parallel: the other ranks' parts in the same layout, [ranks - 1, pages, width] in shared memory
    # (lora.runtime.LoRARuntime.pack makes them on rank 0); None with one rank
    peer_data: torch.Tensor | None = None

    @property
    def num_pages(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        peers = self.peer_data.numel() if self.peer_data is not None else 0
        return (self.data.numel() + peers) * self.data.element_size()


@dataclass(frozen=True)
class AdapterPlan:
    """Where an adapter goes in page layout: its targeted layers, its rank per layer ([layers] int32, 0: not
    targeted), the page block of each of its rows, and (pages, width) of its packed data."""

    targeted: tuple[int, ...]
    ranks: torch.Tensor
    row_blocks: tuple[int, ...]
    shape: tuple[int, int]


# One slice of a LoRA layer: (A [r, in], B [out_s, r] as read, B's scale)
SliceWeights = tuple[torch.Tensor, torch.Tensor, float]


def _scaled(b: torch.Tensor, scale: float, buffer: torch.Tensor) -> torch.Tensor:
    """b * scale in `buffer`'s dtype (the model's; at least b.numel() elements, reused from one B to the next),
    in b's own memory order: each product taken in float32 (b upcast first unless it is float32 or that dtype,
    whose products torch takes in float32) and rounded once. The packer then copies it like an unscaled B:
    written straight into the pages' strided rows, the products took 2.4x the plain copy's time, this way 1.4x
    (docs/experiments.md, "Scaling B while it is packed")."""
    source = b if b.dtype in (buffer.dtype, torch.float32) else b.to(torch.float32)
    return torch.mul(source, scale, out=buffer[:b.numel()].view(b.shape))


@dataclass(frozen=True)
class AdapterPacker:
    """The host side of the pool: an adapter's weights in page layout (`PackedAdapter`). It holds no device state
    and pickles, so it packs in any thread or process (lora/reader.py packs in reader processes)."""

    layout: PageLayout
    layers: tuple[tuple[int, tuple[str, ...]], ...]  # per LoRA layer (layout order): decoder layer index, slice modules
    dtype: torch.dtype

    def layer_weights(self, adapter: LoRAAdapter) -> list[list[SliceWeights | None]]:
        """Per LoRA layer (layout order), per slice: the adapter's (A [r, in], B [out_s, r], B's scale), or
        None."""
        return [[(*adapter.weights[(layer, m)], adapter.scale_of((layer, m))) if (layer, m) in adapter.weights
                 else None for m in names] for layer, names in self.layers]

    def plan(self, weights: list[list[SliceWeights | None]]) -> AdapterPlan:
        """The page plan of `weights` (layer_weights' form): each targeted block takes cdiv(its largest rank,
        PAGE_RANK) rows; the width reaches the end of the last targeted region of any of them."""
        targeted = tuple(i for i, slices in enumerate(weights) if any(p is not None for p in slices))
        if not targeted:
            raise ValueError("the adapter targets no LoRA layer")
        ranks = torch.zeros(len(weights), dtype=torch.int32)
        block_rank: dict[int, int] = {}
        for i in targeted:
            ranks[i] = max(pair[0].shape[0] for pair in filter(None, weights[i]))
            b = self.layout.block_of[i]
            block_rank[b] = max(block_rank.get(b, 0), int(ranks[i]))
        row_blocks = tuple(b for b in sorted(block_rank) for _ in range(cdiv(block_rank[b], PAGE_RANK)))
        width = max(self.layout.regions[i].end for i in targeted)
        return AdapterPlan(targeted, ranks, row_blocks, (len(row_blocks), width))

    def shape_of(self, adapter: LoRAAdapter) -> tuple[int, int]:
        """(pages, width) of the adapter's packed data."""
        return self.plan(self.layer_weights(adapter)).shape

    def pack(self, adapter: LoRAAdapter, data: torch.Tensor | None = None) -> PackedAdapter:
        """The adapter in page layout, written into `data` (zeros of self.dtype, shape_of(adapter)) when given,
        else into new host memory. Weights are cast to self.dtype, and B scaled, as they are copied. In float16
        a weight can overflow there (the adapter's file was checked finite): LoRAAdapterError. Every value in
        the pool must be finite: where the LoRA products are summed inside the base GEMMs, every token's row
        meets every adapter's columns of the step (lora/layers.py), with zeros, and 0 * Inf is NaN."""
        packed = self.pack_layers(self.layer_weights(adapter), data)
        if self.dtype == torch.float16 and not all_finite(packed.data):
            raise LoRAAdapterError(adapter.name, "its weights overflow float16, the model's dtype, once B is "
                                                 "scaled (lora_alpha / r)")
        return packed

    def pack_layers(self, weights: list[list[SliceWeights | None]],
                    data: torch.Tensor | None = None) -> PackedAdapter:
        """`pack` of weights given per layer and slice (layer_weights' form), e.g. one tensor-parallel rank's part."""
        plan = self.plan(weights)
        if data is None:
            data = torch.zeros(plan.shape, dtype=self.dtype)  # [pages, width]
        elif tuple(data.shape) != plan.shape or data.dtype != self.dtype:
            raise ValueError(f"packing needs a {plan.shape} {self.dtype} buffer, got {tuple(data.shape)} {data.dtype}")
        products = torch.empty(0, dtype=self.dtype)  # B's scaled copies, one buffer reused for each B
        for i in plan.targeted:
            r = self.layout.regions[i]
            first = plan.row_blocks.index(self.layout.block_of[i])  # the block's first row
            rows = data[first:first + plan.row_blocks.count(self.layout.block_of[i])]  # [block pages, width]
            num_pages = rows.shape[0]
            a_pages = rows[:, r.a_offset:r.a_offset + r.num_slices * PAGE_RANK * r.in_features]
            a_pages = a_pages.view(num_pages, r.num_slices, PAGE_RANK, r.in_features)
            b_pages = rows[:, r.b_offset:r.end].view(num_pages, PAGE_RANK, r.out_features)
            for s, pair in enumerate(weights[i]):
                if pair is None:
                    continue
                a, b, scale = pair  # a: [rank, in], b: [out_s, rank]
                if scale != 1:
                    if products.numel() < b.numel():
                        products = torch.empty(b.numel(), dtype=self.dtype)
                    b = _scaled(b, scale, products)
                lo, hi = r.slice_offsets[s], r.slice_offsets[s + 1]
                full = a.shape[0] // PAGE_RANK  # whole pages in one copy each for A and B, then the rest
                if full:
                    n = full * PAGE_RANK
                    a_pages[:full, s] = a[:n].reshape(full, PAGE_RANK, -1)
                    b_pages[:full, :, lo:hi] = b[:, :n].T.reshape(full, PAGE_RANK, -1)
                rest = a.shape[0] - full * PAGE_RANK
                if rest:
                    a_pages[full, s, :rest] = a[full * PAGE_RANK:]
                    b_pages[full, :rest, lo:hi] = b[:, full * PAGE_RANK:].T
        return PackedAdapter(data, plan.row_blocks, plan.ranks)


class AdapterPool:
    """Device storage for `num_pages` pages, the page table and the rank table; page and id bookkeeping."""

    def __init__(self, layout: PageLayout, num_pages: int, max_rank: int, dtype: torch.dtype, device):
        if num_pages < 1:
            raise ValueError(f"the adapter pool needs at least one page, got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.max_pages = cdiv(max_rank, PAGE_RANK)  # pages per block of an adapter of max_rank
        self.device, self.dtype = torch.device(device), dtype
        self.storage = torch.zeros(num_pages, layout.page_elems, dtype=dtype, device=device)  # [P, page elements]
        columns = layout.num_blocks * self.max_pages
        self.page_table = torch.zeros(num_pages, columns, dtype=torch.int32, device=device)  # [A, blocks * pages]
        self.ranks = torch.zeros(len(layout.regions), num_pages, dtype=torch.int32, device=device)  # [layers, A]
        # each id's page-table row staged in pinned memory, so that its copy overlaps the steps too
        self._table_rows = torch.zeros(num_pages, columns, dtype=torch.int32,
                                       pin_memory=self.device.type == "cuda")  # [A, blocks * pages]
        # which page blocks each id's adapter has weights in (host; the step metadata reads it: lora/metadata.py)
        self.block_targets = np.zeros((num_pages, layout.num_blocks), dtype=bool)  # [A, blocks]
        self.adapter_ranks = np.zeros(num_pages, dtype=np.int32)  # [A] each id's largest rank (host, as above)
        self.adapter_versions = np.zeros(num_pages, dtype=np.int64)  # [A] how many adapters each id was given
        self._free_pages = list(range(num_pages - 1, -1, -1))  # a stack: the lowest page first
        self._free_ids = list(range(num_pages - 1, -1, -1))
        self._pages_of: dict[int, list[int]] = {}  # adapter id -> its pages

    @property
    def page_bytes(self) -> int:
        return self.layout.page_elems * self.storage.element_size()

    @property
    def rank_width(self) -> int:
        """R: the rank rows per slice of the kernels' intermediate (whole pages)."""
        return self.max_pages * PAGE_RANK

    @property
    def max_adapter_pages(self) -> int:
        """The pages of the largest adapter: max_rank on every LoRA layer."""
        return self.layout.pages_for(self.rank_width)

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free_pages)

    def layer_views(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lora_a [P, S*PAGE_RANK, in], lora_b [P, PAGE_RANK, N], lora_rank [A]) of layer i."""
        return self.layout.a_view(self.storage, i), self.layout.b_view(self.storage, i), self.ranks[i]

    @property
    def block_tables(self) -> tuple[torch.Tensor, ...]:
        """Each page block's columns of the page table: [A, max_pages] views (rows contiguous)."""
        return tuple(self.page_table[:, b * self.max_pages:(b + 1) * self.max_pages]
                     for b in range(self.layout.num_blocks))

    # -- pages and ids ------------------------------------------------------------------
    def allocate(self, num_pages: int) -> tuple[int, list[int]]:
        """An adapter id and `num_pages` free pages (the caller made room); raises RuntimeError otherwise."""
        if num_pages > len(self._free_pages) or not self._free_ids:
            raise RuntimeError(f"the adapter pool has {len(self._free_pages)} free pages, {num_pages} needed")
        adapter_id = self._free_ids.pop()
        pages = [self._free_pages.pop() for _ in range(num_pages)]
        self._pages_of[adapter_id] = pages
        return adapter_id, pages

    def write_at(self, adapter_id: int, pages: list[int], packed: PackedAdapter) -> None:
        """Copy a packed adapter into `pages` and its rows of the page and rank tables under `adapter_id` (on the
        current stream; the host buffers must stay alive until the copy is done). The pages and id come from
        `allocate`, or on another rank of a tensor-parallel group from rank 0's pool. From pinned host memory
        the copies return at once; from ordinary memory each waits for the ones before it on the stream.
        (An id's staged row is rewritten only when the id is given again; a copy of its old row still in
        flight then writes the new row: the id's new pages, which is right. Columns of blocks the adapter does
        not target keep stale pages, never read: its rank in their layers is 0.)"""
        if len(pages) != packed.num_pages:
            raise ValueError(f"adapter id {adapter_id} holds {len(pages)} pages, the adapter needs {packed.num_pages}")
        width = packed.data.shape[1]
        table_row = self._table_rows[adapter_id]
        for p, (page, block) in enumerate(zip(pages, packed.row_blocks)):
            self.storage[page, :width].copy_(packed.data[p], non_blocking=True)
            j = p - packed.row_blocks.index(block)  # its rank rows j * PAGE_RANK ... within the block
            table_row[block * self.max_pages + j] = page
        self.page_table[adapter_id].copy_(table_row, non_blocking=True)
        self.ranks[:, adapter_id].copy_(packed.ranks, non_blocking=True)
        self.block_targets[adapter_id] = False
        self.block_targets[adapter_id, list(packed.row_blocks)] = True
        self.adapter_ranks[adapter_id] = int(packed.ranks.max())
        self.adapter_versions[adapter_id] += 1

    def release(self, adapter_id: int) -> None:
        """Return an adapter's pages and id to the free lists (bookkeeping only: no step refers to a released
        id, and the next adapter given it overwrites its whole column of ranks)."""
        pages = self._pages_of.pop(adapter_id)
        self.block_targets[adapter_id] = False
        self._free_pages.extend(reversed(pages))
        self._free_ids.append(adapter_id)

    def capacity_summary(self) -> str:
        """How many adapters on every LoRA layer of common ranks fit, e.g. '1024 of rank 8, 512 of rank 16, ...'."""
        return ", ".join(f"{self.num_pages // self.layout.pages_for(r)} of rank {r}"
                         for r in (8, 16, 32, 64, 128) if r <= self.rank_width)

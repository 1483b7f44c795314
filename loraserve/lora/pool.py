"""The GPU adapter pool: device memory sized in bytes, handed out in pages of PAGE_RANK rank rows.

A page holds PAGE_RANK rank rows of one adapter for every LoRA layer, as one
contiguous block of the pool's storage ([P, page elements]); an adapter of rank
r takes cdiv(r, PAGE_RANK) pages, wherever they are free, so it occupies memory
for its own rank, not for max_lora_rank. Inside a page the layers are ordered
by module (every layer's q/k/v, then every o, gate/up, down: `PageLayout`), so
an adapter that targets only some modules fills one contiguous span of each
of its pages: its host copy (`PackedAdapter`, laid out by `AdapterPacker` in
any thread or process) holds only that span, and loading it costs one
host-to-device copy per page.

Adapter ids are the rows of the page table ([A, max_pages] int32, A = P) and of
the per-layer rank table ([layers, A] int32); the LoRA layers read views of
the storage and these tables (kernels/lora_meta.py), whose addresses never
change, so CUDA graphs captured once read whatever the pool holds at replay.
The pool only does the bookkeeping of pages and ids and the copies; which
adapter goes in or out is the LoRA manager's choice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.kernels.launch import cdiv
from loraserve.kernels.lora_meta import PAGE_RANK
from loraserve.lora.adapter import LoRAAdapter

ALIGN = 64  # elements: every layer's region in a page starts on a 128-byte boundary (bf16)


@dataclass(frozen=True)
class LayerRegion:
    """Where one LoRA layer's page rows sit inside a page (element offsets)."""

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
    """The element layout of one page for a list of LoRA layers (in the runtime's layer order).

    layers: per layer (module attr, in_features, out_features, slice_offsets). Regions are ordered by
    module attr (first appearance), then by layer, each aligned to ALIGN elements.
    """

    def __init__(self, layers: list[tuple[str, int, int, tuple[int, ...]]]):
        kinds = list(dict.fromkeys(attr for attr, *_ in layers))
        order = sorted(range(len(layers)), key=lambda i: (kinds.index(layers[i][0]), i))
        regions: list[LayerRegion | None] = [None] * len(layers)
        offset = 0
        for i in order:
            _, in_features, out_features, offsets = layers[i]
            num_slices = len(offsets) - 1
            a_offset = offset
            b_offset = _aligned(a_offset + num_slices * PAGE_RANK * in_features)
            regions[i] = LayerRegion(a_offset, b_offset, num_slices, in_features, out_features, tuple(offsets))
            offset = _aligned(regions[i].end)
        self.regions: list[LayerRegion] = regions
        self.page_elems = offset

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


@dataclass
class PackedAdapter:
    """An adapter in page layout in host memory, ready to copy: the span [span_start, span_start + width)
    of each of its pages (what its targeted layers use; zeros where it has no weights)."""

    data: torch.Tensor  # [pages, width], in the pinned host arena on CUDA (lora/host_arena.py)
    span_start: int
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
class AdapterPacker:
    """The host side of the pool: an adapter's weights in page layout (`PackedAdapter`). It holds no device state
    and pickles, so it packs in any thread or process (lora/reader.py packs in reader processes)."""

    layout: PageLayout
    layers: tuple[tuple[int, tuple[str, ...]], ...]  # per LoRA layer (layout order): decoder layer index, slice modules
    dtype: torch.dtype

    def layer_weights(self, adapter: LoRAAdapter) -> list[list[tuple[torch.Tensor, torch.Tensor] | None]]:
        """Per LoRA layer (layout order), per slice: the adapter's (A [r, in], B [out_s, r]), or None."""
        return [[adapter.weights.get((layer_index, m)) for m in names] for layer_index, names in self.layers]

    def _plan(self, weights: list[list[tuple[torch.Tensor, torch.Tensor] | None]]):
        """The targeted layers of `weights` (layer_weights' form); the adapter's rank per layer ([layers] int32,
        0: not targeted); where its span starts in a page; (pages, width) of its data."""
        targeted = [i for i, slices in enumerate(weights) if any(p is not None for p in slices)]
        if not targeted:
            raise ValueError("the adapter targets no LoRA layer")
        ranks = torch.zeros(len(weights), dtype=torch.int32)
        for i in targeted:
            ranks[i] = max(a.shape[0] for a, _ in filter(None, weights[i]))
        regions = self.layout.regions
        start = min(regions[i].a_offset for i in targeted)
        shape = (cdiv(int(ranks.max()), PAGE_RANK), max(regions[i].end for i in targeted) - start)
        return targeted, ranks, start, shape

    def shape_of(self, adapter: LoRAAdapter) -> tuple[int, int]:
        """(pages, width) of the adapter's packed data."""
        return self._plan(self.layer_weights(adapter))[-1]

    def pack(self, adapter: LoRAAdapter, data: torch.Tensor | None = None) -> PackedAdapter:
        """The adapter in page layout, written into `data` (zeros of self.dtype, shape_of(adapter)) when given,
        else into new host memory. Weights are cast to self.dtype as they are copied."""
        return self.pack_layers(self.layer_weights(adapter), data)

    def pack_layers(self, weights: list[list[tuple[torch.Tensor, torch.Tensor] | None]],
                    data: torch.Tensor | None = None) -> PackedAdapter:
        """`pack` of weights given per layer and slice (layer_weights' form), e.g. one tensor-parallel rank's part."""
        targeted, ranks, start, shape = self._plan(weights)
        if data is None:
            data = torch.zeros(shape, dtype=self.dtype)  # [pages, width]
        elif tuple(data.shape) != shape or data.dtype != self.dtype:
            raise ValueError(f"packing needs a {shape} {self.dtype} buffer, got {tuple(data.shape)} {data.dtype}")
        regions = self.layout.regions
        num_pages = shape[0]
        for i in targeted:
            r = regions[i]
            a_pages = data[:, r.a_offset - start:r.b_offset - start][:, :r.num_slices * PAGE_RANK * r.in_features]
            a_pages = a_pages.view(num_pages, r.num_slices, PAGE_RANK, r.in_features)
            b_pages = data[:, r.b_offset - start:r.end - start].view(num_pages, PAGE_RANK, r.out_features)
            for s, pair in enumerate(weights[i]):
                if pair is None:
                    continue
                a, b = pair  # a: [rank, in], b: [out_s, rank]
                lo, hi = r.slice_offsets[s], r.slice_offsets[s + 1]
                full = a.shape[0] // PAGE_RANK  # whole pages in one copy each for A and B, then the rest
                if full:
                    rows = full * PAGE_RANK
                    a_pages[:full, s] = a[:rows].reshape(full, PAGE_RANK, -1)
                    b_pages[:full, :, lo:hi] = b[:, :rows].T.reshape(full, PAGE_RANK, -1)
                rest = a.shape[0] - full * PAGE_RANK
                if rest:
                    a_pages[full, s, :rest] = a[full * PAGE_RANK:]
                    b_pages[full, :rest, lo:hi] = b[:, full * PAGE_RANK:].T
        return PackedAdapter(data, start, ranks)


class AdapterPool:
    """Device storage for `num_pages` pages, the page table and the rank table; page and id bookkeeping."""

    def __init__(self, layout: PageLayout, num_pages: int, max_rank: int, dtype: torch.dtype, device):
        if num_pages < 1:
            raise ValueError(f"the adapter pool needs at least one page, got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.max_pages = cdiv(max_rank, PAGE_RANK)
        self.device, self.dtype = torch.device(device), dtype
        self.storage = torch.zeros(num_pages, layout.page_elems, dtype=dtype, device=device)  # [P, page elements]
        self.page_table = torch.zeros(num_pages, self.max_pages, dtype=torch.int32, device=device)  # [A, pages]
        self.ranks = torch.zeros(len(layout.regions), num_pages, dtype=torch.int32, device=device)  # [layers, A]
        # each id's page-table row staged in pinned memory, so that its copy overlaps the steps too
        self._table_rows = torch.zeros(num_pages, self.max_pages, dtype=torch.int32,
                                       pin_memory=self.device.type == "cuda")  # [A, pages]
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
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free_pages)

    def layer_views(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lora_a [P, S*PAGE_RANK, in], lora_b [P, PAGE_RANK, N], lora_rank [A]) of layer i."""
        return self.layout.a_view(self.storage, i), self.layout.b_view(self.storage, i), self.ranks[i]

    # -- pages and ids ------------------------------------------------------------------
    def pages_for(self, rank: int) -> int:
        return cdiv(rank, PAGE_RANK)

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
        flight then writes the new row: the id's new pages, which is right.)"""
        if len(pages) != packed.num_pages:
            raise ValueError(f"adapter id {adapter_id} holds {len(pages)} pages, the adapter needs {packed.num_pages}")
        end = packed.span_start + packed.data.shape[1]
        for p, page in enumerate(pages):
            self.storage[page, packed.span_start:end].copy_(packed.data[p], non_blocking=True)
        table_row = self._table_rows[adapter_id, :len(pages)]
        table_row.copy_(torch.tensor(pages, dtype=torch.int32))
        self.page_table[adapter_id, :len(pages)].copy_(table_row, non_blocking=True)
        self.ranks[:, adapter_id].copy_(packed.ranks, non_blocking=True)

    def release(self, adapter_id: int) -> None:
        """Return an adapter's pages and id to the free lists (bookkeeping only: no step refers to a released
        id, and the next adapter given it overwrites its whole column of ranks)."""
        pages = self._pages_of.pop(adapter_id)
        self._free_pages.extend(reversed(pages))
        self._free_ids.append(adapter_id)

    def capacity_summary(self) -> str:
        """How many adapters of common ranks fit, e.g. '1024 of rank 8, 512 of rank 16, ...'."""
        return ", ".join(f"{self.num_pages // self.pages_for(r)} of rank {r}"
                         for r in (8, 16, 32, 64, 128) if r <= self.rank_width)

"""Per-step LoRA metadata on the host: the step's distinct adapters in slots, and the tokens grouped by slot.

The grouping (kernels/lora_meta.LoRAMeta) is computed with numpy, written into
a pinned staging buffer and sent to static device buffers with one
non-blocking copy, so a step needs no GPU sort and no host sync, and CUDA
graphs captured once keep reading the same device addresses. The builder also
owns the split-K shrink's tile counters; the page table it hands the kernels
belongs to the adapter pool.
"""
import numpy as np
import torch

from loraserve.kernels.lora_meta import COUNTER_BLOCK_M, COUNTER_ROW_TILES, TILE_BLOCKS, LoRAMeta

MAX_TILE_INDEX = 1 << 16  # a tile map entry holds the tile within its slot in 16 bits


class LoRAMetaBuilder:
    """Owns the static metadata buffers and refills them each step.

    `page_table` ([A, max_pages] int32 on the device, the pool's), or one such table per page block (the pool's
    columns of each block: `metas` holds one LoRAMeta per table and its own tile counts, every other field
    shared; `meta` is the first): adapter ids are its rows. `block_targets` ([A, tables] bool on the host, the
    pool's, read at each build): whether an adapter id has weights in each table's block; a meta whose block no
    adapter of the step has weights in gets no adapters' tiles, so the kernels skip its layers' LoRA work, and
    `active` tells the host which blocks have work, so that an eager pass launches nothing for the others (None:
    every adapter counts as having weights everywhere). `max_loras`: the
    most distinct adapters one step holds (the slots). The device buffer is one int32 vector whose views are
    the LoRAMeta fields, so a step costs one host->device copy. Two pinned staging buffers are used in turn;
    before one is overwritten, the event recorded after its previous copy is awaited, so a copy still in
    flight is never corrupted. The copy is issued on the current stream, ahead of the kernels that read the
    metadata. The tile counters are zeroed once here and never copied over.
    """

    def __init__(self, max_tokens: int, max_loras: int, page_table: torch.Tensor | tuple[torch.Tensor, ...],
                 block_targets: np.ndarray | None = None, adapter_ranks: np.ndarray | None = None):
        if max_tokens < 1 or max_loras < 1:
            raise ValueError(
                f"max_tokens and max_loras must be >= 1, got {max_tokens}, {max_loras}")
        if max_tokens >= MAX_TILE_INDEX * min(TILE_BLOCKS):
            raise ValueError(f"max_tokens must be below {MAX_TILE_INDEX * min(TILE_BLOCKS)}, got {max_tokens}")
        tables = page_table if isinstance(page_table, tuple) else (page_table,)
        if block_targets is not None and block_targets.shape != (tables[0].shape[0], len(tables)):
            raise ValueError(f"block_targets must be [{tables[0].shape[0]}, {len(tables)}] (ids, page blocks), "
                             f"got {list(block_targets.shape)}")
        self.block_targets = block_targets
        # [A] int32 on the host, the pool's, read at each build: each id's largest rank (the width of its columns
        # when the step's adapters lie side by side: slot_columns); None: every id max_rank wide (the page table)
        self.adapter_ranks = adapter_ranks
        self.num_tables = len(tables)
        self.max_tokens = max_tokens
        self.max_loras = max_loras
        self.num_ids = tables[0].shape[0]
        self.device = tables[0].device
        # the tile maps' lengths: at most this many non-empty tiles (the slots' and the base group's)
        self._map_sizes = [-(-max_tokens // bm) + min(max_loras, max_tokens) + 1 for bm in TILE_BLOCKS]
        size = 2 * max_tokens + 4 * (max_loras + 1) + 2 * len(TILE_BLOCKS) * self.num_tables + sum(self._map_sizes)
        is_cuda = self.device.type == "cuda"
        # buf: [size] int32 = token_slots | sorted_token_ids | slot_start | slot_count | slot_adapter | slot_columns
        # | tile counts (per table) | tile maps
        self._device_buf = torch.full((size,), -1, dtype=torch.int32, device=self.device)
        self._staging = [torch.empty(size, dtype=torch.int32, pin_memory=is_cuda)
                         for _ in range(2 if is_cuda else 1)]
        self._copy_done = [torch.cuda.Event() if is_cuda else None for _ in self._staging]
        self._next = 0
        # counters: [cdiv(Tmax, 16) + min(L, Tmax), COUNTER_ROW_TILES], one per shrink output tile
        tiles = -(-max_tokens // COUNTER_BLOCK_M) + min(max_loras, max_tokens)
        counters = torch.zeros(tiles, COUNTER_ROW_TILES, dtype=torch.int32, device=self.device)
        *fields, columns, maps, counts = self._split(self._device_buf)
        self.metas = tuple(LoRAMeta(*fields, maps, counts[b], table, counters, columns)
                           for b, table in enumerate(tables))
        self.meta = self.metas[0]
        self.active: tuple[bool, ...] = (False,) * self.num_tables  # per block: an adapter of the last build in it
        self.step_adapters = np.zeros(0, dtype=np.int64)  # the last build's distinct adapters, in slot order
        self.step_columns = 0  # the last build's adapters side by side: the sum of their slot_columns widths
        self.step_rank = 0  # the last build's largest slot_columns width: no adapter of it has a larger rank

    def _split(self, buf):
        """Views of buf: token_slots, sorted_token_ids, slot_start, slot_count, slot_adapter, slot_columns,
        (tile maps), tile counts [tables, len(TILE_BLOCKS), 2]."""
        t, n = self.max_tokens, self.max_loras + 1
        views = [buf[:t], buf[t:2 * t], buf[2 * t:2 * t + n], buf[2 * t + n:2 * t + 2 * n],
                 buf[2 * t + 2 * n:2 * t + 3 * n], buf[2 * t + 3 * n:2 * t + 4 * n]]
        offset = 2 * t + 4 * n
        size = 2 * len(TILE_BLOCKS) * self.num_tables
        counts = buf[offset:offset + size].view(self.num_tables, len(TILE_BLOCKS), 2)
        offset, maps = offset + size, []
        for size in self._map_sizes:
            maps.append(buf[offset:offset + size])
            offset += size
        return (*views, tuple(maps), counts)

    def build(self, token_adapters: np.ndarray) -> LoRAMeta:
        """Write the metadata of one step; token_adapters: [T] adapter ids (rows of the page table), -1 = none.
        The step's distinct adapters take slots 0, 1, ... in increasing id order."""
        ids = np.asarray(token_adapters)
        if ids.ndim != 1:
            raise ValueError(f"token_adapters must be 1-D, got shape {ids.shape}")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token_adapters must hold integers, got {ids.dtype}")
        t = ids.shape[0]
        if t > self.max_tokens:
            raise ValueError(f"{t} tokens exceed max_tokens={self.max_tokens}")
        if t and (ids.min() < -1 or ids.max() >= self.num_ids):
            raise ValueError(f"adapter ids must lie in [-1, {self.num_ids}), got [{ids.min()}, {ids.max()}]")
        adapters, slots = np.unique(ids, return_inverse=True)  # adapters: [k] sorted ids (-1 first if present)
        if t and adapters[0] < 0:
            adapters = adapters[1:]
            slots = slots - 1  # the base tokens' -1 stays -1
        if adapters.size > self.max_loras:
            raise ValueError(f"{adapters.size} distinct adapters in one step exceed max_loras={self.max_loras}")

        index = self._next
        self._next = (index + 1) % len(self._staging)
        if self._copy_done[index] is not None:
            self._copy_done[index].synchronize()
        staging = self._staging[index]
        *fields, maps, tile_counts = self._split(staging)
        ts, sorted_ids, start, count, adapter, columns = (v.numpy() for v in fields)
        tile_counts = tile_counts.numpy()

        # keys: [T], base tokens sort after every slot (the base group is slot L)
        keys = np.where(slots < 0, self.max_loras, slots)
        ts[:t] = slots
        ts[t:] = -1
        sorted_ids[:t] = np.argsort(keys, kind="stable")
        sorted_ids[t:] = -1
        count[:] = np.bincount(keys, minlength=self.max_loras + 1)
        start[:] = np.cumsum(count) - count
        adapter[:adapters.size] = adapters
        adapter[adapters.size:] = -1
        widths = (self.adapter_ranks[adapters] if self.adapter_ranks is not None
                  else np.full(adapters.size, self.metas[0].rank_width))  # [k] each slot's columns
        columns[:adapters.size] = np.cumsum(widths) - widths
        self.step_columns = int(widths.sum())
        self.step_rank = int(widths.max()) if widths.size else 0
        columns[adapters.size:] = self.step_columns
        self.step_adapters = adapters
        groups = np.arange(self.max_loras + 1, dtype=np.int64)
        for i, (bm, tile_map) in enumerate(zip(TILE_BLOCKS, maps)):
            tiles = -(-count.astype(np.int64) // bm)  # [L+1] tiles per slot
            first = np.cumsum(tiles) - tiles
            total = int(tiles.sum())
            slot_of = np.repeat(groups, tiles)  # [total]
            codes = tile_map.numpy()
            codes[:total] = (slot_of << 16) | (np.arange(total) - np.repeat(first, tiles))
            codes[total:] = -1
            tile_counts[:, i] = (total - tiles[-1], total)  # the adapters' tiles come before the base group's
        active = self.block_targets[adapters].any(axis=0) if self.block_targets is not None \
            else np.full(self.num_tables, adapters.size > 0)
        tile_counts[~active, :, 0] = 0  # blocks no adapter of the step has weights in: no adapters' tiles
        self.active = tuple(bool(a) for a in active)

        self._device_buf.copy_(staging, non_blocking=True)
        if self._copy_done[index] is not None:
            self._copy_done[index].record()
        return self.meta

"""The LoRA kernels' view of where adapters live (the paged pool) and of one step's tokens.

Adapter weights live in a paged pool: a page holds PAGE_RANK rank rows of an
adapter for the LoRA layers of one page block (consecutive layers of one
module), and an adapter of rank r occupies cdiv(r, PAGE_RANK) pages of each
block it targets, wherever they are. A layer's storage is a view of the pool:
  lora_a: [P, S*PAGE_RANK, in]  page p's rows s*PAGE_RANK + j are rank row j of slice s's A
  lora_b: [P, PAGE_RANK, N]     page p's row j is rank row j of B^T (every slice's columns)
  lora_rank: [A] int32          each adapter id's rank in this layer (0: not targeted / free)
and the page table [A, max_pages] (the pool's columns of the layer's page block) maps an adapter id and its
rank row r to the page holding it (page_table[id, r // PAGE_RANK]).

A step's tokens are grouped by adapter into at most L "slots" (L = max_loras, the distinct adapters one
step may mix): slot l holds adapter id slot_adapter[l], its tokens are sorted_token_ids[slot_start[l] :
slot_start[l] + slot_count[l]]; slot L groups the tokens without an adapter (adapter -1), after all others.
A kernel's program finds its tile of BLOCK_M tokens in the tile map of that BLOCK_M (one per TILE_BLOCKS
entry): entry i = (slot << 16) | tile within the slot for the i-th non-empty tile, slots in order, -1 past
the last, so a program costs one load to find its work, or to learn it has none; tile_counts holds, per
map, how many of its tiles belong to adapters (they come first) and how many it has in all; each page block's
meta has its own counts, and where no adapter of the step has weights in the block its adapters' count is 0,
so that the kernels skip the LoRA work of its layers (an overwriting expand then writes zeros). The kernels'
grids are sized by the step's tokens and L, never by the pool. The metadata is built on the host
(loraserve.lora.metadata.LoRAMetaBuilder). The split-K shrink also needs tile counters: a static int32
buffer, zero between launches, with which the programs of one output tile elect the last of them to add
up their partial sums (lora_shrink).
"""
from dataclasses import dataclass

import torch

PAGE_RANK = 8  # rank rows per pool page: a rank-8 adapter takes one page, rank 64 eight
TILE_BLOCKS = (16, 32, 64)  # the token-tile sizes (BLOCK_M) the LoRA kernels use: one tile map each
# The tile counters cover every grid a shrink can launch with at most max_tokens tokens,
# token tiles of at least COUNTER_BLOCK_M tokens and at most COUNTER_ROW_TILES row tiles.
COUNTER_BLOCK_M = 16
COUNTER_ROW_TILES = 32


@dataclass
class LoRAMeta:
    """Device views of one step's LoRA metadata (only the first T tokens matter) and the pool's page table.

    token_slots:      [Tmax] int32, slot of each token, -1 = no adapter
    sorted_token_ids: [Tmax] int32, token ids grouped by slot (stable order), the base tokens last
    slot_start:       [L+1] int32, where slot l's tokens begin in sorted_token_ids (slot L: the base tokens)
    slot_count:       [L+1] int32, how many tokens use slot l
    slot_adapter:     [L+1] int32, the adapter id in slot l (-1: unused, and slot L)
    tile_maps:        per TILE_BLOCKS entry, [cdiv(Tmax, BLOCK_M) + min(L, Tmax) + 1] int32: the tile map
    tile_counts:      [len(TILE_BLOCKS), 2] int32, per tile map: (tiles of adapters' tokens, all tiles); the
                      first is 0 when no adapter of the step has weights in this meta's page block
    page_table:       [A, max_pages] int32, the pool page of each adapter id's rank rows (PAGE_RANK per page)
    tile_counters:    [token tiles, COUNTER_ROW_TILES] int32, zero between shrink launches; a
                      split-K shrink counts its finished programs per (token tile, row tile) here
                      and its last program puts the count back to 0. Launches that share these
                      counters must run one after another (stream-ordered, as the engine's are).
    slot_columns:     [L+1] int32, where slot l's rank rows begin when the step's adapters lie side by side
                      (each as wide as its largest rank; entry k.. of the k slots: their total), for the
                      products as extra columns of the base GEMM (lora_columns); None where not built
    """

    token_slots: torch.Tensor
    sorted_token_ids: torch.Tensor
    slot_start: torch.Tensor
    slot_count: torch.Tensor
    slot_adapter: torch.Tensor
    tile_maps: tuple[torch.Tensor, ...]
    tile_counts: torch.Tensor
    page_table: torch.Tensor
    tile_counters: torch.Tensor
    slot_columns: torch.Tensor | None = None

    @property
    def rank_width(self) -> int:
        """R: the rank rows per slice of the LoRA intermediate [T, S*R] (every rank the page table can hold)."""
        return self.page_table.shape[1] * PAGE_RANK

    @property
    def num_loras(self) -> int:
        """L: the slots of a step (the base group excluded)."""
        return self.slot_count.shape[0] - 1

    def tile_map(self, block_m: int) -> torch.Tensor:
        """The tile map of BLOCK_M-token tiles."""
        return self.tile_maps[TILE_BLOCKS.index(block_m)]

    def tile_count(self, block_m: int) -> torch.Tensor:
        """[2] int32: the tile map's tiles of adapters' tokens (its first entries) and all its tiles."""
        return self.tile_counts[TILE_BLOCKS.index(block_m)]

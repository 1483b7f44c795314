"""The LoRA kernels' per-step metadata: which slot each token uses, and the tokens grouped by slot.

The LoRA kernels group tokens by adapter slot through a sorted index array
with a start and a count per slot (built on the host by
loraserve.lora.metadata.LoRAMetaBuilder). The split-K shrink also needs tile
counters: a static int32 buffer, zero between launches, with which the
programs of one output tile elect the last of them to add up their partial
sums (lora_shrink).
"""
from dataclasses import dataclass

import torch

# The tile counters cover every grid a shrink can launch with at most max_tokens tokens,
# token tiles of at least COUNTER_BLOCK_M tokens and at most COUNTER_ROW_TILES row tiles.
COUNTER_BLOCK_M = 16
COUNTER_ROW_TILES = 32


@dataclass
class LoRAMeta:
    """Device views of one step's LoRA metadata (only the first T tokens matter).

    token_slots:      [Tmax] int32, slot of each token, -1 = no adapter
    sorted_token_ids: [Tmax] int32, token ids grouped by slot (stable order)
    slot_start:       [L] int32, where slot l's tokens begin in sorted_token_ids
    slot_count:       [L] int32, how many tokens use slot l
    tile_counters:    [token tiles, COUNTER_ROW_TILES] int32, zero between shrink launches; a
                      split-K shrink counts its finished programs per (token tile, row tile) here
                      and its last program puts the count back to 0. Launches that share these
                      counters must run one after another (stream-ordered, as the engine's are).
    """

    token_slots: torch.Tensor
    sorted_token_ids: torch.Tensor
    slot_start: torch.Tensor
    slot_count: torch.Tensor
    tile_counters: torch.Tensor

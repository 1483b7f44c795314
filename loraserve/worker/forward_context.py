"""What one forward pass needs besides token ids and positions, passed explicitly down the model."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraserve.kernels.lora_meta import LoRAMeta
    from loraserve.kernels.lora_ops import LoRAScratch


@dataclass
class AttentionMetadata:
    """Paged-attention inputs of a step; S sequences, T tokens in all."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [S, MB] int32: the KV blocks of each sequence
    seq_lens: torch.Tensor  # [S] int32: context length after this step (0 = padding row)
    query_start_loc: torch.Tensor  # [S+1] int32: first query row of each sequence
    max_query_len: int
    is_decode: bool  # every sequence has exactly one new token (T == S)


@dataclass
class LoRASideStream:
    """Where decode-sized LoRA products run beside the base projections (lora/layers.py): on `stream`,
    forked from and joined back to `main` (the stream this forward pass is issued on), into `scratch`.

    `main` is None until lora_side_for_this_pass gives a forward pass its own copy."""

    stream: torch.cuda.Stream
    scratch: "LoRAScratch"
    main: torch.cuda.Stream | None = None


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    lora: "LoRAMeta | None" = None  # None: no LoRA kernels in this (eager) step
    lora_side: LoRASideStream | None = None  # None: LoRA products in place, in order


def lora_side_for_this_pass(side: LoRASideStream | None) -> LoRASideStream | None:
    """`side` joined back to the current stream (the one a forward pass is about to be issued on), or None.

    Called once per forward pass: looking the current stream up costs ~8 us, too much for every layer."""
    return None if side is None else replace(side, main=torch.cuda.current_stream(side.stream.device))

"""What one forward pass needs besides token ids and positions, passed explicitly down the model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraserve.kernels.lora_meta import LoRAMeta


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
class ForwardContext:
    attn: AttentionMetadata
    lora: "LoRAMeta | None" = None  # None: no LoRA kernels in this (eager) step
    # CUDA stream on which decode-sized LoRA products run beside the base projections; None: in place, in order
    lora_stream: torch.cuda.Stream | None = None

"""What one forward pass needs besides token ids and positions, passed explicitly down the model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Paged-attention inputs of a step; S sequences, T tokens in all."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [S, MB] int32: the KV blocks of each sequence
    seq_lens: torch.Tensor  # [S] int32: context length after this step (0 = padding row)
    query_start_loc: torch.Tensor  # [S+1] int32: first query row of each sequence
    max_query_len: int
    is_decode: bool  # every sequence has exactly one new token (T == S)
    # the leading sequences with one new token each (rows 0..D-1): in a step that also prefills, the decode
    # kernel serves them and the prefill kernel the rest
    num_decode_rows: int = 0
    # set while a graph of a step that prefills is captured (worker/mixed_graphs.py): each attention layer
    # hands its attention to it, after rotary and the KV write, and uses what it returns
    split: Any = None


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    # The LoRA runtime's state for this pass (a loraserve.lora.runtime.LoRABatch: the step's token -> adapter
    # metadata and where the LoRA products run), read by the LoRA layers only; the model passes it along.
    # None: no LoRA kernels in this pass.
    lora: Any = None

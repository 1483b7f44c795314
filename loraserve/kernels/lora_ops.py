"""LoRA delta of a packed linear layer: y += expand(shrink(x)), per token's adapter slot.

`lora_apply` runs the Triton kernels on CUDA tensors (and on CPU tensors under
TRITON_INTERPRET=1), otherwise the torch reference. The kernel shape is chosen
by the static token count T alone, so a CUDA graph bucket always gets the same
kernels: the shrink is decode-shaped (16-token tiles, K split up to 16 ways so
that the few adapters' A rows are streamed by many programs) for
T <= SHRINK_DECODE_MAX_TOKENS (256), the expand (16-token tiles) for
T <= EXPAND_DECODE_MAX_TOKENS (64); larger T take the prefill shapes (larger
tiles, little split; from T = 1024 each expand program walks 4 column tiles).
Nothing here reads metadata on the host, syncs or allocates beyond the
[P, T, S*R] float32 split-K partials (summed by the expand, so a layer costs two
launches), so `lora_apply` can be captured in a CUDA graph.
"""
import os

import torch

from loraserve.kernels.lora_expand import EXPAND_DECODE_MAX_TOKENS, lora_expand
from loraserve.kernels.lora_meta import LoRAMeta
from loraserve.kernels.lora_reference import lora_expand_ref, lora_shrink_ref
from loraserve.kernels.lora_shrink import SHRINK_DECODE_MAX_TOKENS, lora_shrink, shrink_splits

__all__ = ["EXPAND_DECODE_MAX_TOKENS", "SHRINK_DECODE_MAX_TOKENS", "lora_apply",
           "lora_apply_ref"]


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def lora_apply(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               slot_rank: torch.Tensor, meta: LoRAMeta, slice_offsets: tuple[int, ...]) -> None:
    """y: [T, N] += LoRA(x: [T, in]) per token's slot; lora_a: [L, S*R, in], lora_b: [L, N, R]."""
    if not _use_triton(x):
        lora_apply_ref(x, y, lora_a, lora_b, slot_rank, meta, slice_offsets)
        return
    num_slices = len(slice_offsets) - 1
    num_tokens, sr = x.shape[0], lora_a.shape[1]
    # inter: [P, T, S*R] split-K partials, summed by the expand: two launches per layer
    inter = torch.empty(shrink_splits(num_tokens, x.shape[1], sr), num_tokens, sr, dtype=torch.float32,
                        device=x.device)
    lora_shrink(x, lora_a, slot_rank, meta, num_slices, inter)
    lora_expand(inter, lora_b, slot_rank, meta, slice_offsets, y)


def lora_apply_ref(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   slot_rank: torch.Tensor, meta: LoRAMeta, slice_offsets: tuple[int, ...]) -> None:
    """Same as lora_apply through the plain-torch reference (host sync; not for graphs)."""
    num_slices = len(slice_offsets) - 1
    if num_slices < 1:
        raise ValueError(f"slice_offsets {tuple(slice_offsets)} name no slice")
    inter = lora_shrink_ref(x, lora_a, slot_rank, meta.token_slots, num_slices)
    lora_expand_ref(inter, lora_b, slot_rank, meta.token_slots, slice_offsets, y)

"""LoRA product of a packed linear layer: y += expand(shrink(x)), per token's adapter slot.

`lora_apply` runs the Triton kernels on CUDA tensors (and on CPU tensors under
TRITON_INTERPRET=1), otherwise the torch reference. The kernel shape is chosen
by the static token count T alone (and the layer's static sizes), so a CUDA
graph bucket always gets the same kernels: the shrink is decode-shaped
(16-token tiles, K split up to 16 ways so that the few adapters' A rows are
streamed by many programs) for T <= SHRINK_DECODE_MAX_TOKENS (256), the expand
takes 16-token tiles for T <= EXPAND_SMALL_TILE_TOKENS (256); larger T take the
prefill shapes (larger tiles, little split; from T = 1024 the expand takes
16-token tiles and each program walks 8 column tiles). In the decode shapes the
kernels spread a step of many adapters over the grid at run time (the shrink
splits K less, each expand program takes more columns). The shrink adds up its
own split-K partials (the last program of each output tile, counted on
meta.tile_counters), so the expand reads one [T, S*R] float32 intermediate and
a layer costs two launches.
`lora_factors` runs the shrink alone and leaves the expand to the op that
consumes the layer's output (kernels/fused.py), which expands it as it reads.
Nothing here reads metadata on the host, syncs or allocates beyond that
intermediate and the shrink's partials scratch (static shapes), so `lora_apply`
can be captured in a CUDA graph; calls sharing one meta must be stream-ordered.
"""
import os
from typing import Callable

import torch

from loraserve.kernels.lora_expand import LoRAFactors, lora_expand
from loraserve.kernels.lora_meta import LoRAMeta
from loraserve.kernels.lora_reference import lora_expand_ref, lora_shrink_ref
from loraserve.kernels.lora_shrink import lora_shrink


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def lora_apply(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               lora_rank: torch.Tensor, meta: LoRAMeta, slice_offsets: tuple[int, ...],
               reduce: Callable[[torch.Tensor], object] | None = None) -> None:
    """y: [T, N] += LoRA(x: [T, in]) per token's adapter; pool pages lora_a: [P, S*PAGE_RANK, in],
    lora_b: [P, PAGE_RANK, N]; lora_rank: [A] (kernels/lora_meta.py).

    y has the weights' dtype (or is float32). The product is rounded to y's dtype before it is added
    (PEFT's rounding). `reduce`, when given, runs in place on the shrink's output [T, S*R] before the expand
    (tensor parallel: the all-reduce of a row-parallel layer's partial sums).
    """
    if not _use_triton(x):
        lora_apply_ref(x, y, lora_a, lora_b, lora_rank, meta, slice_offsets, reduce)
        return
    factors = lora_factors(x, lora_a, lora_b, lora_rank, meta, slice_offsets)
    if reduce is not None:
        reduce(factors.inter)
    lora_expand(factors.inter, lora_b, lora_rank, meta, slice_offsets, y, after_shrink=reduce is None)


def lora_factors(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, lora_rank: torch.Tensor,
                 meta: LoRAMeta, slice_offsets: tuple[int, ...], max_rank: int | None = None) -> LoRAFactors:
    """The LoRA product of x: [T, in] as factors (the shrink run, the expand left to the op that consumes
    the layer's output): as lora_apply, Triton kernels only. max_rank: LoRAFactors.max_rank."""
    num_slices = len(slice_offsets) - 1
    # inter: [T, S*R] float32, the shrink's split-K partials already summed
    inter = torch.empty(x.shape[0], num_slices * meta.rank_width, dtype=torch.float32, device=x.device)
    lora_shrink(x, lora_a, lora_rank, meta, num_slices, inter)
    return LoRAFactors(inter, lora_b, lora_rank, meta, tuple(slice_offsets), max_rank)


def lora_apply_ref(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   lora_rank: torch.Tensor, meta: LoRAMeta, slice_offsets: tuple[int, ...],
                   reduce: Callable[[torch.Tensor], object] | None = None) -> None:
    """Same as lora_apply through the plain-torch reference (host sync; not for graphs)."""
    num_slices = len(slice_offsets) - 1
    if num_slices < 1:
        raise ValueError(f"slice_offsets {tuple(slice_offsets)} name no slice")
    inter = lora_shrink_ref(x, lora_a, lora_rank, meta, num_slices)
    if reduce is not None:
        reduce(inter)
    lora_expand_ref(inter, lora_b, lora_rank, meta, slice_offsets, y)

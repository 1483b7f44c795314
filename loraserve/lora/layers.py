"""LoRA-aware linear layer: a wrapper around a base (packed) linear that reads its adapters from the pool.

Its storage is a set of views of the adapter pool (lora/pool.py), bound once; addresses never change (so
CUDA graphs read whatever the pool holds at replay):
  lora_a:    [P, S*PAGE_RANK, in]  per page, PAGE_RANK rank rows of each slice's A
  lora_b:    [P, PAGE_RANK, N]     per page, PAGE_RANK rank rows of B^T (scaling folded in)
  lora_rank: [A] int32             each adapter id's rank in this layer (0 = not targeted)
with S slices (q/k/v: 3, gate/up: 2, o/down: 1); the page table (the columns of the layer's page block)
is in the step's metadata, `LoRABatch.metas[page_block]`. Only the
adapter pool writes them.

Forward, with the pass's LoRA state in ctx.lora (a LoRABatch; None: the base
layer alone): with a side stream and at most its scratch's max_tokens tokens
(decode steps and their CUDA graphs), the LoRA product runs on the side stream
into a delta that the next op adds (models.linear.LinearOutput) while the base
GEMM runs on the forward's stream; the two join before the next op. The q/k/v
layer issues its GEMM first, the others their LoRA kernels first
(GEMM_FIRST_LAYERS). In larger (prefill) steps on one GPU, where the step's
adapters fit GEMM_COLUMNS extra columns, the product is summed inside the base
GEMM: the op before the layer leaves room after x (`input_columns`), the shrink's
output goes there and the adapters' B beside W (kernels/lora_columns.py), and one
GEMM computes [x | z] @ [W | B]^T, rounded once. Otherwise in larger steps the
layers of FACTORED_LAYERS pass the product on as factors, expanded by the next op
as it reads the base output; the others, and every layer on the CPU, add the
product into the base output in place, in order. All give the same numbers up to
rounding: the in-place and delta paths round(y + round(product)), the factored
product the same up to the order of its sums, the extra columns the whole sum
rounded once (z rounded to the model's dtype first, as PEFT computes it).

With tensor parallelism the pool holds this rank's part of each adapter (split
as the base layer's weight: `LinearBase.lora_shard`); over a row-parallel base
layer the shrink's partial sums are all-reduced before the expand (`reduce`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.forward_context import ForwardContext
from loraserve.kernels.lora_columns import padded_columns, place_b, place_factors
from loraserve.kernels.lora_meta import LoRAMeta
from loraserve.kernels.lora_ops import lora_apply, lora_apply_ref, lora_factors
from loraserve.lora.side_stream import BoundLoRADelta, LoRAScratch, LoRASideStream, lora_delta
from loraserve.models.linear import LinearBase, LinearOutput

# Packed layers whose base GEMM is issued before the side-stream LoRA kernels (the others: after them).
# The order of issue decides which branch a CUDA graph starts first. Measured on an H200 with synthetic
# Llama-3-8B, 8 adapters at batch 32 (docs/experiments.md): issued first, the q/k/v GEMM starts at once
# and its LoRA kernels still end beside it; the o, gate/up and down GEMMs, issued first, hold their LoRA
# kernels back past their own end (issued second, they start 1-4 us late).
GEMM_FIRST_LAYERS = frozenset({"qkv_proj"})
# Packed layers whose output's consumer expands LoRA factors (models.linear.LinearOutput): in steps larger than
# the side stream takes, they run the shrink only and pass its output on; the expand happens as the consumer
# reads the base output (gate/up: silu_and_mul), instead of a read-modify-write of the whole output.
FACTORED_LAYERS = frozenset({"gate_up_proj"})
# The most extra input columns a layer's GEMM takes for its step's adapters in larger steps (the sum of their
# largest ranks times the layer's slices, rounded up to lora_columns.COLUMN_ALIGN): 8 adapters of rank 16 on
# q/k/v take 384. Each layer keeps W with up to this many columns of room beside it (the runtime gives less
# where max_loras adapters of max_lora_rank need less): 1.4 GB for Llama-3-8B in bf16 at 512. Steps whose
# adapters need more run the product as below.
GEMM_COLUMNS = 512


class LoRALinear(nn.Module):
    def __init__(self, base: LinearBase, slice_names: tuple[str, ...], gemm_first: bool = False,
                 factored: bool = False):
        super().__init__()
        self.base = base
        self.slice_names = slice_names
        self.gemm_first = gemm_first  # beside the GEMM: issue the GEMM before the LoRA kernels (GEMM_FIRST_LAYERS)
        self.factored = factored  # larger CUDA steps: return the product as factors (FACTORED_LAYERS)
        # tensor parallel, row-parallel base: the all-reduce of the shrink's partial sums before the expand
        self.reduce = base.lora_reduce
        self.slice_offsets: tuple[int, ...] = getattr(base, "slice_offsets", (0, base.out_features))
        if len(self.slice_offsets) != len(slice_names) + 1:
            raise ValueError(f"{len(slice_names)} LoRA slices for a layer with {len(self.slice_offsets) - 1}")
        self.lora_a: torch.Tensor | None = None
        self.lora_b: torch.Tensor | None = None
        self.lora_rank: torch.Tensor | None = None
        self.rank_width = 0  # R: rank rows per slice of the LoRA intermediate
        self.page_block = 0  # the pool's page block holding this layer (its LoRAMeta in LoRABatch.metas)
        # the side stream's fork and join, reused every step (wait_stream made a new event per call: ~70 us in a
        # capture)
        self._fork: torch.cuda.Event | None = None
        self._join: torch.cuda.Event | None = None
        # the side-stream launches of this layer by token count (one BoundLoRADelta per kernel shape)
        self._bound: dict[int, BoundLoRADelta] = {}
        # larger steps: W with columns of room for the step's B beside it ([N, K + room], the base layer's weight
        # a view of its first K columns: enable_columns), and slice_offsets on the device; None: unused
        self.w_columns: torch.Tensor | None = None
        self._offsets_dev: torch.Tensor | None = None
        self._placed: tuple | None = None  # the LoRABatch.columns_key whose B w_columns holds

    def bind_pool(self, lora_a: torch.Tensor, lora_b: torch.Tensor, lora_rank: torch.Tensor, rank_width: int,
                  page_block: int) -> None:
        """Read adapters from these views of the pool, through page block `page_block`'s columns of the page
        table (once, before any forward pass with LoRA)."""
        self.lora_a, self.lora_b, self.lora_rank, self.rank_width = lora_a, lora_b, lora_rank, rank_width
        self.page_block = page_block

    def enable_columns(self, max_columns: int = GEMM_COLUMNS) -> None:
        """Give the base weight room for `max_columns` extra input columns (the runtime does on one GPU): larger
        steps then sum their LoRA products inside the base GEMM where the step's adapters fit (`input_columns`)."""
        weight = self.base.weight  # [N, K]
        w_columns = torch.zeros(weight.shape[0], weight.shape[1] + max_columns, dtype=weight.dtype,
                                device=weight.device)  # [N, K + max_columns]
        w_columns[:, :weight.shape[1]].copy_(weight)
        self.base.weight = nn.Parameter(w_columns[:, :weight.shape[1]], requires_grad=False)
        self.w_columns = w_columns
        self._offsets_dev = torch.tensor(self.slice_offsets, dtype=torch.int32, device=weight.device)

    def input_columns(self, ctx: ForwardContext | None, num_tokens: int) -> int:
        """C: the extra columns this layer's input of num_tokens rows should have after in_features in this pass
        (the op before it allocates them), where its step's LoRA products go; 0: none."""
        lora = ctx.lora if ctx is not None else None
        if self.w_columns is None or lora is None or not lora.step_columns or not self._in_order(lora, num_tokens):
            return 0
        if lora.active is not None and not lora.active[self.page_block]:
            return 0
        extra = padded_columns(len(self.slice_names), lora.step_columns)
        return extra if extra <= self.w_columns.shape[1] - self.in_features else 0

    @staticmethod
    def _in_order(lora, num_tokens: int) -> bool:
        """Whether a pass of num_tokens runs the product in order on the forward's stream (not beside the GEMM)."""
        side = lora.side
        return side is None or not 0 < num_tokens <= side.scratch.max_tokens

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def lora_rows(self) -> int:
        """S*R: the width of the shrink's output."""
        return len(self.slice_names) * self.rank_width

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> LinearOutput:
        # x: [T, in] -> y: [T, N] and, beside the GEMM, its LoRA delta [T, N]
        lora = ctx.lora if ctx is not None else None
        if lora is None or (lora.active is not None and not lora.active[self.page_block]):
            return self.base(x)  # no LoRA, or no adapter of the step has weights in this layer's page block
        side, meta = lora.side, lora.metas[self.page_block]
        if self._in_order(lora, x.shape[0]):
            extra = self.input_columns(ctx, x.shape[0])
            if extra and x.stride(0) == self.in_features + extra:  # room left after x by the op before
                return self._forward_columns(x, lora, meta, extra)
            y = self.base(x).rounded(x.dtype)
            if self.factored and x.is_cuda:
                factors = lora_factors(x, self.lora_a, self.lora_b, self.lora_rank, meta, self.slice_offsets,
                                       lora.step_rank)
                if self.reduce is not None:
                    self.reduce(factors.inter)
                return LinearOutput(y, factors)
            apply = lora_apply if x.is_cuda else lora_apply_ref  # the CPU path is the torch reference
            apply(x, y, self.lora_a, self.lora_b, self.lora_rank, meta, self.slice_offsets, self.reduce)
            return LinearOutput(y, None)
        return self._forward_beside(x, meta, side)

    def _forward_columns(self, x: torch.Tensor, lora, meta: LoRAMeta, extra: int) -> LinearOutput:
        # x: [T, K] with `extra` columns of room after each row -> y: [T, N], the product summed in the GEMM
        k = self.in_features
        x_aug = x.as_strided((x.shape[0], k + extra), (k + extra, 1))  # [T, K + C]
        factors = lora_factors(x, self.lora_a, self.lora_b, self.lora_rank, meta, self.slice_offsets)
        place_factors(factors.inter, meta, self.lora_rank, lora.step_columns, x_aug, k)
        if not lora.columns_key or lora.columns_key != self._placed:  # the step's B not beside W yet
            place_b(self.lora_b, meta, self.lora_rank, self._offsets_dev, lora.num_slots, lora.step_columns,
                    self.w_columns, k)
            self._placed = lora.columns_key
        return LinearOutput(F.linear(x_aug, self.w_columns[:, :k + extra], self.base.bias), None)

    def _forward_beside(self, x: torch.Tensor, meta: LoRAMeta, side: LoRASideStream) -> LinearOutput:
        # x: [T, in] -> y: [T, N], delta: [T, N] a view of the side stream's scratch, valid until the next layer's
        if self._fork is None:
            self._fork, self._join = torch.cuda.Event(), torch.cuda.Event()
        self._fork.record(side.main)  # x, the metadata and the adapter weights are ready
        if self.gemm_first:  # y: a row-parallel layer's fp32 sum stays unrounded (its norm rounds it: LinearOutput)
            y = self.base(x).y
            delta = self._launch_on_side(x, meta, side)
        else:
            delta = self._launch_on_side(x, meta, side)
            y = self.base(x).y
        self._join.record(side.stream)
        side.main.wait_event(self._join)
        return LinearOutput(y, delta)

    def _launch_on_side(self, x: torch.Tensor, meta: LoRAMeta, side: LoRASideStream) -> torch.Tensor:
        """The LoRA product of x on the side stream, after the fork; returns the delta."""
        side.stream.wait_event(self._fork)
        bound = self._bound.get(x.shape[0])
        if bound is not None and bound.serves(meta, side.scratch):  # every later step of this token count
            return bound(x, side.stream)
        torch.cuda.set_stream(side.stream)
        try:
            return self._launch_and_bind(x, meta, side.scratch)
        finally:
            torch.cuda.set_stream(side.main)

    def _launch_and_bind(self, x: torch.Tensor, meta: LoRAMeta, scratch: LoRAScratch) -> torch.Tensor:
        """Launch the LoRA product of x into the scratch's delta (on the current stream) through a bound
        launch of its kernel shape, made here if none fits, and keep it for x's token count; returns the delta."""
        bound = next((b for b in self._bound.values() if b.fits(x, meta, scratch)), None)
        if bound is None:  # a new kernel shape (or new buffers): launched and bound by the kernels' wrappers
            delta, bound = lora_delta(x, scratch, self.lora_a, self.lora_b, self.lora_rank, meta, self.slice_offsets,
                                      self.reduce)
        else:
            delta = bound(x)
        self._bound[x.shape[0]] = bound
        return delta


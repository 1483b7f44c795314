"""Column- and row-parallel linear layers: each rank of a tensor-parallel group (loraserve.distributed) holds
its part of the weight.

A column-parallel layer keeps its rank's part of every output slice (no
communication: its output stays split, the next layer consumes it so); a
row-parallel layer keeps its rank's part of the input features and sums the
ranks' partial outputs with one all-reduce. Each layer has a
`weight_loader(param, loaded, shard)` that copies its rank's part of one
checkpoint tensor into its place: a packed layer (q/k/v, gate/up) holds several
checkpoint tensors as consecutive output ranges (slices), `shard` being the
slice's index, or one checkpoint tensor holding them all (`shard` None: Phi-3's
qkv_proj and gate_up_proj). The same rule splits a LoRA adapter's factors (`lora_shard`):
for a column layer A is whole and B split by output, for a row layer A split by
input and B whole (the shrink's partial sums are all-reduced before the expand,
`lora_reduce`).

`forward(x, ctx=None)` returns a LinearOutput: base layers ignore the forward
context and return no delta; the LoRA wrapper (loraserve.lora.layers.LoRALinear)
uses the context's LoRA state.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.distributed import NO_PARALLEL, ParallelGroup
from loraserve.kernels.lora_expand import LoRAFactors
from loraserve.peer_all_reduce import SIDE

# A row-parallel layer in a step of up to this many tokens sums its ranks' partial outputs in float32 (each
# rank's GEMM writes its partial sum in fp32, the all-reduce adds them, and the total is rounded once, as one
# GPU's GEMM rounds its whole sum once): rounding each partial to bf16 first was seen to change greedy tokens
# at 4 ranks. At these sizes the all-reduce is latency-bound, so twice its bytes cost little; larger
# (prefill) steps, where it is bandwidth-bound, sum in the model's dtype.
FP32_REDUCE_MAX_TOKENS = 512


class LinearOutput(NamedTuple):
    """A linear layer's output `y`, and `delta`: a LoRA product of the same rows not yet added to y.

    A LoRA layer in a decode-sized CUDA step computes its product on a side
    stream while the base GEMM runs (loraserve.lora.layers). Rather than a
    kernel of its own to add it, the op that consumes y adds the delta to its
    input first (RMSNorm with its residual add, SiLU*mul, rotary + KV-cache
    write: models/ops.py), rounded to y's dtype, so the result is
    round(y + round(delta)): what adding it in place gives, and what PEFT's
    separately computed LoRA output gives. In larger (prefill) steps a layer
    whose consumer can expand it passes the product as its factors instead
    (LoRAFactors: the shrink's output and the layer's B pages; same rounding).
    None: y is complete.

    A row-parallel layer's y at decode sizes is its ranks' fp32 sum, not yet
    rounded: its consumer, the next RMSNorm with its residual add, rounds it to
    the residual's dtype first (one kernel less per such layer than rounding it
    here). Use `rounded` where y itself is needed in the model's dtype.
    """

    y: torch.Tensor  # [T, N]; at decode sizes a row-parallel layer's unrounded fp32 sum (RowParallelLinear)
    delta: torch.Tensor | LoRAFactors | None  # [T, N] in y's dtype (or float32), its factors, or None

    def rounded(self, dtype: torch.dtype) -> torch.Tensor:
        """y in `dtype` (y itself when it has that dtype already)."""
        return self.y.to(dtype)


class LinearBase(nn.Module):
    """y = x @ W^T (+ b) with W: [out_features, in_features], this rank's part of the layer."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: ParallelGroup = NO_PARALLEL):
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @property
    def lora_reduce(self):
        """The all-reduce of a LoRA shrink's partial sums before its expand (row-parallel layers of several
        ranks), or None."""
        return None

    @property
    def checkpoint_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of each checkpoint matrix the layer holds (whole, not this rank's part)."""
        raise NotImplementedError

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        raise NotImplementedError

    def lora_shard(self, a: torch.Tensor, b: torch.Tensor, shard: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s part of a LoRA adapter's factors of slice `shard`: a [r, in], b [out, r] whole."""
        raise NotImplementedError

    def input_columns(self, ctx, num_tokens: int) -> int:
        """How many columns of room the op before this layer leaves after each row of its input of num_tokens
        rows in this pass: 0 (the LoRA layer's own answer: loraserve.lora.layers.LoRALinear)."""
        return 0

    def forward(self, x: torch.Tensor, ctx=None) -> LinearOutput:
        # x: [T, in] -> y: [T, out], no delta
        return LinearOutput(F.linear(x, self.weight, self.bias), None)


def _check_shape(param_part: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param_part.shape != loaded.shape:
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param_part.shape)}")


def _split(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what} {size} is not divisible by tensor_parallel_size {parts}")
    return size // parts


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; rank r keeps rows [r*out/tp, (r+1)*out/tp)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: ParallelGroup = NO_PARALLEL):
        super().__init__(in_features, _split(out_features, tp.size, "out_features"), bias, tp)

    @property
    def checkpoint_shapes(self):
        return [(self.in_features, self.out_features * self.tp.size)]

    def output_part(self, loaded: torch.Tensor, shard: int | None, rank: int) -> torch.Tensor:
        """Rank `rank`'s rows of a whole checkpoint tensor (weight [out, in], bias [out] or LoRA B [out, r])."""
        return loaded.narrow(0, rank * self.out_features, self.out_features)

    def weight_loader(self, param, loaded, shard=None):
        part = self.output_part(loaded, shard, self.tp.rank)
        _check_shape(param.data, part, "column-parallel weight")
        param.data.copy_(part)

    def lora_shard(self, a, b, shard, rank):
        return a, self.output_part(b, shard, rank)


class PackedColumnParallelLinear(ColumnParallelLinear):
    """Several checkpoint matrices with the same input stacked along the output: gate/up, q/k/v.

    `output_sizes` are this rank's sizes of each slice (the whole sizes over tp, unless a subclass says
    otherwise); `slice_offsets` are the column ranges on this rank, used by LoRA to place each slice's
    delta. Which checkpoint module each slice holds is the model's `packed_modules` table.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp: ParallelGroup = NO_PARALLEL):
        self.output_sizes = self._rank_sizes(output_sizes, tp)
        LinearBase.__init__(self, in_features, sum(self.output_sizes), bias, tp)
        self.full_output_sizes = list(output_sizes)
        offsets = [0]
        for size in self.output_sizes:
            offsets.append(offsets[-1] + size)
        self.slice_offsets: tuple[int, ...] = tuple(offsets)

    def _rank_sizes(self, output_sizes: list[int], tp: ParallelGroup) -> list[int]:
        return [_split(s, tp.size, "output size") for s in output_sizes]

    @property
    def checkpoint_shapes(self):
        return [(self.in_features, size) for size in self.full_output_sizes]

    def slice_start(self, shard: int, rank: int) -> int:
        """Where rank `rank`'s rows of slice `shard` start in the whole checkpoint tensor of that slice."""
        return rank * self.output_sizes[shard]

    def output_part(self, loaded, shard, rank):
        if shard is None or not 0 <= shard < len(self.output_sizes):
            raise ValueError(f"unknown slice {shard!r} of a layer packing {len(self.output_sizes)}")
        return loaded.narrow(0, self.slice_start(shard, rank), self.output_sizes[shard])

    def weight_loader(self, param, loaded, shard=None):
        if shard is None:  # the checkpoint packs the slices too: load each from its rows
            full_sizes = self.full_output_sizes
            if loaded.shape[0] != sum(full_sizes):
                raise ValueError(f"packed checkpoint tensor has {loaded.shape[0]} rows, expected {sum(full_sizes)} "
                                 f"(slices of {full_sizes})")
            for i, part in enumerate(loaded.split(full_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        part = self.output_part(loaded, shard, self.tp.rank)
        dest = param.data.narrow(0, self.slice_offsets[shard], self.output_sizes[shard])
        _check_shape(dest, part, f"packed weight slice {shard}")
        dest.copy_(part)


class QKVParallelLinear(PackedColumnParallelLinear):
    """q, k and v projections packed: out = (H + 2 * KVH) * head_dim, split by heads.

    Each rank keeps H/tp query heads and KVH/tp key/value heads; with fewer KV heads than ranks, each KV head
    is kept by tp/KVH ranks (rank r keeps KV head r * KVH // tp), so every rank has the KV heads its query
    heads attend to."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp: ParallelGroup = NO_PARALLEL):
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads  # the whole model's (which ranks keep which KV head: slice_start)
        self.rank_heads, self.rank_kv_heads = qkv_heads_per_rank(num_heads, num_kv_heads, tp.size)
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, tp)

    def _rank_sizes(self, output_sizes, tp):
        return [self.rank_heads * self.head_dim, self.rank_kv_heads * self.head_dim,
                self.rank_kv_heads * self.head_dim]

    def slice_start(self, shard, rank):
        if shard == 0:
            return rank * self.output_sizes[0]
        return rank * self.num_kv_heads // self.tp.size * self.head_dim


def qkv_heads_per_rank(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) each rank of `tp_size` keeps; ValueError when the heads can't be split so."""
    if num_heads % tp_size:
        raise ValueError(f"num_attention_heads {num_heads} is not divisible by tensor_parallel_size {tp_size}")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"num_key_value_heads {num_kv_heads} and tensor_parallel_size {tp_size}: one must divide "
                         "the other")
    return num_heads // tp_size, max(1, num_kv_heads // tp_size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the ranks' partial outputs are summed by one all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: ParallelGroup = NO_PARALLEL):
        super().__init__(_split(in_features, tp.size, "in_features"), out_features, bias, tp)

    @property
    def lora_reduce(self):
        return functools.partial(self.tp.all_reduce, channel=SIDE) if self.tp.is_parallel else None

    @property
    def checkpoint_shapes(self):
        return [(self.in_features * self.tp.size, self.out_features)]

    def input_part(self, loaded: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s columns of a whole checkpoint matrix (weight [out, in] or LoRA A [r, in])."""
        return loaded.narrow(1, rank * self.in_features, self.in_features)

    def weight_loader(self, param, loaded, shard=None):
        if param.dim() == 2:
            loaded = self.input_part(loaded, self.tp.rank)
        _check_shape(param.data, loaded, "row-parallel weight")
        param.data.copy_(loaded)

    def lora_shard(self, a, b, shard, rank):
        return self.input_part(a, rank), b

    def forward(self, x: torch.Tensor, ctx=None) -> LinearOutput:
        # x: [T, in / tp] -> y: [T, out], summed over the ranks (the bias added once, after the sum); at decode
        # sizes without a bias y is the fp32 sum, left for the next norm to round (LinearOutput)
        if not self.tp.is_parallel:
            return LinearOutput(F.linear(x, self.weight, self.bias), None)
        in_fp32 = x.dtype != torch.float32 and x.shape[0] <= FP32_REDUCE_MAX_TOKENS
        y = fp32_product(x, self.weight) if in_fp32 else F.linear(x, self.weight)  # [T, out]
        self.tp.all_reduce(y)
        if self.bias is not None:
            y = y.to(x.dtype) + self.bias  # the one rounding of an fp32 sum, then the bias
        return LinearOutput(y, None)


def fp32_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T with fp32 output, unrounded: x [T, in], weight [out, in] (bf16/fp16) -> [T, out] float32.
    CUDA computes it in one GEMM with an fp32 output; the CPU has no such kernel and upcasts both."""
    if x.is_cuda:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())

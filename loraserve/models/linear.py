"""Linear layers written as column/row parallel with a tensor-parallel size of 1.

Each layer has a `weight_loader(param, loaded, shard)` that copies one
checkpoint tensor into its place: a packed layer (q/k/v, gate/up) holds several
checkpoint tensors as consecutive output ranges (slices), `shard` being the
slice's index, or one checkpoint tensor holding them all (`shard` None: Phi-3's
qkv_proj and gate_up_proj). With tp_size > 1 each rank would keep its own slice of the
output (column) or input (row) dimension; the loaders already take that slice,
so sharding is a small step later.

`forward(x, ctx=None)` returns a LinearOutput: base layers ignore the forward
context and return no delta; the LoRA wrapper (loraserve.lora.layers.LoRALinear)
uses the context's LoRA state.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.kernels.lora_expand import LoRAFactors


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
    """

    y: torch.Tensor  # [T, N]
    delta: torch.Tensor | LoRAFactors | None  # [T, N] in y's dtype (or float32), its factors, or None


class LinearBase(nn.Module):
    """y = x @ W^T (+ b) with W: [out_features, in_features] on this rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, ctx=None) -> LinearOutput:
        # x: [T, in] -> y: [T, out], no delta
        return LinearOutput(F.linear(x, self.weight, self.bias), None)


def _check_shape(param_part: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param_part.shape != loaded.shape:
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param_part.shape)}")


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; this rank keeps rows [rank*out/tp, (rank+1)*out/tp)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        if out_features % tp_size:
            raise ValueError(f"out_features {out_features} not divisible by tp_size {tp_size}")
        super().__init__(in_features, out_features // tp_size, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard=None):
        size = param.shape[0]
        part = loaded.narrow(0, self.tp_rank * size, size)
        _check_shape(param.data, part, "column-parallel weight")
        param.data.copy_(part)


class PackedColumnParallelLinear(ColumnParallelLinear):
    """Several checkpoint matrices with the same input stacked along the output: gate/up, q/k/v.

    `output_sizes` are the full (unsharded) sizes of each slice; `slice_offsets`
    are the column ranges on this rank, used by LoRA to place each slice's delta.
    Which checkpoint module each slice holds is the model's `packed_modules` table.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        self.output_sizes = [s // tp_size for s in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias, tp_rank, tp_size)
        offsets = [0]
        for size in self.output_sizes:
            offsets.append(offsets[-1] + size)
        self.slice_offsets: tuple[int, ...] = tuple(offsets)

    def weight_loader(self, param, loaded, shard=None):
        if shard is None:  # the checkpoint packs the slices too: load each from its rows
            full_sizes = [size * self.tp_size for size in self.output_sizes]
            if loaded.shape[0] != sum(full_sizes):
                raise ValueError(f"packed checkpoint tensor has {loaded.shape[0]} rows, expected {sum(full_sizes)} "
                                 f"(slices of {full_sizes})")
            for i, part in enumerate(loaded.split(full_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        if not 0 <= shard < len(self.output_sizes):
            raise ValueError(f"unknown slice {shard!r} of a layer packing {len(self.output_sizes)}")
        start, size = self.slice_offsets[shard], self.output_sizes[shard]
        part = loaded.narrow(0, self.tp_rank * size, size)
        dest = param.data.narrow(0, start, size)
        _check_shape(dest, part, f"packed weight slice {shard}")
        dest.copy_(part)


class QKVParallelLinear(PackedColumnParallelLinear):
    """q, k and v projections packed: out = (H + 2 * KVH) * head_dim."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        self.head_dim = head_dim
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, tp_rank, tp_size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; outputs would be summed (all-reduce) when tp_size > 1."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        if in_features % tp_size:
            raise ValueError(f"in_features {in_features} not divisible by tp_size {tp_size}")
        super().__init__(in_features // tp_size, out_features, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard=None):
        if param.dim() == 2:
            size = param.shape[1]
            loaded = loaded.narrow(1, self.tp_rank * size, size)
        _check_shape(param.data, loaded, "row-parallel weight")
        param.data.copy_(loaded)

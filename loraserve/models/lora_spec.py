"""What a model offers LoRA: the linear layers an adapter may target, and their shapes by checkpoint name.

A model class names its packed layers in one table, `packed_modules` (packed
module -> the checkpoint modules of its output slices, in order), which the
weight loader and LoRA both read; `lora_targets()` lists its LoRA-able linear
layers and `lora_spec()` their shapes by the module names its PEFT adapters
use. Where the checkpoint itself keeps a packed layer as one module (Phi-3's
qkv_proj and gate_up_proj: `checkpoint_packed`), its adapters name that module:
one A for every slice and a B whose rows are the slices' outputs in order, which
`LoRAModelSpec.split` cuts into the slices' own (A, B) pairs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class LoRAModelSpec:
    """What the served model offers to LoRA: per target module name its (in_features, out_features)."""

    num_layers: int
    modules: dict[str, tuple[int, int]]  # adapter module name -> (in, out), e.g. "q_proj": (D, H*hd)
    model_name: str | None = None  # for the base_model_name_or_path warning
    # adapter modules that hold several slices of a LoRA layer -> ((slice module, its output rows), ...)
    packed: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)

    def split(self, module: str, a: torch.Tensor, b: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """An adapter module's (A [r, in], B [out, r]) as (slice module, A, B rows) per slice of the LoRA layer:
        itself unless it is packed, else every slice shares A and takes its own rows of B."""
        if module not in self.packed:
            return [(module, a, b)]
        names, rows = zip(*self.packed[module])
        return [(name, a, part) for name, part in zip(names, b.split(list(rows), dim=0))]


@dataclass(frozen=True)
class LoRATarget:
    """One linear layer LoRA may wrap: `parent.<attr>` in decoder layer `layer_index`, holding the
    checkpoint modules `slices` as consecutive output ranges."""

    layer_index: int
    parent: nn.Module
    attr: str  # e.g. "qkv_proj"
    slices: tuple[str, ...]  # e.g. ("q_proj", "k_proj", "v_proj")

    @property
    def linear(self) -> nn.Module:
        """The layer there now: the base linear, or the LoRA wrapper around it."""
        return getattr(self.parent, self.attr)


def spec_of_targets(targets: list[LoRATarget], num_layers: int,
                    checkpoint_packed: frozenset[str] = frozenset()) -> LoRAModelSpec:
    """(in, out) per adapter module name, read off the base layers (their whole checkpoint shapes, also where a
    rank of a tensor-parallel group holds part of them); the layers whose attr is in `checkpoint_packed` are one
    module to adapters."""
    modules: dict[str, tuple[int, int]] = {}
    packed: dict[str, tuple[tuple[str, int], ...]] = {}
    for target in targets:
        shapes = target.linear.checkpoint_shapes  # [(in, out)] per slice
        if target.attr in checkpoint_packed:
            modules[target.attr] = (shapes[0][0], sum(out for _, out in shapes))
            packed[target.attr] = tuple((name, out) for name, (_, out) in zip(target.slices, shapes))
            continue
        for name, shape in zip(target.slices, shapes):
            modules[name] = shape
    return LoRAModelSpec(num_layers=num_layers, modules=modules, packed=packed)

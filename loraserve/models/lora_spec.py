"""What a model offers LoRA: the linear layers an adapter may target, and their shapes by checkpoint name.

A model class names its packed layers in one table, `packed_modules` (packed
module -> the checkpoint modules of its output slices, in order), which the
weight loader and LoRA both read; `lora_targets()` lists its LoRA-able linear
layers and `lora_spec()` their shapes by checkpoint module name.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class LoRAModelSpec:
    """What the served model offers to LoRA: per target module name its (in_features, out_features)."""

    num_layers: int
    modules: dict[str, tuple[int, int]]  # short name -> (in_features, out_features), e.g. "q_proj": (D, H*hd)
    model_name: str | None = None  # for the base_model_name_or_path warning


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


def spec_of_targets(targets: list[LoRATarget], num_layers: int) -> LoRAModelSpec:
    """(in, out) per checkpoint module name, read off the layers (a packed layer's slice offsets)."""
    modules: dict[str, tuple[int, int]] = {}
    for target in targets:
        linear = target.linear
        offsets = getattr(linear, "slice_offsets", (0, linear.out_features))
        for name, lo, hi in zip(target.slices, offsets, offsets[1:]):
            modules[name] = (linear.in_features, hi - lo)
    return LoRAModelSpec(num_layers=num_layers, modules=modules)

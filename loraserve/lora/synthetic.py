"""Random adapters for benchmarks and tests: any rank and target set, no files needed."""
from __future__ import annotations

import torch

from loraserve.lora.adapter import LoRAAdapter
from loraserve.models.lora_spec import LoRAModelSpec

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # of the Llama family


def random_adapter(spec: LoRAModelSpec, name: str, rank: int, targets: tuple[str, ...] | None = None,
                   seed: int = 0, std: float = 0.02) -> LoRAAdapter:
    """An adapter of `rank` on `targets` (default: every module the model offers LoRA, by the names its PEFT
    adapters use) in every layer, A ~ N(0, 1/in), B ~ N(0, std) (never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(spec.num_layers):
        for module in targets or tuple(spec.modules):
            fan_in, fan_out = spec.modules[module]
            a = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5  # [r, in]
            b = torch.randn(fan_out, rank, generator=gen) * std  # [out, r]
            for slice_name, slice_a, slice_b in spec.split(module, a, b):
                weights[(layer, slice_name)] = (slice_a, slice_b.contiguous())
    return LoRAAdapter(name=name, path=f"synthetic:{name}", max_rank=rank, weights=weights)

"""Elementwise model ops, each one launch on CUDA (Triton, kernels/fused.py) and plain torch on the CPU."""
from __future__ import annotations

import torch

from loraserve.kernels import fused
from loraserve.kernels.fused_reference import rms_norm_ref, rotary_and_cache_ref, silu_and_mul_ref
from loraserve.kernels.lora_expand import LoRAFactors


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             x_delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(x + residual), x + residual) or (RMSNorm(x), None); x, residual: [T, D].

    x_delta: [T, D] LoRA delta of x (float32 or x's dtype), added (rounded) before anything else."""
    if x.is_cuda:
        return fused.rms_norm(x, weight, eps, residual, x_delta)
    return rms_norm_ref(x, weight, eps, residual, x_delta)


def silu_and_mul(gate_up: torch.Tensor, delta: torch.Tensor | LoRAFactors | None = None) -> torch.Tensor:
    """[T, 2I] (+ LoRA delta [T, 2I], or on CUDA its factors) -> [T, I]: silu(gate) * up."""
    if gate_up.is_cuda:
        return fused.silu_and_mul(gate_up, delta)
    return silu_and_mul_ref(gate_up, delta)


def rotary_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
                     qkv_delta=None) -> torch.Tensor:
    """Rotary on q and k; rotated k and v written to the KV cache at slot_mapping; returns rotated q.

    qkv_delta: LoRA deltas (dq, dk, dv) shaped as q, k, v, added (rounded) first, or None."""
    if q.is_cuda:
        return fused.rotary_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, qkv_delta)
    return rotary_and_cache_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, qkv_delta)

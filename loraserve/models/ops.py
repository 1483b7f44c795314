"""Elementwise model ops, each one launch on CUDA (Triton, kernels/fused.py) and plain torch on the CPU."""
from __future__ import annotations

import torch

from loraserve.kernels import fused
from loraserve.kernels.fused_reference import (
    QKNorm,
    gelu_tanh_and_mul_ref,
    rms_norm_ref,
    rotary_and_cache_ref,
    silu_and_mul_ref,
)
from loraserve.kernels.lora_expand import LoRAFactors


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             x_delta: torch.Tensor | None = None, pre_weight: torch.Tensor | None = None,
             unit_offset: bool = False, columns: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(x + residual), x + residual) or (RMSNorm(x), None); x, residual: [T, D].

    x_delta: [T, D] LoRA delta of x (float32 or x's dtype), added (rounded) before anything else; pre_weight:
    [D] a norm of x alone before the residual add; unit_offset: Gemma's (1 + w) norms; columns (CUDA): room
    after each output row for the next LoRA layer's products (lora/layers.py: input_columns)."""
    if x.is_cuda:
        return fused.rms_norm(x, weight, eps, residual, x_delta, pre_weight, unit_offset, columns)
    assert not columns, "extra columns are a CUDA path"
    return rms_norm_ref(x, weight, eps, residual, x_delta, pre_weight, unit_offset)


def silu_and_mul(gate_up: torch.Tensor, delta: torch.Tensor | LoRAFactors | None = None,
                 columns: int = 0) -> torch.Tensor:
    """[T, 2I] (+ LoRA delta [T, 2I], or on CUDA its factors) -> [T, I]: silu(gate) * up; columns as rms_norm."""
    if gate_up.is_cuda:
        return fused.silu_and_mul(gate_up, delta, columns=columns)
    assert not columns, "extra columns are a CUDA path"
    return silu_and_mul_ref(gate_up, delta)


def gelu_tanh_and_mul(gate_up: torch.Tensor, delta: torch.Tensor | LoRAFactors | None = None,
                      columns: int = 0) -> torch.Tensor:
    """[T, 2I] (+ LoRA delta [T, 2I], or on CUDA its factors) -> [T, I]: gelu_tanh(gate) * up (Gemma); columns as
    rms_norm."""
    if gate_up.is_cuda:
        return fused.gelu_tanh_and_mul(gate_up, delta, columns)
    assert not columns, "extra columns are a CUDA path"
    return gelu_tanh_and_mul_ref(gate_up, delta)


def rotary_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
                     qkv_delta=None, qk_norm: QKNorm | None = None) -> torch.Tensor:
    """Rotary on q and k; rotated k and v written to the KV cache at slot_mapping; returns rotated q.

    qkv_delta: LoRA deltas (dq, dk, dv) shaped as q, k, v, added (rounded) first, or None; qk_norm: the
    per-head RMSNorm of q and k after the deltas, before rotary (Qwen3, Gemma 3), or None."""
    if q.is_cuda:
        return fused.rotary_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, qkv_delta,
                                      qk_norm)
    return rotary_and_cache_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, qkv_delta, qk_norm)

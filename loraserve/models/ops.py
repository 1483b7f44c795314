"""Elementwise model ops, each one launch on CUDA (Triton, kernels/fused.py) and plain torch on the CPU."""
from __future__ import annotations

import torch

from loraserve.kernels.fused_reference import rms_norm_ref, rotary_and_cache_ref, silu_and_mul_ref


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(x + residual), x + residual) or (RMSNorm(x), None); x, residual: [T, D]."""
    if x.is_cuda:
        from loraserve.kernels.fused import rms_norm as fused

        return fused(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up."""
    if gate_up.is_cuda:
        from loraserve.kernels.fused import silu_and_mul as fused

        return fused(gate_up)
    return silu_and_mul_ref(gate_up)


def rotary_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """Rotary on q and k; rotated k and v written to the KV cache at slot_mapping; returns rotated q."""
    if q.is_cuda:
        from loraserve.kernels.fused import rotary_and_cache as fused

        return fused(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    return rotary_and_cache_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)

"""GPU (marked gpu): the weight columns of the LoRA runtime (LoRALinear.enable_columns) leave no memory idle in
the allocator. Each layer's weight is replaced by a wider one; were the former weights only cached, the next
layers' wider weights would be cut out of them and the holes left could hold no KV cache, which is sized by
what the device has free (Llama-3-8B's sizes leave such holes; a smaller model's may happen to leave none)."""
import pytest
import torch

from loraserve.config import LoRAConfig
from loraserve.lora.layers import GEMM_COLUMNS
from loraserve.lora.runtime import LoRARuntime
from loraserve.models.loader import build_empty_model
from loraserve.models.synthetic import synthetic_config

pytestmark = pytest.mark.gpu


def idle_bytes() -> int:
    """Memory the caching allocator holds without a tensor in it."""
    return torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def test_weight_columns_leave_no_idle_memory():
    torch.cuda.empty_cache()
    model = build_empty_model(synthetic_config("llama-3-8b"), torch.device("cuda"), torch.bfloat16)
    idle_before = idle_bytes()
    weights_before = torch.cuda.memory_allocated()
    # 32 adapters of rank 16: every layer gets the most room, GEMM_COLUMNS columns (as with the defaults)
    runtime = LoRARuntime(model, LoRAConfig(max_loras=32, max_lora_rank=16, lora_gpu_memory=0.25),
                          max_step_tokens=2048, model_name=None)
    layers = [layer for _, layer in runtime.layers]
    assert runtime.gemm_columns and all(l.w_columns.shape[1] == l.in_features + GEMM_COLUMNS for l in layers)
    size = layers[0].w_columns.element_size()
    column_bytes = sum((l.w_columns.shape[1] - l.in_features) * l.out_features for l in layers) * size
    # what was added is the columns, the pool and small buffers; nothing of the former weights stays reserved
    assert torch.cuda.memory_allocated() - weights_before >= column_bytes
    largest_weight = max(l.w_columns.numel() for l in layers) * size
    # (measured on an H200: 46 MiB idle, the pool's and buffers' own rounding; holes would be GiBs)
    assert idle_bytes() - idle_before < largest_weight, (idle_bytes() - idle_before, largest_weight)

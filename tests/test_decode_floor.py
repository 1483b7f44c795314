"""The decode byte floor of benchmarks/bench_common.py for the architectures beyond Llama: a sliding-window layer
reads only its window's KV, and the A that a packed adapter module's slices share (Phi-3) counts once."""
import sys
from pathlib import Path

import torch

from loraserve import LLM
from loraserve.lora.synthetic import random_adapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_common as bc  # noqa: E402 (the helpers under test)


def test_kv_bytes_read_stop_at_each_layers_window(tiny_model_factory):
    llm = LLM(tiny_model_factory("gemma2", sliding_window=24), device="cpu", max_model_len=128)
    per_token = 2 * 2 * 16 * 4  # K and V of 2 KV heads of 16 fp32 values, per layer
    assert [layer.window for layer in llm.engine.runner.attn_layers] == [24, None]  # sliding, then full
    assert bc.kv_bytes_read(llm.engine, 10) == 2 * 10 * per_token
    assert bc.kv_bytes_read(llm.engine, 100) == (24 + 100) * per_token
    assert bc.kv_bytes_per_token(llm.engine) == 2 * per_token


def test_a_shared_a_counts_once(tiny_model_factory):
    llm = LLM(tiny_model_factory("phi3"), device="cpu", max_model_len=64, enable_lora=True, max_lora_rank=8)
    spec = llm.engine.lora_manager.runtime.spec
    adapter = random_adapter(spec, "p", 8)
    (d, qkv), (_, o), (_, gate_up), (i, _) = (spec.modules[m] for m in ("qkv_proj", "o_proj", "gate_up_proj",
                                                                        "down_proj"))
    per_layer = 8 * (d + qkv) + 8 * (d + o) + 8 * (d + gate_up) + 8 * (i + d)  # one A and one B per module
    assert bc.adapter_bytes(adapter, torch.bfloat16) == 2 * spec.num_layers * per_layer
    assert adapter.nbytes() == 4 * spec.num_layers * per_layer

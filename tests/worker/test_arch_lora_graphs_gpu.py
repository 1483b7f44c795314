"""GPU: the architectures beyond Llama with adapters inside the decode graphs (marked gpu).

Per architecture (Qwen3, Gemma 2, Gemma 3, Phi-3 with its packed qkv_proj / gate_up_proj adapters), on a tiny
trained model whose sliding window (20) is shorter than the prompts: every bucket passed the start-up graph check
(whose probe adapters cover every module of the architecture); graph equals eager in every bucket with 0..4
adapters mixed with base rows; greedy tokens equal HF + PEFT bf16 for 16 tokens on at least 90 % of prompts. The base models against HF bf16: test_cuda_graphs_gpu.py
(its ARCHS include these).
"""
import pytest

from model_fixtures import CONFIDENT_STEPS, WINDOW, make_lora_adapters
from test_lora_graphs_gpu import _probe, assert_matches_peft_bf16
from loraserve import LLM, LoRARequest
from loraserve.models.registry import ARCHITECTURES

pytestmark = pytest.mark.gpu

ARCHS = {"qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
         "phi3": "Phi3ForCausalLM"}


@pytest.fixture(scope="module", params=list(ARCHS))
def setup(request, tiny_model_factory, tmp_path_factory):
    folder = tiny_model_factory(request.param, train_steps=CONFIDENT_STEPS)
    targets = list(ARCHITECTURES[ARCHS[request.param]].peft_target_modules())
    specs = [{"name": f"a{i}", "r": r, "lora_alpha": 2 * r, "target_modules": targets}
             for i, r in enumerate([4, 8, 16, 2])]
    paths = make_lora_adapters(folder, tmp_path_factory.mktemp(f"{request.param}-gpu-adapters"), specs, seed=3,
                               std=0.05)
    llm = LLM(folder, device="cuda", dtype="bfloat16", max_model_len=128, max_num_seqs=40, enable_lora=True,
              max_loras=4, max_lora_rank=16)
    for spec, path in zip(specs, paths):
        llm.add_lora(LoRARequest(spec["name"], path))
    return folder, dict(zip([s["name"] for s in specs], paths)), llm


def test_graph_equals_eager_for_every_bucket_with_adapters(setup):
    _, _, llm = setup
    ids = llm.engine.lora_manager.prepare({"a0", "a1", "a2", "a3"}, set())
    slots = [ids[n] for n in ("a0", "a1", "a2", "a3")]
    gr = llm.engine.runner.graph_runner
    assert sorted(gr.graphs) == gr.buckets, "a bucket failed the start-up integrity check"
    for bucket in gr.buckets:
        for active in (0, 1, 4):
            n = max(1, bucket - 1) if bucket > 1 else 1
            choices = [-1] + slots[:active]
            token_slots = [choices[i % len(choices)] for i in range(n)]
            graph, eager, base = _probe(llm, n, token_slots, seed=bucket * 10 + active)  # contexts up to 31 > WINDOW
            scale = eager.float().abs().max()
            assert (graph.float() - eager.float()).abs().max() <= 1e-2 * scale, f"bucket {bucket}, {active} active"
            for i, s in enumerate(token_slots):
                if s >= 0:
                    assert (graph[i].float() - base[i].float()).abs().max() > 1e-2 * scale, "LoRA dropped"


def test_graphs_with_lora_match_peft_bf16(setup):
    """35 prompts longer than the window: their prefill step (over 512 tokens) takes the factored gate/up path
    (GeLU-tanh's for Gemma), the decode steps the graphs."""
    folder, paths, llm = setup
    assert_matches_peft_bf16(llm, folder, paths, (WINDOW + 5, 60), seed=2)


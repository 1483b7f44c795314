"""/metrics exports the prefix cache's counters and a hit rate per adapter from the engine's stats (a tiny
engine on the CPU, read through the same ServerMetrics the server renders)."""
from model_fixtures import make_lora_adapters
from server_harness import metric, parse_metrics
from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.entrypoints.metrics import BASE_MODEL_LABEL, ServerMetrics


def _samples(metrics: ServerMetrics) -> dict:
    text, _ = metrics.render()
    return parse_metrics(text.decode())


def test_prefix_cache_counters_and_hit_rate_per_adapter(tiny_model_factory, tmp_path):
    folder = tiny_model_factory("llama")
    path = make_lora_adapters(folder, tmp_path, [{"name": "a", "r": 4, "target_modules": ["q_proj", "v_proj"]}])[0]
    llm = LLM(folder, device="cpu", max_model_len=128, block_size=8, enable_lora=True, max_loras=2, max_lora_rank=8)
    llm.add_lora(LoRARequest("a", path))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = list(range(10, 43))  # 33 tokens: 4 full blocks reusable
    for lora in (None, None, LoRARequest("a")):
        llm.generate({"prompt_token_ids": prompt}, params, lora_request=lora, use_tqdm=False)
    stats = llm.engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (3 * 33, 32)
    metrics = ServerMetrics()
    metrics.update(stats)
    samples = _samples(metrics)
    assert metric(samples, "loraserve_prefix_cache_queries_total") == 99
    assert metric(samples, "loraserve_prefix_cache_hits_total") == 32
    assert metric(samples, "loraserve_prefix_cache_hit_rate", adapter=BASE_MODEL_LABEL) == 32 / 66
    assert samples[("loraserve_prefix_cache_hit_rate", (("adapter", "a"),))] == 0.0  # exported, not just absent
    llm.engine.remove_lora("a")  # adapters that are gone leave the labels
    metrics.update(llm.engine.stats())
    assert ("loraserve_prefix_cache_hit_rate", (("adapter", "a"),)) not in _samples(metrics)

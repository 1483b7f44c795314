"""Asynchronous scheduling: the next step is launched before the current one's tokens are read.

Every test runs the same requests through an engine with async_scheduling on and one with it off and
requires the same results: greedy and seeded tokens, logprobs, stop ids and strings, max_tokens and
max_model_len limits, preemption under a tiny KV cache, aborts, mixed prefill/decode steps, and LoRA.
"""
import random


from model_fixtures import make_lora_adapters
from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.config import EngineArgs
from loraserve.engine.engine import LLMEngine


def _prompts(n, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _run(folder, requests, **options):
    """requests: (prompt ids, params, lora name or None); returns per request (token ids, finish reason,
    stop reason, logprobs) with async scheduling on, and the same with it off."""
    outs = {}
    for mode in (True, False):
        llm = LLM(folder, device="cpu", async_scheduling=mode, **{"max_model_len": 128, **options})
        got = llm.generate([{"prompt_token_ids": p} for p, _, _ in requests], [s for _, s, _ in requests],
                           lora_request=[LoRARequest(n) if n else None for _, _, n in requests])
        outs[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason,
                       o.outputs[0].logprobs) for o in got]
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
        assert not llm.engine.scheduler.has_unfinished()
    return outs[True], outs[False]


def test_async_equals_sync_greedy_seeded_limits_and_logprobs(tiny_model_factory):
    folder = tiny_model_factory("llama")
    prompts = _prompts(20, 1000, seed=1)
    kinds = [SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=17, temperature=0, ignore_eos=True, logprobs=3),
             SamplingParams(max_tokens=9, temperature=0.8, seed=7, ignore_eos=True),
             SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)]  # ends at max_model_len
    requests = [(p, kinds[i % len(kinds)], None) for i, p in enumerate(prompts)]
    on, off = _run(folder, requests, max_model_len=64, max_num_batched_tokens=48)
    assert on == off
    assert {o[1] for o in on} == {"length"}
    assert max(len(o[0]) for o in on) > 17, "some request was meant to run into max_model_len"


def test_async_equals_sync_with_stops(tiny_model_factory):
    folder = tiny_model_factory("llama")
    prompts = _prompts(8, 1000, seed=2)
    free = LLM(folder, device="cpu", max_model_len=128).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=20, temperature=0))
    requests = []
    for p, out in zip(prompts, free):
        ids = out.outputs[0].token_ids
        requests.append((p, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[ids[len(ids) // 2]]), None))
    on, off = _run(folder, requests)
    assert on == off
    assert any(o[1] == "stop" and len(o[0]) < 20 for o in on), "a stop token was meant to end some request early"


def test_async_equals_sync_under_preemption(tiny_model_factory):
    folder = tiny_model_factory("qwen2")
    requests = [(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), None)
                for p in _prompts(12, 1000, seed=4)]
    on, off = _run(folder, requests, block_size=8, num_gpu_blocks_override=16)
    assert on == off


def test_async_equals_sync_with_lora(tiny_model_factory, tmp_path):
    folder = tiny_model_factory("llama")
    specs = [{"name": f"a{i}", "r": 4 * (i + 1), "lora_alpha": 8,
              "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]} for i in range(3)]
    paths = make_lora_adapters(folder, tmp_path, specs, seed=5)
    requests = []
    for i, p in enumerate(_prompts(15, 1000, seed=6)):
        requests.append((p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                         [None, "a0", "a1", "a2"][i % 4]))
    outs = []
    for mode in (True, False):
        llm = LLM(folder, device="cpu", max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=16,
                  async_scheduling=mode)
        for spec, path in zip(specs, paths):
            llm.add_lora(LoRARequest(spec["name"], path))
        got = llm.generate([{"prompt_token_ids": p} for p, _, _ in requests], [s for _, s, _ in requests],
                           lora_request=[LoRARequest(n) if n else None for _, _, n in requests])
        outs.append([o.outputs[0].token_ids for o in got])
    assert outs[0] == outs[1]


def test_abort_while_a_step_is_in_flight(tiny_model_factory):
    folder = tiny_model_factory("llama")
    engine = LLMEngine.from_args(EngineArgs(folder, device="cpu", max_model_len=128))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for i, p in enumerate(_prompts(4, 1000, seed=8)):
        engine.add_request(f"r{i}", p, params)
    assert engine.step() == []  # the first step is launched, nothing read yet
    engine.step()
    assert engine.scheduler.running[0].num_pending_tokens == 1
    engine.abort_request("r1")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "r1", "an aborted request got an output"
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert sorted(finished) == ["r0", "r2", "r3"]
    assert all(len(t) == 30 for t in finished.values())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

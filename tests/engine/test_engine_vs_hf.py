"""The engine against HF transformers on tiny random models of each architecture (CPU, fp32)."""
import random

import pytest
import torch

from hf_reference import assert_matches_reference, load_hf_model, teacher_forced_logprobs
from model_fixtures import ARCHS
from loraserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_logprobs_match_hf(arch, tiny_model_factory):
    folder = tiny_model_factory(arch)
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=256)
    hf = load_hf_model(folder)
    prompts = _prompts(4, hf.config.vocab_size, seed=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].finish_reason == "length"
        assert_matches_reference(out, teacher_forced_logprobs(hf, prompt, out.outputs[0].token_ids))


def test_sharded_checkpoint_loads_and_matches_hf(tiny_model_factory):
    folder = tiny_model_factory("llama", shards=True)
    llm = LLM(folder, device="cpu", max_model_len=128)
    hf = load_hf_model(folder)
    prompt = _prompts(1, hf.config.vocab_size, seed=2)[0]
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert_matches_reference(out, teacher_forced_logprobs(hf, prompt, out.outputs[0].token_ids))


def test_batch_invariance_alone_batched_and_chunked(tiny_model_factory):
    folder = tiny_model_factory("llama")
    prompts = _prompts(16, 1000, seed=3)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(folder, device="cpu", max_model_len=256)
    alone = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts[:4]]
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    chunked_llm = LLM(folder, device="cpu", max_model_len=256, max_num_batched_tokens=7)
    chunked = [o.outputs[0].token_ids for o in chunked_llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert batched[:4] == alone
    assert chunked == batched


def test_preemption_under_tiny_kv_budget_gives_same_greedy_output(tiny_model_factory):
    folder = tiny_model_factory("qwen2")
    prompts = _prompts(12, 1000, seed=4)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = LLM(folder, device="cpu", max_model_len=128)
    expected = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], params)]
    tight = LLM(folder, device="cpu", max_model_len=128, block_size=8, num_gpu_blocks_override=16)
    got = tight.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert tight.engine.scheduler.num_preemptions > 0, "16 blocks of 8 tokens were meant to force preemption"
    assert tight.engine.block_manager.num_free_blocks == tight.engine.block_manager.num_blocks


def test_seeded_sampling_is_reproducible_per_request(tiny_model_factory):
    folder = tiny_model_factory("llama")
    llm = LLM(folder, device="cpu", max_model_len=128)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate(prompt, seeded)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)] * 5
    batch = llm.generate([prompt] * 5 + [prompt], others + [seeded])
    assert batch[-1].outputs[0].token_ids == alone
    other_seed = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_equal_greedy(tiny_model_factory):
    folder = tiny_model_factory("llama")
    llm = LLM(folder, device="cpu", max_model_len=128)
    prompt = {"prompt_token_ids": [9, 10, 11]}
    greedy = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    top_k = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True))[0]
    top_p = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, ignore_eos=True))[0]
    assert top_k.outputs[0].token_ids == greedy.outputs[0].token_ids == top_p.outputs[0].token_ids


def test_sampling_follows_the_model_distribution(tiny_model_factory):
    """First sampled token frequencies over many seeds track softmax(logits / T) of HF's model."""
    folder = tiny_model_factory("llama", weight_std=0.05)
    llm = LLM(folder, device="cpu", max_model_len=64)
    hf = load_hf_model(folder)
    prompt = [3, 4, 5]
    with torch.no_grad():
        probs = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / 0.7, dim=-1)
    n = 400
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, SamplingParams(max_tokens=1, temperature=0.7))
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outs]), minlength=probs.numel())
    top = probs.topk(3).indices
    for t in top:
        expected = float(probs[t]) * n
        sd = (n * float(probs[t]) * (1 - float(probs[t]))) ** 0.5
        assert abs(int(counts[t]) - expected) <= 4 * sd + 2


def test_stop_strings_and_stop_token_ids(tiny_model_factory, tiny_tokenizer):
    folder = tiny_model_factory("llama")
    llm = LLM(folder, device="cpu", max_model_len=128)
    prompt = {"prompt_token_ids": [20, 21, 22]}
    free = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].outputs[0]
    assert free.text == tiny_tokenizer.decode(free.token_ids, skip_special_tokens=True)
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    by_id = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id]))[0].outputs[0]
    assert by_id.token_ids == free.token_ids[:first + 1] and by_id.finish_reason == "stop"
    assert by_id.stop_reason == stop_id
    stop_text = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
    if stop_text.strip():
        by_text = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, stop=[stop_text]))[0].outputs[0]
        assert by_text.finish_reason == "stop" and by_text.stop_reason == stop_text
        assert by_text.text == free.text[:free.text.index(stop_text)]


def test_eager_warm_up_touches_no_sequence(tiny_model_factory):
    """The start-up warm-up (run on CUDA; here on the CPU) writes K/V into the dummy block only, and the
    engine's output afterwards still matches HF."""
    folder = tiny_model_factory("llama")
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=64, max_num_batched_tokens=300)
    runner = llm.engine.runner
    for layer in runner.attn_layers:
        layer.k_cache.fill_(7.0)
    runner.warm_up_eager()  # 32-34, 64-66, 128-130, 256-258 and 300 tokens, in sequences of at most 64
    for layer in runner.attn_layers:
        real = layer.k_cache[:runner.dummy_block]
        assert torch.equal(real, torch.full_like(real, 7.0)), "the warm-up wrote into a real KV block"
        assert not torch.equal(layer.k_cache[runner.dummy_block], torch.full_like(real[0], 7.0))
        layer.k_cache.zero_()
    hf = load_hf_model(folder)
    prompt = _prompts(1, hf.config.vocab_size, seed=4)[0]
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert_matches_reference(out, teacher_forced_logprobs(hf, prompt, out.outputs[0].token_ids))

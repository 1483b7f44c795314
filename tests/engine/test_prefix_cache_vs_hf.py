"""Prefix caching end to end on a tiny Llama against HF transformers (CPU, fp32): reuse of a shared prefix
(whole prompts, chunked prefill, synchronous scheduling), multi-turn reuse of generated tokens, prompt
logprobs, and the switch that turns it off."""
import argparse
import random

import pytest

from hf_reference import assert_matches_reference, load_hf_model, teacher_forced_logprobs
from loraserve import LLM, SamplingParams
from loraserve.entrypoints.engine_flags import add_engine_flags, engine_args

BS = 8
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    folder = tiny_model_factory("llama")
    return folder, load_hf_model(folder)


def _ids(rng, vocab, n):
    return [rng.randrange(3, vocab) for _ in range(n)]


def _generate(llm, prompt, params=GREEDY):
    """One request; returns its output and the (queries, hits) it added to the engine's counters."""
    before = llm.engine.stats()
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    after = llm.engine.stats()
    return out, (after.prefix_cache_queries - before.prefix_cache_queries,
                 after.prefix_cache_hits - before.prefix_cache_hits)


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16}, {"async_scheduling": False}],
                         ids=["whole-prompt", "chunked", "sync"])
def test_a_second_request_sharing_a_long_prefix_reuses_it_and_equals_hf(model, options):
    folder, hf = model
    llm = LLM(folder, device="cpu", max_model_len=256, block_size=BS, **options)
    rng = random.Random(0)
    shared = _ids(rng, hf.config.vocab_size, 70)  # 8 full blocks and 6 tokens
    first, second = shared + _ids(rng, hf.config.vocab_size, 5), shared + _ids(rng, hf.config.vocab_size, 9)
    out1, (queries, hits) = _generate(llm, first)
    assert (queries, hits) == (len(first), 0)
    out2, (queries, hits) = _generate(llm, second)
    assert (queries, hits) == (len(second), 64)  # the 8 shared full blocks
    out3, (queries, hits) = _generate(llm, second)  # the whole prompt cached: its last block is computed again
    assert hits == (len(second) - 1) // BS * BS
    for prompt, out in ((first, out1), (second, out2), (second, out3)):
        assert_matches_reference(out, teacher_forced_logprobs(hf, prompt, out.outputs[0].token_ids))
    assert out3.outputs[0].token_ids == out2.outputs[0].token_ids
    assert llm.engine.block_manager.num_used_blocks == 0 and llm.engine.block_manager.num_cached_blocks > 0


def test_the_next_turn_reuses_the_generated_tokens(model):
    """Blocks of generated tokens are cached too: a chat's next turn (prompt + answer + new message)
    finds the previous turn's prompt and answer."""
    folder, hf = model
    llm = LLM(folder, device="cpu", max_model_len=256, block_size=BS)
    rng = random.Random(1)
    turn1 = _ids(rng, hf.config.vocab_size, 21)
    out1, _ = _generate(llm, turn1)
    answer = out1.outputs[0].token_ids
    turn2 = turn1 + answer + _ids(rng, hf.config.vocab_size, 6)
    out2, (_, hits) = _generate(llm, turn2)
    computed = len(turn1) + len(answer) - 1  # the last sampled token was never fed back
    assert hits == computed // BS * BS > len(turn1) // BS * BS
    assert_matches_reference(out2, teacher_forced_logprobs(hf, turn2, out2.outputs[0].token_ids))


def test_prompt_logprobs_are_computed_for_every_position_of_a_cached_prompt(model):
    folder, hf = model
    llm = LLM(folder, device="cpu", max_model_len=256, block_size=BS)
    rng = random.Random(2)
    prompt = _ids(rng, hf.config.vocab_size, 30)
    _generate(llm, prompt)
    asked = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    out, (queries, hits) = _generate(llm, prompt, asked)
    assert (queries, hits) == (0, 0)  # nothing looked up: every prompt position's logits are needed
    ref = teacher_forced_logprobs(hf, prompt[:1], prompt[1:])  # [P-1, V]
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        for token, value in out.prompt_logprobs[pos].items():
            assert abs(value - float(ref[pos - 1, token])) < 1e-4, (pos, token)


def test_enable_prefix_caching_false_computes_everything(model):
    folder, hf = model
    rng = random.Random(3)
    prompt = _ids(rng, hf.config.vocab_size, 40)
    llm = LLM(folder, device="cpu", max_model_len=256, block_size=BS, enable_prefix_caching=False)
    outs = [_generate(llm, prompt) for _ in range(2)]
    assert [counts for _, counts in outs] == [(0, 0), (0, 0)]
    assert llm.engine.block_manager.num_cached_blocks == 0
    assert outs[0][0].outputs[0].token_ids == outs[1][0].outputs[0].token_ids
    assert_matches_reference(outs[1][0], teacher_forced_logprobs(hf, prompt, outs[1][0].outputs[0].token_ids))


@pytest.mark.parametrize("flags,expected", [([], True), (["--enable-prefix-caching"], True),
                                            (["--no-enable-prefix-caching"], False)])
def test_prefix_caching_flags(flags, expected):
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = engine_args(parser.parse_args(flags), enable_lora=False)
    assert args.enable_prefix_caching is expected
    assert args.create_config(512).cache.enable_prefix_caching is expected

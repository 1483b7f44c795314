"""The sampler's vLLM options against references: min_p and repetition_penalty (HF's logits processors),
presence/frequency penalties, logit_bias and min_tokens (the logits they should give), and through the
engine: penalties against HF greedy decoding (with the token in flight under asynchronous scheduling), n
completions, min_tokens, stop strings kept with include_stop_str_in_output, special tokens with
skip_special_tokens=False. Each runs on the CPU and, marked gpu, on CUDA (the engine in fp32 with its CUDA
graphs, the references on the CPU)."""
import pytest
import torch
from hf_reference import load_hf_model, teacher_forced_logprobs
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper)

from loraserve import LLM, SamplingParams
from loraserve.worker.sampler import Sampler, TokenHistory

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_keeps_what_hf_keeps(device):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 80, generator=gen) * 3
    sampler = Sampler(torch.device(device), seed=0)
    for temperature, min_p in ((1.0, 0.1), (0.7, 0.05), (1.3, 0.3)):
        params = [SamplingParams(temperature=temperature, min_p=min_p)] * 6
        probs = sampler._filtered_probs(logits.to(device), params).cpu()
        scores = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
        want = scores.softmax(dim=-1)
        assert torch.equal(probs > 0, want > 0)
        kept = probs / probs.sum(dim=-1, keepdim=True)
        torch.testing.assert_close(kept, want, rtol=1e-5, atol=1e-7)
    plain = sampler._filtered_probs(logits.to(device), [SamplingParams(temperature=0.7)] * 6)
    assert (plain > 0).all()  # min_p 0 drops nothing


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_and_min_tokens_change_the_logits_as_asked(device):
    sampler = Sampler(torch.device(device), seed=0, eos_token_ids={3})
    logits = torch.zeros(3, 10, device=device)
    logits[:, 3] = 5.0  # EOS is the greedy choice
    logits[:, 7] = 4.0
    params = [SamplingParams(temperature=0.0, logit_bias={1: 100.0}),  # the bias wins
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7]),  # EOS and 7 held back
              SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)]  # EOS allowed: it stops nothing
    want = logits.clone()
    want[0, 1] += 100.0
    want[1, 3] = want[1, 7] = float("-inf")
    got = sampler._biased_and_masked(logits, params, [0, 1, 1])
    assert got.device == logits.device and torch.equal(got, want)
    assert sampler(logits, ["a", "b", "c"], params, [0, 1, 1]).to_host().token_ids == [1, 0, 3]
    # min_tokens reached: nothing held back
    assert sampler(logits, ["a", "b", "c"], params, [0, 2, 2]).to_host().token_ids == [1, 3, 3]


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_hf_and_the_openai_formula(device):
    gen = torch.Generator().manual_seed(1)
    vocab = 40
    logits = torch.randn(3, vocab, generator=gen) * 2
    prompts = [[1, 2, 3, 3], [5], [7, 8]]
    outputs = [[3, 9, 9, 4], [5, 5], []]
    in_flight = torch.tensor([11, 9, 22])  # the samples of the step in flight; row 0's newest token is 9
    history = TokenHistory(prompts, outputs, [1, None, 2], in_flight.to(device))
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3),
              SamplingParams(repetition_penalty=0.8),
              SamplingParams(frequency_penalty=-1.0)]
    got = Sampler(torch.device(device), seed=0)._penalized(logits.to(device), params, history).cpu()
    want = logits.clone()
    for i, p in enumerate(params):
        generated = outputs[i] + ([int(in_flight[history.pending[i]])] if history.pending[i] is not None else [])
        for token in generated:
            want[i, token] -= p.frequency_penalty
        for token in set(generated):
            want[i, token] -= p.presence_penalty
        seen = torch.tensor([prompts[i] + generated])
        want[i:i + 1] = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(seen, want[i:i + 1])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.fixture(scope="module", params=DEVICES)
def llm(request, tiny_model_factory):
    """The tiny model's engine in fp32: on the CPU, or on CUDA with its decode graphs."""
    return LLM(tiny_model_factory("llama"), device=request.param, dtype="float32", max_model_len=128)


def test_n_completions_offline(llm):
    prompt = {"prompt_token_ids": [5, 17, 42, 9, 11]}
    params = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, completion in enumerate(out.outputs):  # completion i is the request with seed + i
        alone = llm.generate(prompt, SamplingParams(seed=7 + i, temperature=1.0, max_tokens=6, ignore_eos=True),
                             use_tqdm=False)[0]
        assert completion.token_ids == alone.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    with pytest.raises(ValueError, match="n must be a positive integer"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="one completion per request"):
        llm.engine.add_request("x", [1, 2], SamplingParams(n=2))


def test_min_tokens_holds_stop_tokens_back(llm):
    prompt = {"prompt_token_ids": [5, 17, 42, 9, 11]}
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    first = free[0]
    stopped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first], min_tokens=3),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]
    assert held.token_ids[0] != first


def test_stop_string_kept_and_special_tokens_shown(llm):
    tokenizer = llm.get_tokenizer()
    prompt = "Once upon a time"
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), f"no stop string to take from {text!r}"
    cut = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=stop),
                       use_tqdm=False)[0].outputs[0].text
    kept = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=stop,
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0].text
    assert kept == cut + stop and text.startswith(kept)
    special = tokenizer.all_special_ids[0]
    forced = dict(temperature=0.0, max_tokens=2, ignore_eos=True, logit_bias={special: 100.0})
    hidden = llm.generate(prompt, SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    shown = llm.generate(prompt, SamplingParams(**forced, skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert hidden.token_ids == shown.token_ids == [special, special]
    assert hidden.text == "" and shown.text == tokenizer.decode([special, special])


def test_penalized_greedy_decoding_matches_hf(llm, tiny_model_factory):
    """Greedy tokens under penalties, the engine with asynchronous scheduling (the newest token is still on
    the device when the next is sampled) against HF: generate() with its repetition penalty, and the argmax
    of HF's teacher-forced logits minus the presence/frequency penalties at every position."""
    hf = load_hf_model(tiny_model_factory("llama"))
    prompt = [5, 17, 42, 9, 11, 17, 5]
    assert llm.engine.config.async_scheduling
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                                    repetition_penalty=1.5), use_tqdm=False)[0]
    want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, repetition_penalty=1.5,
                       min_new_tokens=16, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == want
    # a negative frequency penalty: the random model rarely repeats itself, this makes it (so it bites)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=0.7, frequency_penalty=-2.0)
    tokens = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    ref = teacher_forced_logprobs(hf, prompt, tokens)  # [16, V]
    for pos, token in enumerate(tokens):
        counts = torch.bincount(torch.tensor(tokens[:pos], dtype=torch.long), minlength=ref.shape[1]).float()
        penalized = ref[pos] + 2.0 * counts - 0.7 * (counts > 0).float()
        assert int(penalized.argmax()) == token, pos
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert plain != tokens  # the penalties changed something


@pytest.mark.parametrize("budget", [None, 5])  # the whole prompt in one step, or in chunks of 5 tokens
def test_prompt_logprobs_match_hf(tiny_model_factory, budget):
    folder = tiny_model_factory("llama")
    llm = LLM(folder, device="cpu", max_model_len=64, **({"max_num_batched_tokens": budget} if budget else {}))
    hf = load_hf_model(folder)
    prompt = [5, 17, 42, 9, 11, 17, 5, 30, 31, 32, 33, 34]
    asked = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    out = llm.generate({"prompt_token_ids": prompt}, asked, use_tqdm=False)[0]
    ref = teacher_forced_logprobs(hf, prompt[:1], prompt[1:])  # [P-1, V]: HF's logprobs of prompt tokens 1..P-1
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry, want = out.prompt_logprobs[pos], ref[pos - 1]
        top = want.topk(3)
        assert set(entry) == {prompt[pos], *top.indices.tolist()}
        for token, value in entry.items():
            assert abs(value - float(want[token])) < 1e-4, (pos, token)
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids

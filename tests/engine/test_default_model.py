"""The built-in default model (SmolLM2-135M-Instruct from its GGUF) on the CPU."""
import pytest
import torch

from loraserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def default_llm():
    return LLM(device="cpu")


def test_chat_answers_paris(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(max_tokens=20, temperature=0))
    assert "Paris" in out[0].outputs[0].text


def test_default_model_matches_hf_gguf_load(default_llm):
    """Greedy tokens and top logprobs equal HF transformers loading the same GGUF (fp32)."""
    import os

    from transformers import AutoModelForCausalLM

    from hf_reference import assert_matches_reference, teacher_forced_logprobs
    from loraserve.models.gguf_loader import default_model_path

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    tok = default_llm.get_tokenizer()
    prompts = ["The history of Rome", "def fibonacci(n):"]
    outs = default_llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=3))
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == tok.encode(prompt)
        assert_matches_reference(out, teacher_forced_logprobs(hf, out.prompt_token_ids, out.outputs[0].token_ids),
                                 atol=2e-4)

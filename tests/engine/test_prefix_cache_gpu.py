"""GPU (marked gpu): prefix caching with the Triton attention kernels, CUDA graphs and LoRA. Requests of the
base model and two adapters share a system prompt; later ones start their prefill after cached blocks (whole
or in chunks) and decode in the graphs. fp32, so every row is held to PEFT's tokens and logprobs."""
import random

import pytest

from hf_reference import assert_matches_reference, load_peft_model, teacher_forced_logprobs
from model_fixtures import make_lora_adapters
from loraserve import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.gpu

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("budget", [None, 32])  # prefills after the cached blocks whole, or in chunks of 32
def test_prefix_hits_on_cuda_match_peft(tiny_model_factory, tmp_path, budget):
    folder = tiny_model_factory("llama")
    specs = [{"name": n, "r": 8, "lora_alpha": 16, "target_modules": TARGETS} for n in ("a", "b")]
    adapters = dict(zip(("a", "b"), make_lora_adapters(folder, tmp_path, specs, seed=5)))
    llm = LLM(folder, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, enable_lora=True,
              max_loras=2, max_lora_rank=8, **({"max_num_batched_tokens": budget} if budget else {}))
    assert llm.engine.runner.graph_runner is not None
    for name, path in adapters.items():
        llm.add_lora(LoRARequest(name, path))
    rng = random.Random(0)
    vocab = llm.engine.hf_config.vocab_size
    system = [rng.randrange(3, vocab) for _ in range(150)]
    names = [None, "a", "b"] * 3
    prompts = [system + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))] for _ in names]
    outs = []
    for i in range(0, len(names), 3):  # the first three fill the cache, the next ones hit it
        outs += llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + 3]], GREEDY,
                             lora_request=[LoRARequest(n) if n else None for n in names[i:i + 3]], use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits == 6 * (150 // 16 * 16)
    peft = load_peft_model(folder, adapters).to("cuda")
    for name, prompt, out in zip(names, prompts, outs):
        ref = teacher_forced_logprobs(peft, prompt, out.outputs[0].token_ids, adapter_names=[name or "__base__"])
        assert_matches_reference(out, ref, atol=2e-3)

"""Prefix caching with adapters against HF transformers + PEFT (CPU, fp32): cached blocks are keyed by the
adapter's identity, never its name, so no block computed with one set of weights serves another (base model,
two adapters, a name re-added with other weights, adapter files changed on disk while out of the caches), and
shared prefixes of three identities in one batch under a tiny KV cache still give PEFT's output."""
import random
import shutil

import pytest

from hf_reference import assert_matches_reference, load_peft_model, teacher_forced_logprobs
from model_fixtures import make_lora_adapters
from loraserve import LLM, LoRARequest, SamplingParams

BS = 8
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    folder = tiny_model_factory("llama")
    specs = [{"name": name, "r": 8, "lora_alpha": 16, "target_modules": TARGETS} for name in ("a", "b", "c")]
    paths = make_lora_adapters(folder, tmp_path_factory.mktemp("prefix-adapters"), specs, seed=3)
    adapters = dict(zip("abc", paths))
    return folder, adapters, load_peft_model(folder, adapters)


def _prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]  # within the vocabulary of every tiny tokenizer


def _check(peft, prompt, out, adapter):
    ref = teacher_forced_logprobs(peft, prompt, out.outputs[0].token_ids, adapter_names=[adapter or "__base__"])
    assert_matches_reference(out, ref)


def _generate(llm, prompts, names):
    """Requests (prompt ids, adapter name or None); returns the outputs and the prefix-cache hits they added."""
    before = llm.engine.stats().prefix_cache_hits
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                        lora_request=[LoRARequest(n) if n else None for n in names], use_tqdm=False)
    return outs, llm.engine.stats().prefix_cache_hits - before


def test_the_same_prompt_under_base_and_two_adapters_shares_no_block(setup):
    folder, adapters, peft = setup
    llm = LLM(folder, device="cpu", max_model_len=256, block_size=BS, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    for name in ("a", "b"):
        llm.add_lora(LoRARequest(name, adapters[name]))
    prompt = _prompt(0, 45)
    firsts = []
    for name in (None, "a", "b"):  # one after the other: the earlier ones' blocks are cached when it starts
        outs, hits = _generate(llm, [prompt], [name])
        assert hits == 0, f"{name} found blocks of another identity"
        _check(peft, prompt, outs[0], name)
        firsts.append(outs[0].outputs[0].token_ids)
    assert len({tuple(t) for t in firsts}) == 3, "the adapters were meant to change the output"
    outs, hits = _generate(llm, [prompt] * 3, [None, "a", "b"])  # each finds its own blocks again
    assert hits == 3 * ((len(prompt) - 1) // BS * BS)
    assert [o.outputs[0].token_ids for o in outs] == firsts
    per_adapter = llm.engine.stats().prefix_cache_adapters
    assert {name: counts["hits"] for name, counts in per_adapter.items()} == {None: 40, "a": 40, "b": 40}


def test_a_name_removed_and_added_again_with_other_weights_serves_the_new_ones(setup, tmp_path):
    folder, adapters, peft = setup
    llm = LLM(folder, device="cpu", max_model_len=256, block_size=BS, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    prompt = _prompt(1, 40)
    llm.add_lora(LoRARequest("x", adapters["a"]))
    outs, _ = _generate(llm, [prompt], ["x"])
    _check(peft, prompt, outs[0], "a")
    llm.remove_lora("x")
    llm.add_lora(LoRARequest("x", adapters["b"]))
    outs, hits = _generate(llm, [prompt], ["x"])
    assert hits == 0
    _check(peft, prompt, outs[0], "b")
    outs, hits = _generate(llm, [prompt], ["x"])  # the new weights' blocks are reused
    assert hits == (len(prompt) - 1) // BS * BS
    _check(peft, prompt, outs[0], "b")


def test_adapter_files_changed_on_disk_while_out_of_the_caches_serve_the_new_weights(setup, tmp_path):
    """One adapter in the GPU pool and one in the host cache: running "b" pushes "x" out of both; then the
    files of "x" change. The next request of "x" waits for "x" to be read again (no step waits for a read) and
    starts under the new read's identity: none of the old read's cached blocks is used, nothing starts over,
    and its output is PEFT's of the new files, not a mix."""
    folder, adapters, peft = setup
    live = tmp_path / "x"
    shutil.copytree(adapters["a"], live)
    llm = LLM(folder, device="cpu", max_model_len=256, block_size=BS, enable_lora=True, max_loras=1,
              max_lora_rank=8, max_cpu_loras=1)
    manager = llm.engine.lora_manager
    assert manager.pool.num_pages == manager.pool.layout.pages_for(8)  # room for one adapter of rank 8
    llm.add_lora(LoRARequest("x", str(live)))
    llm.add_lora(LoRARequest("b", adapters["b"]))
    prompt = _prompt(2, 40)
    outs, _ = _generate(llm, [prompt], ["x"])
    _check(peft, prompt, outs[0], "a")
    _generate(llm, [_prompt(3, 12)], ["b"])
    assert manager.resident_on_gpu == ["b"] and manager.resident_on_cpu == ["b"]
    shutil.rmtree(live)
    shutil.copytree(adapters["c"], live)
    restarts = llm.engine.scheduler.num_preemptions
    outs, hits = _generate(llm, [prompt], ["x"])
    assert hits == 0, "blocks of the old weights were used"
    assert llm.engine.scheduler.num_preemptions == restarts
    _check(peft, prompt, outs[0], "c")
    outs, hits = _generate(llm, [prompt], ["x"])  # the new read's blocks are found again
    assert hits > 0
    _check(peft, prompt, outs[0], "c")


def test_shared_prefixes_of_three_identities_in_one_batch_under_a_tiny_kv_cache(setup):
    """12 requests (base, "a", "b" in turn) whose prompts share one 33-token system prompt, in one batch, with
    20 KV blocks of 8 tokens: cached blocks are reused, evicted and requests preempted; every row equals
    PEFT's, and every block is free at the end."""
    folder, adapters, peft = setup
    llm = LLM(folder, device="cpu", max_model_len=128, block_size=BS, num_gpu_blocks_override=20,
              max_num_batched_tokens=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    for name in ("a", "b"):
        llm.add_lora(LoRARequest(name, adapters[name]))
    system = _prompt(4, 33)
    prompts = [system + _prompt(10 + i, 3 + i % 5) for i in range(12)]
    names = [(None, "a", "b")[i % 3] for i in range(12)]
    outs, hits = _generate(llm, prompts, names)
    for prompt, name, out in zip(prompts, names, outs):
        _check(peft, prompt, out, name)
    engine = llm.engine
    assert hits > 0 and engine.scheduler.num_preemptions > 0 and engine.block_manager.num_evictions > 0, \
        "the run was meant to reuse cached blocks, evict some and preempt requests"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.lora_manager.refcounts

"""Multi-LoRA against HF transformers + PEFT (CPU, fp32): mixed batches, churn, broken adapters."""
import random

import pytest

from hf_reference import assert_matches_reference, load_peft_model, teacher_forced_logprobs
from model_fixtures import make_lora_adapters
from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.errors import UnknownLoRAError

ADAPTER_SPECS = [
    {"name": "r4", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"]},
    {"name": "r8_rslora", "r": 8, "lora_alpha": 32, "use_rslora": True,
     "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]},
    {"name": "qv_only", "r": 16, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    {"name": "pattern", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "gate_proj", "up_proj"],
     "rank_pattern": {"gate_proj": 4}, "alpha_pattern": {"up_proj": 4}},
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def lora_setup(tiny_model_factory, tmp_path_factory):
    folder = tiny_model_factory("llama")
    paths = make_lora_adapters(folder, tmp_path_factory.mktemp("adapters"), ADAPTER_SPECS, seed=1)
    return folder, dict(zip([s["name"] for s in ADAPTER_SPECS], paths))


def test_mixed_adapter_batch_matches_peft(lora_setup):
    folder, adapters = lora_setup
    llm = LLM(folder, device="cpu", max_model_len=256, enable_lora=True, max_loras=4, max_lora_rank=16)
    rng = random.Random(0)
    rows = [None, "r4", "r8_rslora", "qv_only", "pattern", None, "r4", "pattern"]
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(2, 30))] for _ in rows]
    requests = [LoRARequest(name, adapters[name]) if name else None for name in rows]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=requests)
    peft = load_peft_model(folder, adapters)
    for name, prompt, out in zip(rows, prompts, outputs):
        assert out.lora_name == name
        ref = teacher_forced_logprobs(peft, prompt, out.outputs[0].token_ids,
                                      adapter_names=[name or "__base__"])
        assert_matches_reference(out, ref)
    # the adapters really change the output: the base row's prompt under each adapter gives other logprobs
    names = ["r4", "r8_rslora", "qv_only", "pattern"]
    per_adapter = llm.generate([{"prompt_token_ids": prompts[0]}] * 4, GREEDY,
                               lora_request=[LoRARequest(n) for n in names])
    base_first = outputs[0].outputs[0].logprobs[0]
    for out in per_adapter:
        assert out.outputs[0].logprobs[0] != base_first


def test_churn_matches_no_churn_output_and_respects_limits(lora_setup, tmp_path_factory):
    folder, _ = lora_setup
    specs = [{"name": f"a{i}", "r": [4, 8, 16][i % 3], "lora_alpha": 16,
              "target_modules": ["q_proj", "v_proj", "down_proj"]} for i in range(8)]
    paths = make_lora_adapters(folder, tmp_path_factory.mktemp("churn"), specs, seed=7)
    rng = random.Random(5)
    jobs = [(rng.randrange(8), [rng.randrange(3, 1000) for _ in range(rng.randint(2, 12))]) for _ in range(200)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    tight_outputs = []

    def run(llm, batch_size, keep=None):
        results = []
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start:start + batch_size]
            outs = llm.generate([{"prompt_token_ids": p} for _, p in chunk], params,
                                lora_request=[LoRARequest(f"a{i}", paths[i]) for i, _ in chunk])
            results += [o.outputs[0].token_ids for o in outs]
            if keep is not None:
                keep += outs
        return results

    roomy = LLM(folder, device="cpu", max_model_len=64, enable_lora=True, max_loras=8, max_lora_rank=16,
                max_cpu_loras=8)
    expected = run(roomy, 1)
    page_bytes = roomy.engine.lora_manager.pool.page_bytes
    unit = roomy.engine.lora_manager.pages_of("a1")  # rank 8: ranks 4 and 8 take one unit of pages, rank 16 two
    # a pool of 4 units, 2 adapters per step, 3 in the host cache
    tight = LLM(folder, device="cpu", max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=16,
                lora_gpu_memory=(4 * unit + 0.5) * page_bytes / 2**30, max_cpu_loras=3)
    engine, manager = tight.engine, tight.engine.lora_manager
    assert manager.pool.num_pages == 4 * unit
    assert [roomy.engine.lora_manager.pages_of(f"a{i}") for i in range(3)] == [unit, unit, 2 * unit]
    peak = {"pages": 0, "cpu": 0, "running": 0}
    original_step = engine.step

    def checked_step():
        outputs = original_step()
        running = {s.lora_name for s in engine.scheduler.running if s.lora_name}
        assert running <= set(manager.resident_on_gpu), "a running adapter was evicted from the pool"
        peak["pages"] = max(peak["pages"], manager.pool.used_pages)
        peak["cpu"] = max(peak["cpu"], len(manager.resident_on_cpu))
        peak["running"] = max(peak["running"], len(running))
        return outputs

    engine.step = checked_step
    assert run(tight, 16, tight_outputs) == expected
    # under heavy eviction the outputs still equal PEFT's (tokens, and logprobs within 1e-4), every 8th job
    peft = load_peft_model(folder, {f"a{i}": path for i, path in enumerate(paths)})
    for (i, prompt), out in list(zip(jobs, tight_outputs))[::8]:
        ref = teacher_forced_logprobs(peft, prompt, out.outputs[0].token_ids, adapter_names=[f"a{i}"])
        assert_matches_reference(out, ref)
    assert peak["pages"] <= 4 * unit and peak["cpu"] <= 3 and peak["running"] == 2
    assert manager.num_gpu_evictions > 0 and not manager.refcounts
    # pages only return on eviction: what is resident accounts for every used page
    assert manager.pool.used_pages == sum(manager.pages_of(n) for n in manager.resident_on_gpu)


def test_unknown_adapter_and_lora_disabled(lora_setup):
    folder, adapters = lora_setup
    llm = LLM(folder, device="cpu", max_model_len=64, enable_lora=True, max_lora_rank=16)
    with pytest.raises(UnknownLoRAError, match="nope"):
        llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, lora_request=LoRARequest("nope"))
    plain = LLM(folder, device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate({"prompt_token_ids": [5, 6]}, GREEDY, lora_request=LoRARequest("r4", adapters["r4"]))


def test_add_remove_list_and_in_flight_unload(lora_setup):
    folder, adapters = lora_setup
    llm = LLM(folder, device="cpu", max_model_len=64, enable_lora=True, max_lora_rank=16)
    llm.add_lora(LoRARequest("r4", adapters["r4"]))
    llm.add_lora(LoRARequest("qv", adapters["qv_only"]), pinned=True)
    assert sorted(llm.list_loras()) == ["qv", "r4"]
    expected = llm.generate({"prompt_token_ids": [7, 8, 9]}, GREEDY, LoRARequest("r4"))[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("inflight", [7, 8, 9], GREEDY, LoRARequest("r4"))
    engine.step()
    llm.remove_lora("r4")
    assert llm.list_loras() == ["qv"]
    with pytest.raises(UnknownLoRAError):
        engine.add_request("late", [7, 8, 9], GREEDY, LoRARequest("r4"))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert done[0].outputs[0].token_ids == expected
    assert "r4" not in engine.lora_manager.resident_on_gpu and not engine.lora_manager.refcounts
    with pytest.raises(UnknownLoRAError):
        llm.remove_lora("r4")


def test_broken_adapters_are_refused_and_engine_keeps_serving(lora_setup, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from loraserve.lora.adapter import LoRAAdapterError

    folder, adapters = lora_setup
    llm = LLM(folder, device="cpu", max_model_len=64, enable_lora=True, max_lora_rank=8)
    good = llm.generate({"prompt_token_ids": [4, 5, 6]}, GREEDY, LoRARequest("r4", adapters["r4"]))[0]

    def broken(name, edit_config=None, edit_tensors=None, source="r4"):
        dst = tmp_path / name
        shutil.copytree(adapters[source], dst)
        if edit_config:
            cfg = json.loads((dst / "adapter_config.json").read_text())
            edit_config(cfg)
            (dst / "adapter_config.json").write_text(json.dumps(cfg))
        if edit_tensors:
            tensors = load_file(dst / "adapter_model.safetensors")
            edit_tensors(tensors)
            save_file(tensors, dst / "adapter_model.safetensors")
        return str(dst)

    def nan(t):
        key = next(k for k in t if "lora_A" in k)
        t[key][0, 0] = float("nan")

    cases = {
        "nan": (broken("nan", edit_tensors=nan), "NaN"),
        "rank": (broken("rank", source="qv_only"), "max_lora_rank"),
        "dora": (broken("dora", edit_config=lambda c: c.update(use_dora=True)), "DoRA"),
        "target": (broken("target", edit_config=lambda c: c.update(target_modules=["foo_proj"])), "foo_proj"),
    }
    for name, (path, problem) in cases.items():
        with pytest.raises(LoRAAdapterError, match=problem) as info:
            llm.generate({"prompt_token_ids": [4, 5, 6]}, GREEDY, LoRARequest(name, path))
        assert name in str(info.value)
    again = llm.generate({"prompt_token_ids": [4, 5, 6]}, GREEDY, LoRARequest("r4"))[0]
    assert again.outputs[0].token_ids == good.outputs[0].token_ids
    assert sorted(llm.list_loras()) == ["r4"]


def test_adapter_broken_after_registration_fails_only_its_requests(lora_setup, tmp_path):
    """Files removed while the adapter was out of both caches: its request ends with an error naming
    the adapter; the base request in the same batch finishes normally; the engine keeps serving."""
    import shutil

    folder, adapters = lora_setup
    moved = tmp_path / "r4-copy"
    shutil.copytree(adapters["r4"], moved)
    llm = LLM(folder, device="cpu", max_model_len=64, enable_lora=True, max_loras=1, max_cpu_loras=1,
              max_lora_rank=16)
    llm.add_lora(LoRARequest("fragile", str(moved)))
    llm.add_lora(LoRARequest("other", adapters["qv_only"]))  # evicts "fragile" from the CPU cache
    base_alone = llm.generate({"prompt_token_ids": [4, 5, 6]}, GREEDY)[0].outputs[0].token_ids
    shutil.rmtree(moved)
    outs = llm.generate([{"prompt_token_ids": [7, 8]}, {"prompt_token_ids": [4, 5, 6]}], GREEDY,
                        lora_request=[LoRARequest("fragile"), None])
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert "fragile" in outs[0].error
    assert outs[1].error is None and outs[1].outputs[0].token_ids == base_alone
    assert "fragile" not in llm.list_loras()
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert llm.generate({"prompt_token_ids": [4, 5]}, GREEDY, LoRARequest("other"))[0].error is None


def test_pinning_never_evicts_an_adapter_in_use_and_leaves_room(lora_setup):
    """A pool that r4 and r8_rslora fill together (max_lora_rank 8): with both running, pinning "pattern" waits
    for them; later a pin that would leave no room for a max-rank adapter is refused."""
    from loraserve.errors import InvalidRequestError

    folder, adapters = lora_setup
    probe = LLM(folder, device="cpu", max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    for name in ("r4", "r8_rslora", "pattern"):
        probe.add_lora(LoRARequest(name, adapters[name]))
    pm = probe.engine.lora_manager
    room = pm.pages_of("r4") + pm.pages_of("r8_rslora")
    largest = pm.pool.layout.pages_for(8)
    assert pm.pages_of("pattern") + largest <= room  # pinning "pattern" leaves room for a max-rank adapter
    assert pm.pages_of("pattern") + pm.pages_of("r4") + largest > room  # and pinning r4 beside it would not
    llm = LLM(folder, device="cpu", max_model_len=64, enable_lora=True, max_loras=2, max_lora_rank=8,
              lora_gpu_memory=(room + 0.5) * pm.pool.page_bytes / 2**30)
    engine, manager = llm.engine, llm.engine.lora_manager
    assert manager.pool.num_pages == room
    llm.add_lora(LoRARequest("r4", adapters["r4"]))  # registered first: add_request would read them in the
    llm.add_lora(LoRARequest("r8", adapters["r8_rslora"]))  # background, and the first step might not run them
    engine.add_request("a", [4, 5, 6], GREEDY, LoRARequest("r4"))
    engine.add_request("b", [4, 5, 6], GREEDY, LoRARequest("r8"))
    engine.step()  # both adapters now fill the pool with requests in flight
    with pytest.raises(InvalidRequestError, match="in flight"):
        llm.add_lora(LoRARequest("p", adapters["pattern"]), pinned=True)
    assert set(manager.resident_on_gpu) == {"r4", "r8"} and not manager.pinned
    while engine.has_unfinished_requests():
        engine.step()
    llm.add_lora(LoRARequest("p", adapters["pattern"]), pinned=True)  # now an idle adapter makes room
    assert "p" in manager.resident_on_gpu and manager.pinned == {"p"}
    with pytest.raises(InvalidRequestError, match="leave room"):
        llm.add_lora(LoRARequest("r4", adapters["r4"]), pinned=True)  # already registered: still limited
